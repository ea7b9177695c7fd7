"""The engine against HF transformers: greedy equivalence, preemption, seeds, outputs, errors."""
from __future__ import annotations

import logging

import pytest
import torch
import transformers

from gpu_target.kv_cache import KVCachePool
from gpu_target.loader import load_config
from hetero import LLM, SamplingParams
from hetero.server.startup import kv_cache_source
from tiny_models import PROMPTS


def hf_greedy(model_dir, prompts, max_new_tokens):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32")


@pytest.fixture(scope="module")
def llama_reference(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, PROMPTS, 24)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_greedy_matches_transformers_at_batch_1(llama, llama_reference):
    for prompt, expected in zip(PROMPTS[:3], llama_reference):
        (out,) = llama.generate(prompt, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == expected


def test_greedy_matches_transformers_at_batch_8_with_mixed_lengths(llama, llama_reference):
    outs = llama.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == llama_reference
    assert [o.prompt for o in outs] == PROMPTS


def test_qwen2_greedy_matches_transformers(tiny_qwen2_dir):
    llm = LLM(model=str(tiny_qwen2_dir), max_model_len=256, dtype="float32")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_qwen2_dir, PROMPTS, 24)


def test_kv_pressure_preempts_and_loses_nothing(tiny_llama_dir, llama_reference):
    config = load_config(tiny_llama_dir)
    block_bytes = KVCachePool.bytes_per_block(config, 16, torch.float32)
    llm = LLM(model=str(tiny_llama_dir), max_model_len=96, dtype="float32", kv_cache_space=7 * block_bytes / 2**30)
    assert llm.llm_engine.kv_pool.num_blocks == 7
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == llama_reference
    assert llm.llm_engine.scheduler.allocator.num_free == 7


def test_num_gpu_blocks_override_sizes_the_kv_cache_exactly(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=96, dtype="float32", kv_cache_space=1.0, num_gpu_blocks_override=9)
    assert llm.llm_engine.kv_pool.num_blocks == 9
    assert kv_cache_source(llm.llm_engine) == "--num-gpu-blocks-override 9"
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        LLM(model=str(tiny_llama_dir), max_model_len=96, dtype="float32", num_gpu_blocks_override=2)



def test_hf_overrides_set_the_model_config_and_max_model_len_follows(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", hf_overrides={"max_position_embeddings": 128})
    assert (llm.llm_engine.model_config.max_position_embeddings, llm.llm_engine.max_model_len) == (128, 128)
    too_long = r"max_model_len \(256\) is larger than the model's max_position_embeddings \(128\)"
    with pytest.raises(ValueError, match=too_long):
        LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, hf_overrides={"max_position_embeddings": 128})


def test_an_hf_overrides_rope_theta_changes_the_logits(tiny_llama_dir):
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(**kwargs) -> list[float]:
        (out,) = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, **kwargs).generate(
            PROMPTS[0], params, use_tqdm=False)
        return [logprob.logprob for position in out.prompt_logprobs[1:] for logprob in position.values()]

    plain = prompt_logprobs()
    assert prompt_logprobs(hf_overrides={"rope_theta": 10000.0}) == plain  # the checkpoint's own value
    faster = prompt_logprobs(hf_overrides={"rope_theta": 1e6})
    assert max(abs(a - b) for a, b in zip(plain, faster)) > 1e-3

