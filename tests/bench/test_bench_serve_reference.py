"""The reference cost run: the in-process Poisson driver's timing on a fake engine and clock, the trace
replay of lookahead trees, and a CPU smoke run of `bench.serve_reference` on a tiny random pair
(two rates, a few requests) that the cost report then reads."""
from __future__ import annotations

import json
import random

import pytest

from bench import cost, serve_reference
from bench._poisson_driver import drive
from bench.e2e_speculation import TraceReplay
from bench.serve import RESULT_SCHEMA
from bench.traces import Trace
from hetero.core.protocols import TokenTree


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class _Output:
    def __init__(self, request_id, tokens, finished):
        self.request_id, self.finished = request_id, finished
        self.outputs = [type("Completion", (), {"token_ids": tokens})()]


class _FakeEngine:
    """One slot: each step takes 1 s and gives the running request one token."""

    def __init__(self, clock):
        self.clock, self.queue, self.tokens = clock, [], {}

    def add_request(self, request_id, prompt, params):
        self.queue.append((request_id, params.max_tokens))

    def has_unfinished_requests(self):
        return bool(self.queue)

    def step(self):
        self.clock.now += 1.0
        request_id, max_tokens = self.queue[0]
        tokens = self.tokens.setdefault(request_id, [])
        tokens.append(7)
        finished = len(tokens) == max_tokens
        if finished:
            self.queue.pop(0)
        return [_Output(request_id, list(tokens), finished)]


def test_the_driver_times_each_request_from_its_arrival_queueing_included():
    clock = _Clock()
    prompts = [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}, {"prompt_token_ids": [4]}]
    records, duration = drive(_FakeEngine(clock), prompts, 3, [0.0, 0.5, 10.0], clock=clock, sleep=clock.sleep)
    first, second, third = records
    assert (first.ttft, first.itl, first.e2e, first.output_tokens) == (1.0, [1.0, 1.0], 3.0, 3)
    # arrives at 0.5, added before the step ending at 1.0 but waits for the single slot until 3.0
    assert (second.ttft, second.e2e, second.start) == (3.5, 5.5, 0.5)
    assert second.tpot == pytest.approx(1.0)
    # the engine idles from 6.0 until the third request arrives at 10.0
    assert (third.ttft, third.e2e) == (1.0, 3.0) and duration == 13.0
    assert all(r.success and r.usage_reported for r in records) and second.prompt_tokens == 1
    with pytest.raises(ValueError, match="3 prompts but 2 arrival offsets"):
        drive(_FakeEngine(clock), prompts, 3, [0.0, 1.0], clock=clock, sleep=clock.sleep)


class _Trees:
    def __init__(self, tree):
        self.tree = tree

    def propose(self, batch):
        return [self.tree for _ in batch]


def test_lookahead_trees_are_cut_by_recorded_steps_on_every_branch():
    # two branches: 5 6 7 (first) and 8 9 10 11 (deeper); the cut must bound acceptance on both
    tree = TokenTree([5, 8, 6, 9, 7, 10, 11], [-1, -1, 0, 1, 2, 3, 5])
    trace = Trace("w/lookahead", (1.0,), 2.0, accepted=(1,))
    cut = TraceReplay(_Trees(tree), trace, vocab_size=100, recorded_steps=True).propose([None])[0]
    assert cut.token_list == [5, 8, 7] and cut.parent_list == [-1, -1, 0]  # depth 1 kept, then one wrong node
    assert TraceReplay(_Trees(tree), Trace("w", (1.0,), 2.0, accepted=(9,)), 100,
                       recorded_steps=True).propose([None])[0] is tree  # capped at the tree's depth: kept whole
    draws = [Trace("w", (0.0,), 1.0, accepted=(0, 0, 3)).sample_recorded(2, random.Random(i)) for i in range(300)]
    assert set(draws) == {0, 2} and 0.55 < draws.count(0) / len(draws) < 0.8
    with pytest.raises(ValueError, match="has no recorded steps"):
        Trace("w", (0.5,), 1.5).sample_recorded(2, random.Random(0))


def test_bad_configurations_and_rates_are_refused(capsys):
    with pytest.raises(SystemExit):
        serve_reference.parse_args(["--configs", "plain,eagle"])
    assert "unknown configuration 'eagle'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_reference.parse_args(["--configs", "plain+int4"])
    with pytest.raises(SystemExit):
        serve_reference.parse_args(["--rates", "4,0"])
    assert "rates must be positive" in capsys.readouterr().err
    assert serve_reference.parse_args(["--rates", "2,inf"]).rates == [2.0, float("inf")]


