"""bench.acceptance's step replay (draft chains, top-2 trees, the real lookahead cache) and
bench.traces' sampling, on hand-made sequences: no model needed."""
from __future__ import annotations

import json
import random

import pytest

from bench import _acceptance_sim as sim
from bench import _workloads, traces
from bench.acceptance import lookahead_cache, measure_draft, measure_lookahead
from hetero.core.protocols import TokenTree

OUT = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
# The draft's greedy token at each position: wrong at positions 3 and 7.
TOP1 = [10, 11, 12, 99, 14, 15, 16, 98, 18, 19, 20]
TOP2 = [0, 0, 0, 13, 0, 0, 0, 0, 0, 0, 0]


def test_matching_runs():
    assert sim.matching_runs([True, True, False, True, False, True]) == [2, 1, 0, 1, 0, 1]


def test_chain_steps_follow_the_reference():
    # From position 1: 11, 12 right, 99 wrong -> 2 accepted, bonus 13 (position 3); next step at 4.
    # From 4: 14 15 16 right, 98 wrong -> 3, bonus 17; next at 8: 18 19 (20 is the last token: its bonus).
    log = sim.replay(len(OUT), sim.chain_steps(TOP1, OUT, k=8), depth=8)
    assert log.accepted == [2, 3, 2]
    assert sum(a + 1 for a in log.accepted) == len(OUT) - 1  # every position after the prefill's covered once
    capped = sim.replay(len(OUT), sim.chain_steps(TOP1, OUT, k=2), depth=2)
    assert capped.accepted == [2, 2, 0, 2] and max(capped.accepted) <= 2


def test_top2_tree_accepts_the_second_choice_at_its_first_level():
    step = sim.chain_steps(TOP1, OUT, k=4, branch=TOP2, branch_depth=1)
    assert step(3) == 4  # 13 is the draft's second choice at 3, then 14 15 16 are its greedy tokens
    assert step(2) == 1  # 12 right, then 99 != 13 below it: the second choice only counts at the first level
    assert sim.chain_steps(TOP1, OUT, k=4)(3) == 0


def test_step_log_statistics():
    log = sim.StepLog(accepted=[2, 0, 1, 2], depth=[2, 2, 2, 2])
    assert log.mean_accepted_length() == pytest.approx((5 + 4) / 4)
    assert log.per_position_acceptance(3) == [pytest.approx(3 / 4), pytest.approx(2 / 3), 0.0]


def test_tree_accepted_walks_the_longest_matching_path():
    # root -> 5 -> 6 -> 7 ; root -> 5 -> 8 ; root -> 9
    tree = TokenTree(tokens=[5, 6, 7, 8, 9], parents=[-1, 0, 1, 0, -1])
    assert sim.tree_accepted(tree, [5, 8, 1]) == 2
    assert sim.tree_accepted(tree, [5, 6, 7, 4]) == 3
    assert sim.tree_accepted(tree, [1]) == 0
    assert sim.tree_depth(tree) == 3


def test_lookahead_replay_copies_a_repeated_prompt():
    text = list(range(100, 140))
    prompt, out = [1, 2] + text + [3], text
    log = sim.replay_lookahead(lookahead_cache("raw", 8, []), "r", prompt, out, max_nodes=16)
    assert sum(a + 1 for a in log.accepted) == len(out) - 1
    assert log.mean_accepted_length() > 5  # the answer is the prompt: raw copies it 8 deep
    assert max(log.depth) <= 8


def test_draft_plus_lookahead_takes_the_longer_of_the_two():
    out = list(range(100, 140))
    never = [0] * len(out)
    refs = [{"id": "a", "prompt_ids": [1, 2, 3], "output_ids": out}]
    tops = [{"top1": out, "top2": never}]
    logs = measure_lookahead(refs, 8, 16, [], tops)
    both, cache_only = logs["draft-chain-8+lookahead-hybrid"], logs["lookahead-hybrid"]
    assert cache_only.mean_accepted_length() < 2  # nothing to copy: the output never repeats
    assert both.accepted == measure_draft(refs, tops)["draft-chain-8"].accepted  # the draft is always right


