"""vLLM engine arguments that change nothing in hetero, at the values accepted.

A script written for vLLM passes more than the model: `enable_chunked_prefill=True`,
`disable_log_stats=True`, `kv_cache_dtype="auto"`, `swap_space=4`. Where hetero already
behaves as the argument asks (it always chunks long prompts, preempts by recomputation,
captures its own CUDA graphs, logs no periodic stats), the argument is accepted and changes
nothing; where the value asks for something hetero does not do (an FP8 KV cache, pipeline
parallelism, LoRA, a hub revision), it is a ValueError that names the argument and the
values accepted, rather than the TypeError of an unknown argument. The same table serves
`LLM(...)` (`EngineConfig.from_kwargs`) and `hetero serve`'s flags. vLLM's meanings:
https://docs.vllm.ai/en/latest/configuration/engine_args.html
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


def _any(_: Any) -> bool:
    return True


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    """An int and not a bool (True is an int to isinstance)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


@dataclass(frozen=True)
class NeutralArg:
    """One vLLM argument: the values at which it changes nothing here, and why."""

    name: str
    accepts: Callable[[Any], bool]
    accepted: str  # the accepted values, for the error
    why: str  # what hetero does that makes those values change nothing
    cli_type: Optional[Callable[[str], Any]] = str  # `hetero serve`'s flag; None: a --flag/--no-flag boolean


_ONE_PARTIAL_PREFILL = ("at most one prompt is part-way through its chunked prefill at a time: the chunk that "
                        "takes the rest of a step's token budget ends that step's admissions")