def test_kv_cache_memory_bytes_sizes_the_kv_cache_in_blocks_on_any_device(tiny_llama_dir):
    block_bytes = KVCachePool.bytes_per_block(load_config(tiny_llama_dir), 16, torch.float32)
    common = dict(model=str(tiny_llama_dir), max_model_len=96, dtype="float32")  # 96 tokens: 6 blocks a sequence
    llm = LLM(**common, kv_cache_space=1.0, kv_cache_memory_bytes=11 * block_bytes + block_bytes // 2)
    assert llm.llm_engine.kv_pool.num_blocks == llm.llm_engine.scheduler.allocator.num_blocks == 11
    assert kv_cache_source(llm.llm_engine) == f"--kv-cache-memory-bytes {11 * block_bytes + block_bytes // 2}"
    # Not capped at max_num_seqs sequences' worth (1 x 6 + 1 blocks), as kv_cache_space is on the CPU.
    assert LLM(**common, max_num_seqs=1, kv_cache_memory_bytes=20 * block_bytes).llm_engine.kv_pool.num_blocks == 20
    overridden = LLM(**common, kv_cache_memory_bytes=20 * block_bytes, num_gpu_blocks_override=9)  # vLLM's order
    assert overridden.llm_engine.kv_pool.num_blocks == 9
    for size, holds in ((5 * block_bytes, 80), (block_bytes - 1, 0)):  # less than one sequence, less than one block
        with pytest.raises(ValueError, match=rf"holds {holds} tokens, fewer than max_model_len \(96\); raise "
                                             rf"kv_cache_memory_bytes \({block_bytes} bytes a block\)"):
            LLM(**common, kv_cache_memory_bytes=size)


def test_chunked_prefill_matches(tiny_llama_dir, llama_reference):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", max_num_batched_tokens=8, max_num_seqs=8)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == llama_reference


def test_prefix_caching_reuses_blocks_and_matches(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", enable_prefix_caching=True)
    shared = "Once upon a time there was a small model that generated text. " * 3
    prompts = [shared + "Hello", shared + "The capital"]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    second = llm.generate(prompts[1:], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 16
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == hf_greedy(tiny_llama_dir, prompts, 24)


def test_seeded_sampling_is_reproducible_and_batch_independent(llama):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llama.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llama.generate(PROMPTS[:4], [unseeded, params, unseeded, unseeded], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=16, ignore_eos=True)
    assert llama.generate(PROMPTS[1], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_and_best_of(llama):
    out = llama.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    best = llama.generate(
        PROMPTS[0], SamplingParams(n=2, best_of=4, temperature=1.0, seed=7, max_tokens=8, logprobs=0, ignore_eos=True), use_tqdm=False
    )[0]
    scores = [o.cumulative_logprob for o in best.outputs]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)


def test_max_tokens_and_length_finish(llama):
    out = llama.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"
    assert out.finished and out.metrics.first_token_time >= out.metrics.arrival_time


def test_stop_token_ids_and_stop_strings(llama, llama_reference):
    expected = llama_reference[0]
    stop_token = expected[5]
    out = llama.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[: expected.index(stop_token) + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_token)

    tokenizer = llama.get_tokenizer()
    full_text = tokenizer.decode(expected)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 2]
    if not stop.strip() or "\ufffd" in stop:
        pytest.skip("the random model's text has no clean stop string here")
    out = llama.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == full_text[: full_text.index(stop)]
    kept = llama.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0]
    assert kept.outputs[0].text == full_text[: full_text.index(stop) + len(stop)]


def test_min_tokens_suppresses_eos(llama):
    eos = llama.get_tokenizer().eos_token_id
    out = llama.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, min_tokens=12, stop_token_ids=[eos]), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12
    assert eos not in out.outputs[0].token_ids


def test_logprobs_and_prompt_logprobs_match_transformers(llama, tiny_llama_dir):
    out = llama.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    n_prompt = len(out.prompt_token_ids)
    for i, token in enumerate(out.outputs[0].token_ids):
        entry = out.outputs[0].logprobs[i]
        assert entry[token].rank == 1 and len(entry) == 3
        assert entry[token].logprob == pytest.approx(logp[n_prompt - 1 + i, token].item(), abs=1e-4)
    assert out.prompt_logprobs[0] is None
    for p in range(1, n_prompt):
        token = out.prompt_token_ids[p]
        assert out.prompt_logprobs[p][token].logprob == pytest.approx(logp[p - 1, token].item(), abs=1e-4)