def test_workloads_ship_forty_prompts_each():
    for name in _workloads.WORKLOADS:
        items = _workloads.load_workload(name)
        assert len(items) >= 40 and len({i["id"] for i in items}) == len(items)
        assert all(("prompt" in i) != ("messages" in i) for i in items)
    assert _workloads.spread(list(range(10)), 3) == [0, 3, 6]
    with pytest.raises(ValueError, match="unknown workload 'poetry'"):
        _workloads.load_workload("poetry")


def _write_trace(directory, rates):
    (directory / "code.json").write_text(json.dumps({"proposers": {
        "draft-chain-16": {"per_position": rates, "mean_accepted_length": 2.0, "accepted": []}}}))


def test_trace_sampling_follows_per_position_acceptance(tmp_path):
    _write_trace(tmp_path, [0.9, 0.5, 0.2])
    trace = traces.load_trace("code", tmp_path)
    assert trace.name == "code/draft-chain-16" and trace.rate(7) == 0.2  # deeper than measured: the last rate
    rng = random.Random(0)
    draws = [trace.sample_accepted(4, rng) for _ in range(20000)]
    assert max(draws) <= 4
    assert sum(d >= 1 for d in draws) / len(draws) == pytest.approx(0.9, abs=0.01)
    assert sum(d >= 2 for d in draws) / sum(d >= 1 for d in draws) == pytest.approx(0.5, abs=0.015)
    expected = 0.9 + 0.9 * 0.5 + 0.9 * 0.5 * 0.2 + 0.9 * 0.5 * 0.2 * 0.2
    assert trace.expected_accepted(4) == pytest.approx(expected)
    assert sum(draws) / len(draws) == pytest.approx(expected, abs=0.03)


def test_trace_names_that_do_not_exist(tmp_path):
    _write_trace(tmp_path, [0.5])
    with pytest.raises(ValueError, match="no acceptance trace for workload 'chat' \\(traces: code\\)"):
        traces.load_trace("chat", tmp_path)
    with pytest.raises(ValueError, match="has no proposer 'lookahead-raw'; it has draft-chain-16"):
        traces.load_trace("code/lookahead-raw", tmp_path)


@pytest.fixture
def smollm2():
    from gpu_target import loader

    try:
        return loader.resolve_model_path("SmolLM2-135M-Instruct")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def test_a_draft_equal_to_the_target_is_always_right(smollm2, tmp_path, monkeypatch):
    """End to end on the real small model: the reference continuation from the engine, then the
    same model's teacher-forced top-2 from one prefill; the greedy top-1 must be the continuation."""
    from bench.acceptance import draft_top2
    from hetero import LLM

    items = _workloads.spread(_workloads.load_workload("chat"), 2)
    monkeypatch.setattr(_workloads, "DATA_DIR", tmp_path)  # the caches
    factory = lambda: LLM(model="SmolLM2-135M-Instruct", device="cpu", dtype="float32", max_model_len=512)
    refs = _workloads.greedy_references("SmolLM2-135M-Instruct", "chat", items, 12, "float32", factory)
    assert [len(r["output_ids"]) for r in refs] == [12, 12]
    assert _workloads.greedy_references("SmolLM2-135M-Instruct", "chat", items, 12, "float32", None) == refs  # cached
    tops = draft_top2("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", "chat", refs, "float32")
    assert [t["top1"] for t in tops] == [r["output_ids"] for r in refs]
    assert all(a != b for t in tops for a, b in zip(t["top1"], t["top2"]))
    logs = measure_draft(refs, tops)
    assert logs["draft-chain-4"].accepted == [4, 4, 0] * 2  # 11 tokens after the prefill's: 4 + 1, 4 + 1, bonus


def test_draft_plus_lookahead_steps_are_as_deep_as_the_deeper_proposal():
    out = list(range(100, 140))
    refs = [{"id": "a", "prompt_ids": [1, 2, 3], "output_ids": out}]
    log = measure_lookahead(refs, 8, 16, [], [{"top1": out, "top2": [0] * len(out)}])["draft-chain-8+lookahead-hybrid"]
    assert min(log.depth) == 8
    assert all(0.0 <= rate <= 1.0 for rate in log.per_position_acceptance(16))