NEUTRAL_ARGS: tuple[NeutralArg, ...] = (
    NeutralArg("enable_chunked_prefill", _is_bool, "True or False",
               "prompts longer than max_num_batched_tokens are always prefilled in chunks", None),
    NeutralArg("disable_log_stats", _is_bool, "True or False", "no periodic stats are logged; they are on /metrics", None),
    NeutralArg("disable_log_requests", _is_bool, "True or False", "requests are not logged", None),
    NeutralArg("disable_async_output_proc", _is_bool, "True or False", "outputs are built as async scheduling decides", None),
    NeutralArg("swap_space", lambda v: _is_number(v) and v >= 0, "a number of GiB >= 0",
               "preempted sequences are recomputed, never swapped", float),
    NeutralArg("max_seq_len_to_capture", lambda v: isinstance(v, int) and v > 0, "a positive int",
               "CUDA graphs are captured for hetero's own buckets", int),
    NeutralArg("compilation_config", _any, "anything", "hetero's kernels are its own (Triton, C++), not torch.compile's"),
    NeutralArg("download_dir", _any, "anything", "models load from local paths; nothing is downloaded"),
    NeutralArg("hf_token", _any, "anything", "models load from local paths; nothing is downloaded"),
    NeutralArg("tokenizer_mode", _one_of("auto"), "'auto'", "the tokenizer is the model's fast tokenizer"),
    NeutralArg("revision", _one_of(None), "None", "models load from local paths: there is no hub revision to pick"),
    NeutralArg("tokenizer_revision", _one_of(None), "None", "models load from local paths: there is no hub revision to pick"),
    NeutralArg("code_revision", _one_of(None), "None", "models load from local paths: there is no hub revision to pick"),
    NeutralArg("kv_cache_dtype", _one_of("auto"), "'auto'", "the KV cache is kept in the model's dtype (no FP8 KV cache)"),
    NeutralArg("calculate_kv_scales", _one_of(False), "False", "the KV cache is kept in the model's dtype (no FP8 KV cache)", None),
    NeutralArg("task", _one_of("auto", "generate"), "'auto' or 'generate'", "hetero generates text (no pooling or embedding tasks)"),
    NeutralArg("pipeline_parallel_size", _one_of(1), "1", "a model is split by tensor parallelism only", int),
    NeutralArg("distributed_executor_backend", _one_of(None, "mp", "uni"), "None, 'mp' or 'uni'",
               "tensor-parallel ranks are processes on one host"),
    NeutralArg("enable_lora", _one_of(False), "False", "LoRA adapters are not supported", None),
    NeutralArg("cpu_offload_gb", _one_of(0, 0.0), "0", "weights stay on the GPU (the CPU holds the draft and the prefix "
               "cache's offload tier: --cpu-offload-gib)", float),
    NeutralArg("preemption_mode", _one_of(None, "recompute"), "None or 'recompute'", "preempted sequences are recomputed"),
    NeutralArg("scheduling_policy", _one_of("fcfs"), "'fcfs'", "requests are scheduled first come, first served"),
    NeutralArg("use_v2_block_manager", _is_bool, "True or False", "KV blocks have one manager (paged, with prefix caching)", None),
    NeutralArg("enable_sleep_mode", _one_of(False), "False", "the engine has no sleep mode", None),
    NeutralArg("limit_mm_per_prompt", _one_of(None, {}), "None", "prompts are text only"),
    NeutralArg("enable_prompt_embeds", _one_of(False), "False", "prompts are text or token ids (no prompt embeddings)", None),
    NeutralArg("disable_cascade_attn", _is_bool, "True or False",
               "attention runs over each sequence's own paged KV: there is no cascade attention to turn off", None),
    NeutralArg("max_num_partial_prefills", _one_of(1), "1", _ONE_PARTIAL_PREFILL, int),
    NeutralArg("max_long_partial_prefills", _one_of(1), "1", _ONE_PARTIAL_PREFILL, int),
    NeutralArg("long_prefill_token_threshold", _one_of(0), "0",
               "a prefill chunk takes as much of the step's token budget as is left, however long the prompt", int),
    NeutralArg("disable_sliding_window", _is_bool, "True or False", "no sliding window is applied: as vLLM does with True, "
               "a sliding-window model's context (Mistral; Qwen2 with use_sliding_window) is capped at its window, and a "
               "longer max_model_len is refused, so attention never reaches past the window", None),
    NeutralArg("model_impl", _one_of("auto"), "'auto'", "models run on hetero's own implementation (no Transformers backend)"),
    NeutralArg("config_format", _one_of("auto", "hf"), "'auto' or 'hf'",
               "a model's config is read from its config.json (HF's format) or its GGUF metadata (not Mistral's params.json)"),
    NeutralArg("max_parallel_loading_workers", lambda v: v is None or (is_int(v) and v > 0), "None or a positive int",
               "each tensor-parallel rank reads only its own shard, one tensor at a time: no batches of loaders to bound", int),
    NeutralArg("num_lookahead_slots", lambda v: is_int(v) and v >= 0, "an int >= 0", "vLLM V1 ignores it too: the KV blocks "
               "of a step's draft-tree nodes are reserved from the speculation settings as the step is scheduled", int),
    NeutralArg("worker_cls", _one_of("auto"), "'auto'", "the target runs in hetero's own model runner (no worker class to pick)"),
    NeutralArg("enable_expert_parallel", _one_of(False), "False",
               "expert parallelism is not supported (hetero runs dense models: Llama, Mistral, Qwen2)", None),
    NeutralArg("guided_decoding_backend", _one_of("auto", "guidance", "xgrammar", "outlines"),
               "'auto', 'guidance', 'xgrammar' or 'outlines'", "structured outputs are enforced by llguidance (vLLM's "
               "'guidance') whichever backend is named, as with the request field of that name, JSON schemas closed to "
               "the properties they list as vLLM's default backend (xgrammar) closes them"),
)
NEUTRAL_BY_NAME = {arg.name: arg for arg in NEUTRAL_ARGS}


def drop_neutral_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the neutral vLLM arguments, each checked: a ValueError names one whose
    value would change something hetero does not do."""
    kept = {}
    for name, value in kwargs.items():
        arg = NEUTRAL_BY_NAME.get(name)
        if arg is None:
            kept[name] = value
        elif not arg.accepts(value):
            raise ValueError(f"{name}={value!r} is not supported: {arg.why}; it accepts {arg.accepted}, which change nothing")
    return kept