def test_prompt_logprobs_of_a_one_token_prompt_are_its_first_position_alone(llama):
    """As vLLM: [None] (nothing before the first token scores it), None where not asked for."""
    asked = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    out = llama.generate({"prompt_token_ids": [5]}, asked, use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
    assert llama.generate({"prompt_token_ids": [5]}, GREEDY, use_tqdm=False)[0].prompt_logprobs is None


def test_token_id_prompts_and_chat(llama):
    tokenizer = llama.get_tokenizer()
    ids = tokenizer(PROMPTS[0]).input_ids
    by_ids = llama.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    by_text = llama.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    chat = llama.chat([{"role": "user", "content": "Hi!"}], GREEDY, use_tqdm=False)[0]
    assert chat.prompt.startswith("<|im_start|>user\nHi!<|im_end|>") and chat.prompt.endswith("assistant\n")
    assert chat.prompt_token_ids == tokenizer.encode(chat.prompt, add_special_tokens=False)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "empty"),
        ({"prompt_token_ids": [10**6]}, "vocabulary"),
        ("word " * 300, "max_model_len"),
        (42, "prompt"),
    ],
)
def test_bad_prompts_are_clear_errors_and_lose_nothing(llama, prompt, message):
    with pytest.raises(ValueError, match=message):
        llama.generate(["Hello", prompt], GREEDY, use_tqdm=False)
    assert not llama.llm_engine.has_unfinished_requests()
    assert llama.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tensor_parallel_size": 3}, "tensor_parallel_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"dtype": "int3"}, "dtype"),
        ({"max_model_len": 100000}, "max_model_len"),
        ({"block_size": 7}, "block_size"),
        ({"max_logprobs": -2}, "max_logprobs"),
        ({"hf_overrides": "max_position_embeddings=128"}, "hf_overrides"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"kv_cache_memory_bytes": 2e9}, "kv_cache_memory_bytes"),
        ({"hf_overrides": {"max_position_embeddings": "long"}}, "hf_overrides"),
        ({"override_generation_config": "temperature=0.5"}, "override_generation_config must be a dict"),
        ({"override_generation_config": {"max_tokens": 5}}, r"override_generation_config\['max_tokens'\] is not"),
        ({"override_generation_config": {"temperature": "hot"}}, r"override_generation_config\['temperature'\]"),
        ({"override_generation_config": {"top_k": 2.5}}, r"override_generation_config\['top_k'\]"),
        ({"override_generation_config": {"max_new_tokens": None}}, r"override_generation_config\['max_new_tokens'\]"),
    ],
)
def test_bad_llm_arguments_name_the_field(tiny_llama_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(model=str(tiny_llama_dir), **kwargs)


def test_logprobs_beyond_max_logprobs_are_refused_as_vllm_does(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32")  # vLLM's default cap: 20
    for params in (SamplingParams(max_tokens=2, logprobs=21), SamplingParams(max_tokens=2, prompt_logprobs=-1)):
        with pytest.raises(ValueError, match="max_logprobs=20"):
            llm.generate("Hello", params, use_tqdm=False)
    assert len(llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)[0].outputs[0].logprobs[0]) >= 20
    uncapped = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_logprobs=-1)
    assert len(uncapped.generate("Hello", SamplingParams(max_tokens=2, logprobs=30), use_tqdm=False)[0].outputs[0].logprobs[0]) >= 30


def test_vllm_arguments_that_change_nothing_here_are_accepted():
    from hetero.core.config import EngineConfig

    vllm_script = dict(enable_chunked_prefill=True, disable_log_stats=True, kv_cache_dtype="auto", swap_space=4,
                       tokenizer_mode="auto", revision=None, task="generate", max_seq_len_to_capture=8192,
                       compilation_config={"level": 3}, distributed_executor_backend="mp", enable_lora=False, cpu_offload_gb=0,
                       disable_cascade_attn=True, max_num_partial_prefills=1, max_long_partial_prefills=1,
                       long_prefill_token_threshold=0, disable_sliding_window=True, enable_prompt_embeds=False, model_impl="auto",
                       config_format="hf", max_parallel_loading_workers=2, num_lookahead_slots=4, worker_cls="auto",
                       enable_expert_parallel=False, guided_decoding_backend="xgrammar")
    assert EngineConfig.from_kwargs("m", max_num_seqs=4, **vllm_script) == EngineConfig(model="m", max_num_seqs=4)
    for name, value in [("kv_cache_dtype", "fp8"), ("swap_space", -1), ("enable_chunked_prefill", "yes"), ("task", "embed"),
                        ("distributed_executor_backend", "ray"), ("cpu_offload_gb", 4), ("disable_cascade_attn", "yes"),
                        ("max_num_partial_prefills", 2), ("max_long_partial_prefills", 2), ("long_prefill_token_threshold", 512),
                        ("disable_sliding_window", None), ("enable_prompt_embeds", True), ("model_impl", "transformers"),
                        ("config_format", "mistral"), ("max_parallel_loading_workers", 0), ("num_lookahead_slots", -1),
                        ("worker_cls", "my.Worker"), ("enable_expert_parallel", True), ("guided_decoding_backend", "lm-format-enforcer")]:
        with pytest.raises(ValueError, match=f"{name}={value!r} is not supported"):
            EngineConfig.from_kwargs("m", **{name: value})


