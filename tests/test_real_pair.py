"""The real Qwen2.5-Coder pair (`hetero models install qwen2.5-coder`): loads by name, and the
1.5B target with the 0.5B draft in the CPU worker gives plain decoding's greedy tokens in float32.

Skipped where the pair is not installed: CI does not download 1.6 GB on every run.
"""
from __future__ import annotations

import gc

import pytest

from gpu_target import gguf_checkpoint, loader, model_catalog
from hetero import LLM, SamplingParams

TARGET, DRAFT = model_catalog.QWEN25_CODER_15B, model_catalog.QWEN25_CODER_05B

pytestmark = pytest.mark.skipif(
    not all(model_catalog.installed_path(m).is_file() for m in (TARGET, DRAFT)),
    reason="the Qwen2.5-Coder pair is not installed (`hetero models install qwen2.5-coder`, 1.6 GB)",
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
MESSAGES = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


def test_pair_loads_by_name_with_one_vocabulary_and_the_ggufs_chat_template():
    types = {t.tensor_type for m in (TARGET, DRAFT) for t in gguf_checkpoint.open_reader(loader.resolve_model_path(m.name)).tensors}
    assert types <= set(gguf_checkpoint.SUPPORTED_TYPES)
    target, draft = loader.load_tokenizer(TARGET.name), loader.load_tokenizer(DRAFT.name)
    text = "def f(x):\n    return x ** 2  # 二乗\n<|im_end|>"
    assert target.encode(text) == draft.encode(text)
    prompt = target.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWrite a Python" in prompt


def _chat_tokens(llm: LLM) -> list[int]:
    (output,) = llm.chat(MESSAGES, GREEDY, use_tqdm=False)
    return list(output.outputs[0].token_ids)


def test_cpu_draft_worker_gives_plain_greedy_tokens_in_float32():
    plain = LLM(model=TARGET.name, device="cpu", dtype="float32", max_model_len=512, kv_cache_space=0.5)
    expected = _chat_tokens(plain)
    del plain
    gc.collect()

    llm = LLM(model=TARGET.name, speculative_model=DRAFT.name, num_speculative_tokens=4, cpu_draft_worker=True,
              device="cpu", dtype="float32", max_model_len=512, kv_cache_space=0.5)
    llm.llm_engine.spec_control.always_speculate = True  # judge the drafts, not whether they pay on this CPU
    try:
        assert _chat_tokens(llm) == expected
        stats = llm.llm_engine.spec_stats
        assert stats.num_steps > 0 and stats.mean_accepted_length > 1.0
    finally:
        llm.llm_engine.proposer.close()
