"""Async scheduling: the next step is launched before the last one's outputs are built, and
every output and stream chunk is the same as with synchronous steps."""
from __future__ import annotations

import pytest
import torch

from gpu_target.kv_cache import KVCachePool
from gpu_target.loader import load_config
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


def test_speculative_steps_with_shared_prompt_prefixes_are_the_same_with_async_scheduling(tiny_llama_dir):
    """Requests admitted while others decode reuse their prompt blocks (a common system prompt)
    as with synchronous steps: prompt blocks are registered before the next launch, only the
    blocks of generated tokens after it."""
    shared = [(7 * i + 3) % 200 + 10 for i in range(40)]  # two and a half blocks of 16
    requests = [(f"r{i}", {"prompt_token_ids": shared + [300 + i, 301 + i]},
                 SamplingParams(temperature=0.0, max_tokens=10 + 2 * i, ignore_eos=True, output_kind=STREAM))
                for i in range(5)]
    # About one prompt's worth of tokens a step: a request's prefill ends a step before the next one's starts.
    engines = {mode: _engine(tiny_llama_dir, mode, spec=True, max_num_seqs=3, max_num_batched_tokens=48) for mode in (False, True)}
    streams = {mode: _stream(engine, requests) for mode, engine in engines.items()}
    assert streams[True] == streams[False]
    hits = {mode: engine.scheduler.allocator.stats.hits for mode, engine in engines.items()}
    assert hits[True] == hits[False] >= 3 * 32  # the requests admitted after the first two found the two shared blocks
    assert engines[True].spec_stats.num_steps > 0


def test_blocks_filled_by_generated_tokens_are_registered_after_the_next_launch(tiny_llama_dir):
    """The prefix cache's bookkeeping of a speculative step's tokens is off the device's idle
    path: within a step call, the next step is launched before they are registered."""
    engine = _engine(tiny_llama_dir, True, spec=True, max_num_seqs=2)
    calls: list[list[str]] = []
    forward, register = engine.runner.forward, engine.scheduler.register_blocks
    engine.runner.forward = lambda chunks: (calls[-1].append("run"), forward(chunks))[1]
    engine.scheduler.register_blocks = lambda seq: (calls[-1].append("register"), register(seq))[1]
    prompt = list(range(20, 36))  # one whole block: registered with the prefill
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for request_id in ("a", "b"):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        calls.append([])
        outputs.update((out.request_id, out) for out in engine.step())
    decoding = [call for call in calls[2:] if "run" in call]
    assert len(decoding) > 3 and engine.spec_stats.num_steps > 0
    assert all(call.index("run") < call.index("register") for call in decoding if "register" in call)
    # ... and registered they are: a prompt that continues "a" finds its generated blocks too.
    engine.add_request("c", {"prompt_token_ids": prompt + list(outputs["a"].outputs[0].token_ids)}, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    assert outputs["c"].num_cached_tokens >= 3 * 16


def test_preemption_under_kv_pressure_finds_the_same_cached_blocks_with_async_scheduling(tiny_llama_dir):
    """A sequence preempted by a launch that came before its last blocks were registered
    registers them as it is preempted: its re-admission finds as much KV as with synchronous steps."""
    config = load_config(tiny_llama_dir)
    block_bytes = KVCachePool.bytes_per_block(config, 16, torch.float32)
    greedy = lambda i: SamplingParams(temperature=0.0, max_tokens=60 + 8 * i, ignore_eos=True, output_kind=STREAM)
    requests = [(f"r{i}", {"prompt_token_ids": [(11 * i + 5 * j) % 250 + 3 for j in range(20)]}, greedy(i)) for i in range(4)]
    # 16 blocks of 16 (max_model_len 256): four sequences of up to 20 + 84 tokens do not fit
    engines = {mode: _engine(tiny_llama_dir, mode, spec=True, max_num_seqs=4, kv_cache_space=16 * block_bytes / 2**30)
               for mode in (False, True)}
    streams = {mode: _stream(engine, requests) for mode, engine in engines.items()}
    assert streams[True] == streams[False]
    assert engines[True].scheduler.num_preemptions == engines[False].scheduler.num_preemptions > 0
    hits = {mode: engine.scheduler.allocator.stats.hits for mode, engine in engines.items()}
    assert hits[True] == hits[False] > 0
