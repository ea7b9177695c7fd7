"""Async scheduling: the next step is launched before the last one's outputs are built, and
every output and stream chunk is the same as with synchronous steps."""
from __future__ import annotations

import pytest

from hetero.core.config import EngineConfig
from hetero.core.sampling_params import RequestOutputKind, SamplingParams
from hetero.engine import LLMEngine

PROMPTS = ["Hello, my name is", "The capital of France is", "def add(a, b):", "Once upon a time there was",
           "x", "a b c d e f g a b c d e f g a b c"]
STREAM = RequestOutputKind.CUMULATIVE  # a streamed output per step (the server builds deltas from them)


def _engine(model_dir, async_scheduling: bool, spec: bool = False, **kwargs) -> LLMEngine:
    if spec:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", max_model_len=256,
                                    async_scheduling=async_scheduling, **kwargs))
    if spec:
        engine.spec_control.always_speculate = True  # trees every step, whatever the step times say
    return engine


def _chunk(output) -> tuple:
    """Everything a caller sees of one RequestOutput."""
    completions = [(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
                   for c in output.outputs]
    return output.request_id, output.finished, completions, output.prompt_logprobs


def _stream(engine: LLMEngine, requests, abort: dict[int, str] | None = None) -> list[list[tuple]]:
    """Add the requests, step until done; each step's outputs. `abort`: {step number: request id}
    to abort right after that step returns (under async scheduling, while the next one is in flight)."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        steps.append([_chunk(o) for o in engine.step()])
        if abort and len(steps) in abort:
            engine.abort_request(abort[len(steps)])
    return steps


def _both(model_dir, requests, abort=None, spec=False, **kwargs) -> tuple[list, list, LLMEngine]:
    sync = _stream(_engine(model_dir, False, spec, **kwargs), requests, abort)
    engine = _engine(model_dir, True, spec, **kwargs)
    return sync, _stream(engine, requests, abort), engine


def _requests(params_for) -> list:
    return [(f"r{i}", prompt, params_for(i)) for i, prompt in enumerate(PROMPTS)]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_greedy_streams_are_the_same_with_async_scheduling(tiny_llama_dir, spec):
    greedy = lambda i: SamplingParams(temperature=0.0, max_tokens=12 + 3 * i, ignore_eos=True, output_kind=STREAM)
    sync, async_, engine = _both(tiny_llama_dir, _requests(greedy), spec=spec, max_num_seqs=3)
    assert async_ == sync
    assert sum(len(step) for step in sync) > len(PROMPTS)  # streamed, not only final outputs
    if spec:
        assert engine.spec_stats.num_steps > 0


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_sampling_penalties_and_stops_are_the_same_with_async_scheduling(tiny_llama_dir, spec):
    def params(i):
        return SamplingParams(temperature=0.9, top_p=0.9, seed=i if i % 2 else None, max_tokens=16, min_tokens=2,
                              presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                              stop=["e"] if i == 1 else None, output_kind=STREAM)

    sync, async_, _ = _both(tiny_llama_dir, _requests(params), spec=spec, max_num_seqs=4)
    assert async_ == sync
    assert any(c[4] == "e" for step in sync for out in step for c in out[2])  # a stop string ended a request


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_logprobs_and_prompt_logprobs_are_the_same_with_async_scheduling(tiny_llama_dir, spec):
    params = lambda i: SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=10, logprobs=3,
                                      prompt_logprobs=2 if i < 2 else None, n=2 if i == 2 else 1, output_kind=STREAM)
    sync, async_, _ = _both(tiny_llama_dir, _requests(params), spec=spec, max_num_seqs=4)
    assert async_ == sync
    assert any(c[6] for step in sync for out in step for c in out[2])  # logprobs were streamed


def test_mixed_steps_with_chunked_prefills_are_the_same_with_async_scheduling(tiny_llama_dir):
    greedy = lambda i: SamplingParams(temperature=0.0, max_tokens=8 + i, ignore_eos=True, output_kind=STREAM)
    sync, async_, _ = _both(tiny_llama_dir, _requests(greedy), spec=True, max_num_seqs=3, max_num_batched_tokens=8)
    assert async_ == sync


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_an_abort_while_a_step_is_in_flight_drops_only_that_request(tiny_llama_dir, spec):
    """Every request has its slot: the aborted one's part of the step in flight is dropped, the rest is as if synchronous."""
    def params(i):
        return SamplingParams(temperature=0.8, seed=i if i % 2 else None, max_tokens=20, ignore_eos=True, output_kind=STREAM)

    abort = {2: "r1", 4: "r4"}
    sync, async_, engine = _both(tiny_llama_dir, _requests(params), abort=abort, spec=spec, max_num_seqs=len(PROMPTS))
    assert async_ == sync
    after = [out[0] for step in sync[2:] for out in step]
    assert "r1" not in after and "r0" in after  # the aborted request streams nothing more, the others go on
    assert engine.step() == []  # a step left in flight for aborted requests only drains without output
    allocator = engine.scheduler.allocator
    assert not engine.scheduler.running and allocator.num_free == allocator.num_blocks  # every KV block back


def test_a_slot_freed_by_an_abort_is_refilled_a_step_later_with_the_same_outputs(tiny_llama_dir):
    """A waiting request takes an aborted one's slot at the next step scheduled after the abort:
    under async scheduling that is one step later, so its chunks come a step later, unchanged."""
    greedy = lambda i: SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=STREAM)
    sync, async_, _ = _both(tiny_llama_dir, _requests(greedy), abort={2: "r1"}, max_num_seqs=3)

    def per_request(steps):
        chunks: dict[str, list] = {}
        for step in steps:
            for chunk in step:
                chunks.setdefault(chunk[0], []).append(chunk)
        return chunks

    assert per_request(async_) == per_request(sync)
    assert async_ != sync  # the refill did come a step later


def test_the_next_step_runs_before_the_outputs_are_built(tiny_llama_dir):
    """The point of async scheduling: step t + 1's forward is queued before step t's outputs."""
    events = {}
    for mode in (False, True):
        engine = _engine(tiny_llama_dir, mode, max_num_seqs=2)
        log = events[mode] = []
        forward, request_outputs = engine.runner.forward, engine.outputs.request_outputs
        engine.runner.forward = lambda chunks: (log.append("run"), forward(chunks))[1]
        engine.outputs.request_outputs = lambda touched: (log.append("output"), request_outputs(touched))[1]
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        _stream(engine, [("a", PROMPTS[0], params), ("b", PROMPTS[1], params)])
    assert events[False] == ["run", "output"] * 3
    assert events[True] == ["run", "run", "output", "run", "output", "output"]


def test_async_scheduling_is_a_checked_engine_argument(tiny_llama_dir):
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model=str(tiny_llama_dir), async_scheduling="yes")
    assert EngineConfig(model=str(tiny_llama_dir)).async_scheduling is True
