"""bench.e2e_speculation: the trace replay (trees cut to the accepted length a trace draws) and the rounds' speedups."""
from __future__ import annotations

from bench.e2e_speculation import TraceReplay, median_speedups
from hetero.core.protocols import Proposer, TokenTree


class _Fixed:
    """A trace whose every draw is `accepted` (capped at the depth)."""

    def __init__(self, accepted: int):
        self.accepted = accepted

    def sample_accepted(self, depth, rng):
        return min(self.accepted, depth)


class _Drafts(Proposer):
    def __init__(self, tree):
        self.tree = tree

    def propose(self, batch):
        return [self.tree for _ in batch]


def test_a_chain_is_kept_up_to_the_drawn_length_and_then_made_wrong():
    chain = TokenTree.chain([10, 11, 12, 13])
    cut = TraceReplay(_Drafts(chain), _Fixed(2), vocab_size=100).propose([None])[0]
    assert cut.token_list == [10, 11, 13] and cut.parent_list == [-1, 0, 1]  # 12 replaced by a token the target rejects
    assert TraceReplay(_Drafts(chain), _Fixed(4), vocab_size=100).propose([None])[0].token_list == [10, 11, 12, 13]
    assert TraceReplay(_Drafts(chain), _Fixed(0), vocab_size=14).propose([None])[0].token_list == [11]
    assert TraceReplay(_Drafts(TokenTree.chain([99])), _Fixed(0), vocab_size=100).propose([None])[0].token_list == [0]


def test_siblings_beside_the_chain_go_with_the_cut():
    tree = TokenTree([10, 20, 11, 21, 12], [-1, -1, 0, 0, 2])  # chain 10 11 12 with siblings 20 and 21
    cut = TraceReplay(_Drafts(tree), _Fixed(1), vocab_size=100).propose([None])[0]
    assert cut.token_list == [10, 20, 12] and cut.parent_list == [-1, -1, 0]


def test_each_round_is_compared_with_plains_same_round_and_summarised_by_its_median():
    rows = [dict(config="plain", batch=8, round=0, tokens_per_s=100.0), dict(config="plain", batch=8, round=1, tokens_per_s=200.0),
            dict(config="plain", batch=8, round=2, tokens_per_s=100.0),
            dict(config="cpu-draft", batch=8, round=0, tokens_per_s=150.0), dict(config="cpu-draft", batch=8, round=1, tokens_per_s=500.0),
            dict(config="cpu-draft", batch=8, round=2, tokens_per_s=120.0), dict(config="cpu-draft", batch=1, round=0, tokens_per_s=9.0)]
    medians = median_speedups(rows)
    assert [r.get("speedup_vs_plain") for r in rows] == [1.0, 1.0, 1.0, 1.5, 2.5, 1.2, None]  # batch 1 has no plain row
    assert medians == [dict(config="plain", batch=8, rounds=3, median_speedup=1.0, lowest=1.0, highest=1.0),
                       dict(config="cpu-draft", batch=8, rounds=3, median_speedup=1.5, lowest=1.2, highest=2.5)]


def test_the_median_of_an_even_number_of_rounds_is_rounded_as_the_ratios_are():
    rows = [dict(config="plain", batch=8, round=r, tokens_per_s=100.0) for r in range(4)]
    rows += [dict(config="cpu-draft", batch=8, round=r, tokens_per_s=t) for r, t in enumerate([99.0, 134.0, 137.0, 102.0])]
    assert median_speedups(rows)[1]["median_speedup"] == 1.18  # 1.02 and 1.34: not 1.1800000000000002


def test_results_name_the_cores_the_draft_worker_ran_on(tmp_path, monkeypatch):
    """The worker is found inside the benchmark's replay wrapper, and its cores reach the run's
    machine info; a run without a CPU draft worker names none."""
    import argparse
    import json

    import torch

    from bench import e2e_speculation
    from cpu_draft.proposer import WorkerDraftProposer
    from hetero.proposers import draft_worker

    worker = object.__new__(WorkerDraftProposer)  # no process: only its place in the wrappers matters here
    assert draft_worker(TraceReplay(worker, _Fixed(1), vocab_size=100)) is worker
    assert draft_worker(_Drafts(TokenTree([1], [-1]))) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "test GPU")
    args = argparse.Namespace(out=str(tmp_path / "with"), rounds=1)
    e2e_speculation.write(args, [dict(config="cpu-draft", batch=1, round=0, tokens_per_s=1.0)], [], list(range(11, 27)))
    (result,) = (tmp_path / "with").glob("e2e_speculation-*.json")
    assert json.loads(result.read_text())["machine"]["draft_cpus"] == ",".join(map(str, range(11, 27)))
    args.out = str(tmp_path / "without")
    e2e_speculation.write(args, [dict(config="plain", batch=1, round=0, tokens_per_s=1.0)], [])
    (result,) = (tmp_path / "without").glob("e2e_speculation-*.json")
    assert "draft_cpus" not in json.loads(result.read_text())["machine"]
