"""Multi-step decoding (`num_scheduler_steps`): several decode steps per host round trip,
with outputs identical to one step at a time."""
from __future__ import annotations

import pytest
import torch

from gpu_target.kv_cache import KVCachePool
from gpu_target.loader import load_config
from hetero import LLM, SamplingParams
from tiny_models import PROMPTS as ENGINE_PROMPTS

PROMPTS = ENGINE_PROMPTS[:6]
GREEDY = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)


def _llm(model_dir, steps, **kwargs) -> LLM:
    return LLM(model=str(model_dir), max_model_len=256, dtype="float32", num_scheduler_steps=steps, **kwargs)


def _count_runs_ahead(llm: LLM) -> list[int]:
    """Record the number of steps of every multi-step decode the engine runs."""
    runner = llm.llm_engine.runner
    calls: list[int] = []
    decode_steps = runner.decode_steps

    def spy(chunks, num_steps, pick):
        calls.append(num_steps)
        return decode_steps(chunks, num_steps, pick)

    runner.decode_steps = spy
    return calls


@pytest.fixture(scope="module")
def single(tiny_llama_dir):
    return _llm(tiny_llama_dir, 1)


@pytest.fixture(scope="module")
def multi(tiny_llama_dir):
    return _llm(tiny_llama_dir, 4)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_batch_matches_single_steps(single, multi):
    runs = _count_runs_ahead(multi)
    expected = single.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = multi.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    # The prefill samples the first token; 22 follow in windows of 4, the last cut to what
    # max_tokens leaves.
    assert runs == [4, 4, 4, 4, 4, 2]
    allocator = multi.llm_engine.scheduler.allocator
    assert allocator.num_free == allocator.num_blocks


def test_seeded_sampling_matches_single_steps(single, multi):
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, seed=5, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    ]
    runs = _count_runs_ahead(multi)
    assert _tokens(multi.generate(PROMPTS[:3], params, use_tqdm=False)) == _tokens(
        single.generate(PROMPTS[:3], params, use_tqdm=False)
    )
    assert runs


def test_stops_inside_a_window_discard_the_steps_after_them(single, multi):
    reference = single.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_token = reference[5]  # the 6th token: in the middle of the second 4-step window
    params = SamplingParams(temperature=0, max_tokens=23, stop_token_ids=[stop_token])
    expected = single.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    got = multi.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids == reference[: reference.index(stop_token) + 1]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop_token)

    text = multi.get_tokenizer().decode(reference)
    stop = next(text[i : i + 3] for i in range(3, len(text)) if text[i : i + 3].isascii() and text[i : i + 3].isalnum())
    params = SamplingParams(temperature=0, max_tokens=23, stop=[stop])
    expected = single.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    got = multi.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.stop_reason) == (expected.text, expected.token_ids, stop)
    assert len(got.token_ids) < len(reference)


def test_rows_whose_tokens_need_the_host_decode_one_step_at_a_time(single, multi):
    runs = _count_runs_ahead(multi)
    params = [
        SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True),
    ]
    for p in params:
        got = multi.generate(PROMPTS[1], p, use_tqdm=False)[0].outputs[0]
        expected = single.generate(PROMPTS[1], p, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == expected.token_ids
        assert got.logprobs == expected.logprobs
    assert runs == []


def test_min_tokens_runs_ahead_only_once_it_is_met(single, multi):
    runs = _count_runs_ahead(multi)
    params = SamplingParams(temperature=0, max_tokens=14, min_tokens=6)
    got = multi.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == single.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0].token_ids
    assert runs and sum(runs) <= 14 - 6


def test_prefix_cache_keeps_only_blocks_of_known_tokens(tiny_llama_dir):
    """A stop mid-window leaves KV computed past the last token; the follow-up shares every full block of known tokens."""
    multi = _llm(tiny_llama_dir, 8, enable_prefix_caching=True)
    single = _llm(tiny_llama_dir, 1)
    prompt = "Once upon a time there was a small model that generated text. " * 2
    reference = single.generate(prompt, GREEDY, use_tqdm=False)[0]
    stop_token = reference.outputs[0].token_ids[9]
    first = multi.generate(prompt, SamplingParams(temperature=0, max_tokens=23, stop_token_ids=[stop_token]), use_tqdm=False)[0]
    follow_up = {"prompt_token_ids": first.prompt_token_ids + first.outputs[0].token_ids}
    got = multi.generate(follow_up, GREEDY, use_tqdm=False)[0]
    assert got.num_cached_tokens == 16 * ((len(follow_up["prompt_token_ids"]) - 1) // 16)
    assert got.outputs[0].token_ids == single.generate(follow_up, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_kv_pressure_falls_back_to_single_steps(tiny_llama_dir, single):
    config = load_config(tiny_llama_dir)
    block_bytes = KVCachePool.bytes_per_block(config, 16, torch.float32)
    tight = LLM(
        model=str(tiny_llama_dir), max_model_len=96, dtype="float32", num_scheduler_steps=8,
        kv_cache_space=7 * block_bytes / 2**30,
    )
    outs = tight.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(outs) == _tokens(single.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert tight.llm_engine.scheduler.allocator.num_free == 7


@pytest.mark.parametrize("steps", [0, 65, 2.5])
def test_bad_num_scheduler_steps_names_the_field(tiny_llama_dir, steps):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(model=str(tiny_llama_dir), num_scheduler_steps=steps)


def test_a_full_batch_runs_ahead_while_requests_wait(tiny_llama_dir, single):
    """Waiting requests that have no room in the batch do not stop the batch from running ahead."""
    full = _llm(tiny_llama_dir, 4, max_num_seqs=2)
    runs = _count_runs_ahead(full)
    outs = full.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    assert _tokens(outs) == _tokens(single.generate(PROMPTS[:4], GREEDY, use_tqdm=False))
    assert runs == [4, 4, 4, 4, 4, 2] * 2  # the first two run ahead while the other two wait