def test_unknown_llm_argument_and_missing_model(tiny_llama_dir, tmp_path):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(model=str(tiny_llama_dir), max_num_seq=4)
    with pytest.raises((FileNotFoundError, ValueError), match="nowhere"):
        LLM(model=str(tmp_path / "nowhere"))


def test_prompt_logprobs_survive_preemption(tiny_llama_dir):
    config = load_config(tiny_llama_dir)
    block_bytes = KVCachePool.bytes_per_block(config, 16, torch.float32)
    long_prompt = "Once upon a time there was a small model that generated text. " * 2
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    roomy = LLM(model=str(tiny_llama_dir), max_model_len=96, dtype="float32")
    expected = roomy.generate(long_prompt, params, use_tqdm=False)[0].prompt_logprobs
    tight = LLM(model=str(tiny_llama_dir), max_model_len=96, dtype="float32", max_num_batched_tokens=16,
                kv_cache_space=7 * block_bytes / 2**30)
    outs = tight.generate([*PROMPTS, long_prompt], [GREEDY] * len(PROMPTS) + [params], use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    got = outs[-1].prompt_logprobs
    assert len(got) == len(outs[-1].prompt_token_ids) == len(expected)
    for position, (a, b) in enumerate(zip(got[1:], expected[1:]), start=1):
        token = outs[-1].prompt_token_ids[position]
        assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


def test_prompt_logprobs_zero_is_scored_whole_even_with_prefix_caching(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", enable_prefix_caching=True)
    prompt = "Once upon a time there was a small model that generated text. " * 3
    llm.generate(prompt, GREEDY, use_tqdm=False)  # fills the prefix cache
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])