def test_smoke_run_on_a_tiny_pair_then_the_report(tmp_path, capsys):
    out = tmp_path / "run"
    code = serve_reference.main([
        "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--kv-cache-space", "0.25",
        "--configs", "plain,lookahead,gpu-draft", "--workloads", "rewrite,chat", "--rates", "50,inf",
        "--num-prompts", "4", "--warmup", "1", "--warmup-output-len", "2", "--input-len", "12", "--output-len", "6", "--max-num-seqs", "4",
        "--hf-generate", "--hf-batches", "2", "--out", str(out)])
    assert code == 0
    (manifest,) = out.glob("run-*.json")
    run = json.loads(manifest.read_text())
    assert not run["errors"] and not run["skipped"] and set(run["startup_s"]) == {"plain", "lookahead", "gpu-draft"}
    expected = {f"plain-any-rate{r}.json" for r in ("50", "inf")} | {"hf-generate-any-rateinf-conc2.json"} | {
        f"{c}-{w}-rate{r}.json" for c in ("lookahead", "gpu-draft") for w in ("rewrite", "chat") for r in ("50", "inf")}
    assert set(run["files"]) == expected
    for name in expected:
        result = json.loads((out / name).read_text())
        assert result["schema"] == RESULT_SCHEMA and result["summary"]["completed"] == len(result["requests"])
        assert all(r["success"] and r["output_tokens"] == 6 and r["ttft"] > 0 and r["tpot"] > 0 for r in result["requests"])
    draft = json.loads((out / "gpu-draft-rewrite-rateinf.json").read_text())
    assert draft["trace"] == "rewrite" and draft["workload"] == "rewrite" and len(draft["requests"]) == 4
    assert 1 < draft["spec_decode"]["trace_acceptance_length"] <= 5  # k = 4 drafted tokens and the bonus
    lookahead = json.loads((out / "lookahead-chat-rate50.json").read_text())
    assert lookahead["trace"] == "chat/lookahead-hybrid"
    hf = json.loads((out / "hf-generate-any-rateinf-conc2.json").read_text())
    assert hf["config"]["max_concurrency"] == 2 and len(hf["requests"]) == 2

    report_dir = tmp_path / "report"
    assert cost.main([str(out), "--gpu-price-per-hour", "3", "--cpu-price-per-hour", "0.5", "--sla",
                      "tpot:100000,ttft:100000", "--out-dir", str(report_dir)]) == 0
    report = (report_dir / "cost_report.md").read_text()
    assert "| config | chat | rewrite |" in report and "| gpu-draft | $" in report  # a loose SLA every point meets
    assert "python -m bench.serve_reference --shape tiny" in report


def test_a_tensor_parallel_run_builds_every_engine_over_its_ranks(tmp_path, monkeypatch):
    """--tensor-parallel-size reaches each configuration's engine, and the draft's agreement is
    grafted on every rank: its trees are accepted at tp=2 as the trace allows."""
    sizes = []
    real_engine = serve_reference.LLMEngine

    def recording_engine(config, proposer=None):
        sizes.append(config.tensor_parallel_size)
        return real_engine(config, proposer)

    monkeypatch.setattr(serve_reference, "LLMEngine", recording_engine)
    out = tmp_path / "run"
    assert serve_reference.main([
        "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--kv-cache-space", "0.25", "--tensor-parallel-size", "2",
        "--configs", "plain,gpu-draft", "--workloads", "rewrite", "--rates", "inf", "--num-prompts", "4", "--warmup", "1",
        "--warmup-output-len", "2", "--input-len", "12", "--output-len", "6", "--max-num-seqs", "4", "--out", str(out)]) == 0
    assert sizes == [2, 2]
    draft = json.loads((out / "gpu-draft-rewrite-rateinf.json").read_text())
    assert draft["summary"]["completed"] == 4 and draft["spec_decode"]["mean_acceptance_length"] > 1


def test_the_replay_passes_the_wrapped_proposers_node_budget_on():
    class _Budgeted(_Trees):
        target_parallelism = 512

    trace = Trace("w", (1.0,), 2.0)
    assert TraceReplay(_Budgeted(None), trace, 100).target_parallelism == 512
    assert getattr(TraceReplay(_Trees(None), trace, 100), "target_parallelism", 64) == 64  # the engine's default


def test_what_the_trace_promises_at_the_runs_depth():
    args = serve_reference.parse_args(["--k", "2", "--lookahead-depth", "8"])
    draft = TraceReplay(_Trees(None), Trace("w", (0.5,), 3.0), 100)
    assert serve_reference.trace_acceptance_length(draft, args) == pytest.approx(1 + 0.5 + 0.25)
    lookahead = TraceReplay(_Trees(None), Trace("w", (0.9,), 3.0, accepted=(0, 3, 9)), 100, recorded_steps=True)
    assert serve_reference.trace_acceptance_length(lookahead, args) == pytest.approx(1 + (0 + 3 + 8) / 3)
