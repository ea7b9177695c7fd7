"""HF model directories: config.json (+ generation_config.json), safetensors weights, tokenizer files."""
from __future__ import annotations

import json
import pathlib
from typing import Any, Optional

import torch
import transformers
from safetensors import safe_open

from hetero.core.sampling_params import GENERATION_CONFIG_FIELDS

from .model_config import ModelConfig

ARCHITECTURE_BY_MODEL_TYPE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
ARCHITECTURE_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def safetensors_files(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(directory.glob("*.safetensors"))


def has_tokenizer_files(directory: pathlib.Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _architecture(hf: dict[str, Any], path: pathlib.Path) -> str:
    model_type = hf.get("model_type")
    if model_type in ARCHITECTURE_BY_MODEL_TYPE:
        return ARCHITECTURE_BY_MODEL_TYPE[model_type]
    classes = hf.get("architectures") or []
    for name in classes:
        if name in ARCHITECTURE_BY_CLASS:
            return ARCHITECTURE_BY_CLASS[name]
    raise ValueError(
        f"{path}: unsupported architecture (model_type={model_type!r}, architectures={classes}); "
        f"hetero runs model_type {', '.join(ARCHITECTURE_BY_MODEL_TYPE)}"
    )


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _eos_token_ids(hf: dict[str, Any], directory: pathlib.Path) -> tuple[int, ...]:
    """config.json's eos ids, then any more that generation_config.json adds (it often lists end-of-turn too)."""
    ids = list(_token_ids(hf.get("eos_token_id")))
    generation_config = directory / "generation_config.json"
    if generation_config.is_file():
        ids += [i for i in _token_ids(_read_json(generation_config).get("eos_token_id")) if i not in ids]
    return tuple(ids)


def sampling_defaults(directory: pathlib.Path) -> dict[str, Any]:
    """The sampling parameters a model directory's generation_config.json sets away from HF's
    defaults, under SamplingParams' names (`max_new_tokens` as `max_tokens`); {} without one."""
    path = pathlib.Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    config = _read_json(path)
    return {name: config[key] for key, (hf_default, name) in GENERATION_CONFIG_FIELDS.items()
            if config.get(key) is not None and config[key] != hf_default}


def _rope(hf: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """`(rope_theta, rope_scaling)` from either spelling: transformers 4's `rope_theta` + `rope_scaling`
    or transformers 5's `rope_parameters`. Scaling comes back as HF's dict with a `rope_type` key,
    or None for plain RoPE."""
    parameters = dict(hf.get("rope_parameters") or {})
    theta = float(parameters.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = dict(hf.get("rope_scaling") or parameters)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling["type"])
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _max_positions(hf: dict[str, Any], architecture: str) -> int:
    """The context length, capped at the sliding window where one is active.

    The runner attends over the full context; capping the length at the window keeps every
    sequence inside it, so full attention gives exactly the sliding-window model's output.
    """
    max_positions = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window")
    window_active = architecture == "mistral" or (architecture == "qwen2" and hf.get("use_sliding_window"))
    if window and window_active:
        return min(max_positions, int(window))
    return max_positions


def load_config(directory: pathlib.Path, hf_overrides: Optional[dict[str, Any]] = None) -> ModelConfig:
    """The architecture config.json describes, with vLLM's `hf_overrides` merged in first ("arguments to
    be forwarded to the Hugging Face config", https://docs.vllm.ai/en/latest/configuration/engine_args.html):
    each key replaces config.json's, as vLLM's update of the HF config does, so a key hetero does not
    read is kept and changes nothing. An override hetero cannot read as the setting it names (a string
    for an int, a rope type it does not run) is a ValueError naming the overrides."""
    hf = _read_json(directory / "config.json")
    if not hf_overrides:
        return _model_config(hf, directory)
    for key, value in hf_overrides.items():
        _check_override_type(key, value, hf.get(key))
    try:
        return _model_config(_with_overrides(hf, hf_overrides), directory)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"hf_overrides {hf_overrides!r} do not give a config hetero can run: {exc}") from exc


def _check_override_type(key: str, value: Any, stored: Any) -> None:
    """An override of one of config.json's numbers, flags or strings keeps its type (an int may stand
    for a float): config values are read with int(), float() and bool(), which would take 4096.5 as
    4096 and "false" as True without a word."""
    scalars = (bool, int, float, str)
    if not (isinstance(stored, scalars) and isinstance(value, scalars)):
        return
    if type(value) is not type(stored) and not (type(stored) is float and type(value) is int):
        raise ValueError(f"hf_overrides[{key!r}] is {value!r} ({type(value).__name__}), but config.json's {key} "
                         f"is {stored!r} ({type(stored).__name__})")


def _with_overrides(hf: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json with `overrides`' keys replacing its own. transformers 5 keeps rope_theta inside
    rope_parameters, where it wins over a top-level one (`_rope`), so an override in the older
    spelling is written there too: {"rope_theta": ...} takes effect whichever spelling the checkpoint has."""
    merged = {**hf, **overrides}
    if "rope_theta" in overrides and isinstance(hf.get("rope_parameters"), dict) and "rope_parameters" not in overrides:
        merged["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": overrides["rope_theta"]}
    return merged


def _model_config(hf: dict[str, Any], directory: pathlib.Path) -> ModelConfig:
    architecture = _architecture(hf, directory)
    if hf.get("mlp_bias"):
        raise ValueError(f"{directory}: mlp_bias=True is not supported (the runner's MLP has no bias)")
    if architecture != "qwen2" and hf.get("attention_bias"):
        raise ValueError(
            f"{directory}: attention_bias=True on {architecture} (a bias on o_proj too) is not supported; "
            "only Qwen2's q/k/v bias is"
        )
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    rope_theta, rope_scaling = _rope(hf)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        intermediate_size=int(hf["intermediate_size"]),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_max_positions(hf, architecture),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=architecture == "qwen2",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(hf, directory),
    )


def _file_of_each_tensor(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        return {name: directory / file for name, file in _read_json(index)["weight_map"].items()}
    owners: dict[str, pathlib.Path] = {}
    for file in safetensors_files(directory):
        with safe_open(file, framework="pt") as f:
            owners.update((name, file) for name in f.keys())
    return owners


def tensor_names(directory: pathlib.Path) -> set[str]:
    return set(_file_of_each_tensor(directory))


def load_tensors(
    directory: pathlib.Path, names: list[str], dtype: Optional[torch.dtype], device: torch.device
) -> dict[str, torch.Tensor]:
    """The named tensors on `device`, in `dtype` (None: as stored, e.g. a quantised checkpoint's packed words)."""
    owners = _file_of_each_tensor(directory)
    missing = [name for name in names if name not in owners]
    if missing:
        raise ValueError(
            f"{directory}: checkpoint has no tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else "")
        )
    by_file: dict[pathlib.Path, list[str]] = {}
    for name in names:
        by_file.setdefault(owners[name], []).append(name)
    safetensors_device = "cpu" if device.type == "cpu" else str(device)
    tensors: dict[str, torch.Tensor] = {}
    for file, file_names in by_file.items():
        with safe_open(file, framework="pt", device=safetensors_device) as f:
            for name in file_names:
                tensor = f.get_tensor(name)
                tensors[name] = tensor if dtype is None else tensor.to(dtype=dtype)
    return tensors


def load_tensor_slices(
    directory: pathlib.Path, slices: dict[str, Optional[tuple[int, int, int]]], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """The named tensors, each cut to its (dim, start, stop) slice (None: whole) as it is read:
    safetensors reads only the slice's bytes, so a tensor-parallel rank never holds another's part."""
    owners = _file_of_each_tensor(directory)
    missing = [name for name in slices if name not in owners]
    if missing:
        raise ValueError(f"{directory}: checkpoint has no tensor {missing[0]!r}")
    tensors: dict[str, torch.Tensor] = {}
    for name, part in slices.items():
        with safe_open(owners[name], framework="pt", device="cpu") as f:
            if part is None:
                tensor = f.get_tensor(name)
            else:
                dim, start, stop = part
                index = (slice(None),) * dim + (slice(start, stop),)
                tensor = f.get_slice(name)[index]
        tensors[name] = tensor.to(device=device, dtype=dtype)
    return tensors


def load_tokenizer(directory: pathlib.Path, trust_remote_code: bool) -> transformers.PreTrainedTokenizerBase:
    if not has_tokenizer_files(directory):
        raise FileNotFoundError(
            f"{directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); pass tokenizer=<path>"
        )
    return transformers.AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