def test_best_of_ranks_by_logprob_even_when_logprobs_are_not_asked(llama):
    common = dict(n=2, best_of=5, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    without = llama.generate(PROMPTS[0], SamplingParams(**common), use_tqdm=False)[0]
    scored = llama.generate(PROMPTS[0], SamplingParams(**common, logprobs=0), use_tqdm=False)[0]
    assert [o.token_ids for o in without.outputs] == [o.token_ids for o in scored.outputs]
    assert without.outputs[0].cumulative_logprob is None


def test_final_only_requests_report_once_when_finished(llama):
    """FINAL_ONLY (what LLM.generate asks for): no output while the request runs, one when it
    ends, holding everything a CUMULATIVE request's last output holds."""
    from hetero.core.sampling_params import RequestOutputKind

    engine = llama.llm_engine
    cumulative = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    final_only = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("cumulative", PROMPTS[0], cumulative)
    engine.add_request("final", PROMPTS[0], final_only)
    reported: dict[str, list] = {"cumulative": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            reported[out.request_id].append(out)
    assert len(reported["cumulative"]) > 1 and len(reported["final"]) == 1
    last, final = reported["cumulative"][-1], reported["final"][0]
    assert final.finished and final.outputs[0].token_ids == last.outputs[0].token_ids
    assert final.outputs[0].text == last.outputs[0].text and final.outputs[0].finish_reason == "length"


def test_generate_asks_for_final_outputs_without_changing_the_callers_params(llama):
    from hetero.core.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llama.generate(PROMPTS[:2], [params, params], use_tqdm=False)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    with pytest.raises(ValueError, match="^sampling_params must be SamplingParams"):
        llama.generate(PROMPTS[:1], [{"temperature": 0.0}], use_tqdm=False)


def test_an_engine_is_freed_without_the_cyclic_collector(tiny_llama_dir):
    """The heap is frozen once the first engine is built (`_freeze_startup_heap`), so the
    cyclic collector never sees that engine: dropping it must free it by reference counting
    alone, with whatever it ran (requests, proposer state) and its KV cache."""
    import gc
    import weakref

    llm = LLM(model=str(tiny_llama_dir), max_model_len=128, dtype="float32")
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    engine = weakref.ref(llm.llm_engine)
    kv_storage = weakref.ref(llm.llm_engine.kv_pool.storage)
    collecting = gc.isenabled()
    gc.disable()
    try:
        del llm
        assert engine() is None and kv_storage() is None
    finally:
        if collecting:
            gc.enable()


@pytest.fixture
def model_with_generation_config(tiny_llama_dir, tmp_path):
    """The tiny model in a copy whose generation_config.json sets sampling defaults, as model creators do."""
    import json
    import shutil

    directory = tmp_path / "with-generation-config"
    shutil.copytree(tiny_llama_dir, directory)
    path = directory / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config.update(do_sample=True, temperature=0.6, top_p=0.9, top_k=50, repetition_penalty=1.1, max_new_tokens=5)
    path.write_text(json.dumps(config))
    return directory


def test_the_models_generation_config_sets_the_default_sampling_parameters(model_with_generation_config):
    llm = LLM(model=str(model_with_generation_config), device="cpu", dtype="float32")
    params = llm.get_default_sampling_params()
    # top_k 50 is HF's own default, so it is not the model's choice (vLLM's get_diff_sampling_param).
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_tokens) == (0.6, 0.9, 0, 1.1, 5)
    assert [len(o.outputs[0].token_ids) for o in llm.generate(["Hello", "The capital of"], use_tqdm=False)] == [5, 5]
    plain = LLM(model=str(model_with_generation_config), device="cpu", dtype="float32", generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config"):
        LLM(model=str(model_with_generation_config), generation_config="nowhere")


def test_override_generation_config_sets_defaults_over_the_generation_config(model_with_generation_config, tiny_llama_dir,
                                                                           caplog):
    overrides = {"temperature": 0.5, "top_p": 1.0, "max_new_tokens": 3}  # top_p: HF's default, still set over the model's

    def llm(model, **kwargs):
        return LLM(model=str(model), device="cpu", dtype="float32", override_generation_config=overrides, **kwargs)

    with caplog.at_level(logging.INFO, logger="hetero"):
        auto = llm(model_with_generation_config)
    assert "override_generation_config" in caplog.text
    params = auto.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.repetition_penalty, params.max_tokens) == (0.5, 1.0, 1.1, 3)
    assert [len(o.outputs[0].token_ids) for o in auto.generate(["Hello", "The capital of"], use_tqdm=False)] == [3, 3]
    assert llm(tiny_llama_dir, generation_config=str(model_with_generation_config)).get_default_sampling_params() == params
    only_overrides = llm(model_with_generation_config, generation_config="vllm").get_default_sampling_params()
    assert only_overrides == SamplingParams(temperature=0.5, top_p=1.0, max_tokens=3)


def test_a_request_takes_the_generation_config_only_for_the_fields_it_leaves_unset(model_with_generation_config):
    from hetero.server.protocol import ChatCompletionRequest, CompletionRequest
    from hetero.server.serving import chat_sampling_params, completion_sampling_params

    defaults = LLM(model=str(model_with_generation_config), device="cpu", dtype="float32").llm_engine.default_sampling_fields
    unset = completion_sampling_params(CompletionRequest(model="m", prompt="Hi"), None, defaults)
    assert (unset.temperature, unset.top_p, unset.repetition_penalty) == (0.6, 0.9, 1.1)
    assert unset.max_tokens == 16  # OpenAI's completions default is a value, not unset
    given = completion_sampling_params(CompletionRequest(model="m", prompt="Hi", temperature=0.3, max_tokens=9), None, defaults)
    assert (given.temperature, given.top_p, given.max_tokens) == (0.3, 0.9, 9)
    messages = [{"role": "user", "content": "Hi"}]
    chat = chat_sampling_params(ChatCompletionRequest(model="m", messages=messages), None, defaults)
    assert (chat.temperature, chat.max_tokens) == (0.6, 5)
    chat = chat_sampling_params(ChatCompletionRequest(model="m", messages=messages, max_completion_tokens=3), None, defaults)
    assert chat.max_tokens == 3
