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
