"""Engine configuration: the vLLM / TACO-LLM argument names, their defaults and validation.

`EngineConfig` takes the flat arguments users pass (vLLM's and TACO-LLM's names) and resolves
the speculative ones into two typed parts: `DraftConfig` (the draft model's worker and trees,
from vLLM's ``speculative_config`` dict) and `LookaheadConfig` (the lookahead cache, from
TACO-LLM's ``lookahead_cache_config_dir`` or an ngram ``speculative_config``). Environment
variables are read here only, as documented defaults.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from hetero.core.lookahead_config import LookaheadConfig
from hetero.core.sampling_params import generation_config_overrides
from hetero.core.vllm_args import drop_neutral_args, is_int


_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
BATCH_INVARIANT_ENV = "HETERO_BATCH_INVARIANT"

DEFAULT_CUDA_SCHEDULER_STEPS = 8
DRAFT_ENV_PREFIX = "HETERO_DRAFT_"
DRAFT_DTYPES = ("auto", "float32", "float", "bfloat16")


def _env_default(name: str, parse: Callable[[str], Any], default: Any) -> Any:
    """A DraftConfig field whose default is $HETERO_DRAFT_<NAME> when set and not empty, read
    when the config is built; a value given explicitly wins over the variable."""
    variable = DRAFT_ENV_PREFIX + name.upper()

    def read() -> Any:
        text = os.environ.get(variable)
        if not text:
            return default
        try:
            return parse(text)
        except ValueError:
            raise ValueError(f"{variable} has a bad value {text!r}") from None

    return field(default_factory=read)


def _quantization_env(text: str) -> Optional[str]:
    return None if text == "none" else text


def _on_off_env(text: str) -> bool:
    return text.lower() not in ("0", "false", "no")


DEFAULT_MAX_LOGPROBS = 20  # vLLM's max_logprobs default (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class DraftConfig:
    """The draft model's settings: how the CPU draft worker runs it and the trees it drafts.

    Set through vLLM's ``speculative_config`` dict, whose keys are these field names (with
    ``method``, ``model``, ``num_speculative_tokens``, ``prompt_lookup_max/min``), or passed
    as ``EngineConfig(draft=DraftConfig(...))``. Every field but the last two defaults to
    $HETERO_DRAFT_<FIELD> when that is set (e.g. HETERO_DRAFT_THREADS=8, HETERO_DRAFT_CPUS=4-15,
    HETERO_DRAFT_QUANTIZATION=int8, HETERO_DRAFT_OVERLAP=0), else to the value below.
    """

    tree_width: int = _env_default("tree_width", int, 1)  # children per drafted node; 1: chains
    quantization: Optional[str] = _env_default("quantization", _quantization_env, None)  # "int8": INT8 weights
    cpus: Optional[str] = _env_default("cpus", str, None)  # the worker's cores, a Linux cpulist ("4-15"); None: after the first 1 in 8, at most 16
    threads: Optional[int] = _env_default("threads", int, None)  # the worker's threads; None: one per core
    kv_cache_gib: float = _env_default("kv_cache_gib", float, 1.0)  # the draft's own KV cache
    reply_timeout_s: float = _env_default("reply_timeout_s", float, 10.0)  # a silent worker is restarted after this
    overlap: bool = _env_default("overlap", _on_off_env, True)  # draft the next tree while the target verifies
    dtype: str = _env_default("dtype", str, "auto")  # the CPU worker's: auto (bfloat16 where the native forward builds), float32, bfloat16
    # The draft's logits head over the most frequent tokens only (FR-Spec; cpu_draft/draft_vocab.py):
    # how many, and optionally SGLang's speculative_token_map file ranking them. None: the whole vocabulary.
    draft_vocab_size: Optional[int] = None
    speculative_token_map: Optional[str] = None

    def __post_init__(self) -> None:
        _draft_check(is_int(self.tree_width) and self.tree_width >= 1, "tree_width", self.tree_width, "must be an int of at least 1")
        _draft_check(self.quantization in (None, "int8"), "quantization", self.quantization, "must be None or 'int8'")
        _draft_check(self.cpus is None or isinstance(self.cpus, str), "cpus", self.cpus, "must be a cpulist such as '4-15'")
        _draft_check(self.threads is None or (is_int(self.threads) and self.threads >= 1), "threads", self.threads,
                     "must be None or an int of at least 1")
        for name in ("kv_cache_gib", "reply_timeout_s"):
            value = getattr(self, name)
            _draft_check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, name, value, "must be positive")
        _draft_check(isinstance(self.overlap, bool), "overlap", self.overlap, "must be True or False")
        _draft_check(self.dtype in DRAFT_DTYPES, "dtype", self.dtype, f"must be one of {list(DRAFT_DTYPES)}")
        if self.draft_vocab_size is not None:
            _check(is_int(self.draft_vocab_size) and self.draft_vocab_size >= 1,
                   "speculative_config.draft_vocab_size", self.draft_vocab_size, "must be a positive int")
        if self.speculative_token_map is not None:
            _check(isinstance(self.speculative_token_map, str) and os.path.isfile(self.speculative_token_map),
                   "speculative_token_map", self.speculative_token_map,
                   "must be a file of token ids (.npy, .pt, .json or whitespace-separated text)")


_DRAFT_KEYS = tuple(f.name for f in dataclasses.fields(DraftConfig))
SPECULATIVE_CONFIG_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", *_DRAFT_KEYS)


@dataclass
class EngineConfig:
    model: str
    tokenizer: Optional[str] = None
    # vLLM's hf_overrides: keys merged into the model's config.json before it is read, e.g.
    # {"max_position_embeddings": 8192} or {"rope_theta": 1e6} (gpu_target/hf_checkpoint.py); HF checkpoints only.
    hf_overrides: Optional[dict[str, Any]] = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # most logprobs / prompt_logprobs a request may ask for (vLLM's); -1: no cap
    # vLLM's: "auto", the sampling defaults of the model's generation_config.json for the fields a
    # request leaves unset; "vllm", none; or a directory holding a generation_config.json.
    generation_config: str = "auto"
    # vLLM's: default sampling parameters set over generation_config's (over none for "vllm"), under
    # generation_config.json's names, e.g. {"temperature": 0.5, "max_new_tokens": 256}.
    override_generation_config: Optional[dict[str, Any]] = None
    gpu_memory_utilization: float = 0.9
    kv_cache_space: Optional[float] = None  # GiB of KV cache on the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE)
    # vLLM's: the KV cache's bytes (per GPU under tensor parallelism); given, it sizes the cache on any
    # device, and gpu_memory_utilization and kv_cache_space are ignored (gpu_target/runner.py: num_kv_blocks).
    kv_cache_memory_bytes: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None  # KV blocks, whatever memory says (vLLM's name; any device)
    block_size: int = 16
    enable_prefix_caching: bool = True  # on by default, as in vLLM V1
    # TACO-LLM's prefix cache offload: cached blocks are copied to a CPU block pool
    # (`cpu_offload_gib` GiB) when freed, and restored on a hit once evicted from the device's
    # KV memory instead of recomputed (gpu_target/kv_offload.py). A block is offloaded once it has been used
    # `apc_offload_min_access_threshold` times; `apc_offload_enable_hit_cnt` logs where
    # prompts' blocks were found every 100 of them.
    enable_prefix_cache_offload: bool = False
    apc_offload_min_access_threshold: int = 1
    apc_offload_enable_hit_cnt: bool = False
    cpu_offload_gib: float = 4.0
    enforce_eager: bool = False
    # Decode steps run back to back on the device per host round trip (vLLM's multi-step
    # scheduling); None: 8 on CUDA, 1 on the CPU. See Scheduler.reserve_run_ahead.
    num_scheduler_steps: Optional[int] = None
    # vLLM V1's async scheduling: the next step is scheduled and launched on the device before
    # the host turns the last one's tokens into outputs (text, RequestOutputs) and hands them
    # to the caller. Outputs are identical either way. See LLMEngine.step.
    async_scheduling: bool = True
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    # vLLM's name and default: False sends decode-sized tensor-parallel all-reduces through the
    # one-shot all-reduce over NVLink (gpu_target/custom_all_reduce.py), NCCL taking the rest and
    # everything where the ranks cannot set it up; True keeps every all-reduce on NCCL.
    disable_custom_all_reduce: bool = False
    device: str = "auto"
    load_format: str = "auto"  # "dummy": random weights in the checkpoint's shapes (vLLM's name), for timing
    # Target weights: "fp8", "int4" (quantised at load) or a "gptq" / "awq" checkpoint (gpu_target/quantization).
    quantization: Optional[str] = None
    skip_tokenizer_init: bool = False  # prompts as token ids, outputs without text (vLLM's name)
    # Each token's KV, hidden states and logits bit-identical whatever the batch (CPU:
    # gpu_target/batch_invariant.py; CUDA: gpu_target/batch_invariant_gpu.py);
    # HETERO_BATCH_INVARIANT=1 turns it on too (vLLM: VLLM_BATCH_INVARIANT).
    batch_invariant: bool = False
    # Speculation (vLLM and TACO-LLM spellings).
    speculative_model: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    speculative_config: Optional[dict[str, Any]] = None  # keys: SPECULATIVE_CONFIG_KEYS; resolved into `draft`
    cpu_draft_worker: bool = False
    # SGLang's names for DraftConfig.draft_vocab_size / speculative_token_map (speculative_config's keys win).
    speculative_draft_vocab_size: Optional[int] = None
    speculative_token_map: Optional[str] = None
    lookahead_cache_config_dir: Optional[str] = None
    cpu_decoding_memory_utilization: float = 0.15
    ignore_prompt_for_lookahead_cache: bool = False
    # The typed speculation settings the proposers read. `lookahead`: None unless given, or resolved
    # from lookahead_cache_config_dir or an ngram speculative_config (then no lookahead cache when neither).
    draft: DraftConfig = field(default_factory=DraftConfig)
    lookahead: Optional[LookaheadConfig] = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a path to an HF model directory or a .gguf file")
        if self.hf_overrides is not None:
            _check(isinstance(self.hf_overrides, dict) and all(isinstance(key, str) for key in self.hf_overrides),
                   "hf_overrides", self.hf_overrides, "must be a dict of config.json keys to values (vLLM's callable "
                   "form, over transformers' PretrainedConfig, is not supported: hetero reads config.json itself)")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        self._check_tensor_parallel()
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be at least 1")
        if self.max_model_len is not None:
            _check(self.max_model_len >= 1, "max_model_len", self.max_model_len, "must be at least 1")
        if self.max_num_batched_tokens is not None:
            _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens, "must be at least 1")
        _check(self.max_logprobs >= -1, "max_logprobs", self.max_logprobs, "must be non-negative or -1 (no cap)")
        _check(self.generation_config in ("auto", "vllm") or os.path.isdir(self.generation_config), "generation_config",
               self.generation_config, "must be 'auto', 'vllm' or a directory holding a generation_config.json")
        generation_config_overrides(self.override_generation_config)  # checked here; the engine applies them
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        if self.kv_cache_space is not None:
            _check(self.kv_cache_space > 0, "kv_cache_space", self.kv_cache_space, "must be positive (GiB)")
        if self.kv_cache_memory_bytes is not None:
            _check(is_int(self.kv_cache_memory_bytes) and self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes",
                   self.kv_cache_memory_bytes, "must be a positive int (bytes)")
        if self.num_gpu_blocks_override is not None:
            _check(self.num_gpu_blocks_override > 0, "num_gpu_blocks_override", self.num_gpu_blocks_override, "must be positive")
        if self.num_scheduler_steps is not None:
            _check(
                isinstance(self.num_scheduler_steps, int) and 1 <= self.num_scheduler_steps <= 64,
                "num_scheduler_steps", self.num_scheduler_steps, "must be an int in [1, 64]",
            )
        self._check_prefix_cache_offload()
        _check(self.block_size in (8, 16, 32, 64, 128), "block_size", self.block_size, "must be one of 8, 16, 32, 64, 128")
        _check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device", self.device, "must be 'auto', 'cpu' or 'cuda'")
        _check(self.load_format in ("auto", "dummy"), "load_format", self.load_format, "must be 'auto' or 'dummy'")
        check_quantization(self.quantization)
        _check(isinstance(self.batch_invariant, bool), "batch_invariant", self.batch_invariant, "must be True or False")
        _check(isinstance(self.async_scheduling, bool), "async_scheduling", self.async_scheduling, "must be True or False")
        _check(isinstance(self.disable_custom_all_reduce, bool), "disable_custom_all_reduce",
               self.disable_custom_all_reduce, "must be True or False")
        self.batch_invariant = self.batch_invariant or _env_flag(BATCH_INVARIANT_ENV)
        _check(0 < self.cpu_decoding_memory_utilization <= 1, "cpu_decoding_memory_utilization", self.cpu_decoding_memory_utilization, "must be in (0, 1]")
        if self.num_speculative_tokens is not None:
            _check(1 <= self.num_speculative_tokens <= 63, "num_speculative_tokens", self.num_speculative_tokens, "must be in [1, 63]")
        self._resolve_draft()
        self._resolve_lookahead()

    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        _check(size in (1, 2, 4, 8) and not isinstance(size, bool), "tensor_parallel_size", size, "must be 1, 2, 4 or 8")
        if size == 1:
            return
        _check(not self.enable_prefix_cache_offload, "enable_prefix_cache_offload", self.enable_prefix_cache_offload,
               "is not supported with tensor_parallel_size > 1 yet")

    def _check_prefix_cache_offload(self) -> None:
        for name in ("enable_prefix_caching", "enable_prefix_cache_offload", "apc_offload_enable_hit_cnt"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be True or False")
        threshold = self.apc_offload_min_access_threshold
        _check(isinstance(threshold, int) and not isinstance(threshold, bool) and threshold >= 1,
               "apc_offload_min_access_threshold", threshold, "must be an int of at least 1")
        gib = self.cpu_offload_gib
        _check(isinstance(gib, (int, float)) and not isinstance(gib, bool) and gib > 0, "cpu_offload_gib", gib, "must be positive (GiB)")
        for name in ("enable_prefix_cache_offload", "apc_offload_enable_hit_cnt"):
            if getattr(self, name) and not self.enable_prefix_caching:
                raise ValueError(f"{name} needs enable_prefix_caching=True (the offload tier holds prefix-cache blocks)")

    def _resolve_draft(self) -> None:
        """Fold vLLM's `speculative_config` dict and SGLang's flat draft-vocabulary fields into `draft`."""
        _check(isinstance(self.draft, DraftConfig), "draft", self.draft, "must be a DraftConfig")
        values: dict[str, Any] = {}
        if self.speculative_draft_vocab_size is not None:
            _check(is_int(self.speculative_draft_vocab_size) and self.speculative_draft_vocab_size >= 1,
                   "speculative_draft_vocab_size", self.speculative_draft_vocab_size, "must be a positive int")
            values["draft_vocab_size"] = self.speculative_draft_vocab_size
        if self.speculative_token_map is not None:
            values["speculative_token_map"] = self.speculative_token_map
        spec = self.speculative_config
        if spec is not None:
            if not isinstance(spec, dict):
                raise ValueError("speculative_config must be a dict")
            _check_speculative_keys(spec)
            method = self.speculative_method
            if method not in ("ngram", "draft_model"):
                raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model', got {method!r}")
            if method == "draft_model":
                if not spec.get("model") and not self.speculative_model:
                    raise ValueError("speculative_config.model is required for a draft model")
                self.speculative_model = spec.get("model") or self.speculative_model
            if "num_speculative_tokens" in spec:
                k = spec["num_speculative_tokens"]
                _check(is_int(k) and 1 <= k <= 63, "speculative_config.num_speculative_tokens", k, "must be an int in [1, 63]")
                self.num_speculative_tokens = k
            values.update((key, spec[key]) for key in _DRAFT_KEYS if key in spec)
        if values:
            self.draft = dataclasses.replace(self.draft, **values)

    def _resolve_lookahead(self) -> None:
        """The lookahead cache's settings: given, from an ngram speculative_config, or from TACO-LLM's config dir."""
        if self.lookahead is None:
            if self.speculative_method == "ngram":
                spec = self.speculative_config
                self.lookahead = LookaheadConfig.from_ngram(
                    num_speculative_tokens=spec.get("num_speculative_tokens", 5),
                    prompt_lookup_max=spec.get("prompt_lookup_max"),
                    prompt_lookup_min=spec.get("prompt_lookup_min"),
                )
            elif self.lookahead_cache_config_dir:
                self.lookahead = LookaheadConfig.from_dir(self.lookahead_cache_config_dir)
        _check(self.lookahead is None or isinstance(self.lookahead, LookaheadConfig), "lookahead", self.lookahead,
               "must be None or a LookaheadConfig")
        if self.lookahead is not None and self.ignore_prompt_for_lookahead_cache:
            self.lookahead = dataclasses.replace(self.lookahead, ignore_prompt=True)

    @property
    def speculative_method(self) -> Optional[str]:
        """speculative_config's method: given, else draft_model when a draft model is named."""
        spec = self.speculative_config or {}
        return spec.get("method", "draft_model" if "model" in spec or self.speculative_model else None)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(self.device)
        if self.batch_invariant and device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"batch_invariant is supported on the CPU and on CUDA GPUs, "
                f"but the target would run on {device}; pass device='cpu' or 'cuda', or turn batch_invariant off"
            )
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA GPU is visible to PyTorch")
        return device

    def resolve_scheduler_steps(self, device: torch.device) -> int:
        """Multi-step decoding pays off where a host round trip idles the device: on CUDA."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        return DEFAULT_CUDA_SCHEDULER_STEPS if device.type == "cuda" else 1

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        """The config of ``LLM(model, **kwargs)``: vLLM's arguments that change nothing here
        (`hetero.core.vllm_args`) are checked and dropped; an unknown one is a TypeError."""
        kwargs = drop_neutral_args(kwargs)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unexpected engine argument(s) {unknown}")
        return cls(model=model, **kwargs)


QUANTIZATION_METHODS = ("fp8", "int4", "gptq", "awq")  # vLLM's names; gpu_target/quantization/ implements them


def check_quantization(quantization: Optional[str]) -> None:
    """A ValueError naming the field unless `quantization` is None or a known method."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {list(QUANTIZATION_METHODS)}, got {quantization!r}")


def _check(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}, got {value!r}")


def _draft_check(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{name} (${DRAFT_ENV_PREFIX}{name.upper()}) {why}, got {value!r}")


def _check_speculative_keys(spec: dict[str, Any]) -> None:
    """vLLM's message for a key speculative_config does not have, with the closest valid key."""
    unknown = [key for key in spec if key not in SPECULATIVE_CONFIG_KEYS]
    if unknown:
        hints = {key: difflib.get_close_matches(str(key), SPECULATIVE_CONFIG_KEYS, n=1) for key in unknown}
        hint = "".join(f" (did you mean {match[0]!r} for {key!r}?)" for key, match in hints.items() if match)
        raise ValueError(f"Unexpected keyword argument(s) {unknown} in speculative_config{hint}; "
                         f"valid keys are: {', '.join(SPECULATIVE_CONFIG_KEYS)}")


def _env_flag(name: str) -> bool:
    """An on/off environment variable: unset, empty or "0" is off, "1" is on."""
    value = os.environ.get(name) or "0"
    _check(value in ("0", "1"), name, value, "must be 0 or 1")
    return value == "1"


def cpu_has_native_bf16() -> bool:
    """True on CPUs whose matrix units do BF16 natively (AMX or AVX-512 BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
