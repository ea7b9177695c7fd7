"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors -> HF-named weights, tokenizer from metadata.

Two things differ from an HF checkpoint beyond the names:
- llama.cpp's converter permutes the rows of q_proj/k_proj in Llama-family models (it pairs
  rotary dimensions (i, i + d/2) as adjacent rows for its own RoPE kernel); we undo that so
  the weights fit HF's rotate-half RoPE.
- tensors may be quantised (`SUPPORTED_TYPES`: llama.cpp's float, legacy and K-quant types);
  they are dequantised one at a time, with `gguf.quants`' reference routines (vectorised numpy)
  or, for the commonest legacy types, the same arithmetic in torch on the target device.
"""
from __future__ import annotations

import functools
import pathlib
import re
from typing import Any, Optional

import gguf
import numpy as np
import torch
import transformers
from tokenizers import pre_tokenizers

from .model_config import ModelConfig

# GGUF `general.architecture` -> (our architecture, whether q/k rows are permuted, q/k/v bias)
ARCHITECTURES = {
    "llama": ("llama", True, False),
    "qwen2": ("qwen2", False, True),
}
ROPE_FREQ_FACTORS_NAME = "model.rope_freq_factors"
ROPE_FREQS_GGUF_NAME = "rope_freqs.weight"

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")

# `tokenizer.ggml.pre` values whose HF tokenizer splits every digit off before GPT-2's regex
# (llama.cpp: regexes "\p{N}" then GPT-2's). transformers' GGUF loader leaves these on plain GPT-2
# splitting, which tokenises e.g. "  1" differently from the original tokenizer.
_INDIVIDUAL_DIGIT_PRE_TOKENIZERS = ("smollm", "starcoder", "refact", "codeshell")


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_NAME.fullmatch(hf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"no GGUF name known for tensor {hf_name!r}")
    return f"blk.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


@functools.lru_cache(maxsize=1)
def _cached_reader(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def open_reader(path: pathlib.Path) -> gguf.GGUFReader:
    """A parsed GGUF, shared by the config, weight and tokenizer loads of one model.

    Parsing the metadata of a real model (50k-entry vocabulary arrays) takes seconds, and a
    model load reads the same file three times in a row. The reader only memory-maps the file.
    """
    stat = pathlib.Path(path).stat()
    return _cached_reader(str(path), stat.st_mtime_ns, stat.st_size)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _float_field(reader: gguf.GGUFReader, key: str, default: Optional[float] = None) -> Optional[float]:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.9999997e-06)."""
    value = _field(reader, key)
    return default if value is None else float(str(np.float32(value)))


def _architecture(reader: gguf.GGUFReader, path: pathlib.Path) -> tuple[str, str, bool, bool]:
    """`(gguf architecture, our architecture, q/k permuted, attention bias)`."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; hetero runs GGUF architectures "
            f"{', '.join(ARCHITECTURES)}"
        )
    return (arch, *ARCHITECTURES[arch])


def _tensor(reader: gguf.GGUFReader, name: str) -> Optional[gguf.ReaderTensor]:
    return next((t for t in reader.tensors if t.name == name), None)


def _rope_scaling(reader: gguf.GGUFReader, arch: str, path: pathlib.Path) -> Optional[dict[str, Any]]:
    """llama.cpp's `{arch}.rope.scaling.*` keys as HF's `rope_scaling` dict."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _float_field(reader, f"{arch}.rope.scaling.factor")
    legacy_linear = _float_field(reader, f"{arch}.rope.scale_linear")
    if kind is None and legacy_linear is not None:
        kind, factor = "linear", legacy_linear
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = _float_field(reader, f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                scaling[hf_key] = value
        return scaling
    raise ValueError(f"{path}: unsupported RoPE scaling type {kind!r} ({arch}.rope.scaling.type)")


def _eos_token_ids(reader: gguf.GGUFReader) -> tuple[int, ...]:
    """EOS plus end-of-turn/end-of-message ids: llama.cpp stops generation on all of them."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def config_from_reader(reader: gguf.GGUFReader, path: pathlib.Path) -> ModelConfig:
    arch, architecture, _, attention_bias = _architecture(reader, path)
    embeddings = _tensor(reader, "token_embd.weight")
    if embeddings is None:
        raise ValueError(f"{path}: GGUF has no tensor 'token_embd.weight'")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    if not attention_bias and _tensor(reader, "blk.0.attn_q.bias") is not None:
        raise ValueError(f"{path}: q/k/v biases on GGUF architecture {arch!r} are not supported")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(embeddings.shape[1]),  # GGUF shapes are in ggml order: (hidden, vocab)
        hidden_size=hidden,
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        rms_norm_eps=_float_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=_float_field(reader, f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(reader, arch, path),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings=_tensor(reader, "output.weight") is None,
        attention_bias=attention_bias,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_token_ids(reader),
    )


def load_config(path: pathlib.Path) -> ModelConfig:
    return config_from_reader(open_reader(path), path)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `LlamaModel.permute`.

    The converter maps each head's rows as reshape(heads, 2, d/2).swapaxes(1, 2): row i of the
    first half and row i of the second half become rows 2i and 2i+1. Reading the rows back as
    (heads, d/2, 2) and swapping the last two axes restores HF's order. Works for biases too.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


def _block_scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at byte `start` of each block, as a float32 column."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _low_then_high_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """ggml's 4-bit layout: values 0..15 of a block in the low nibbles, 16..31 in the high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _block_scale(blocks, 0)


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _block_scale(blocks, 0) * (_low_then_high_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _block_scale(blocks, 0) * _low_then_high_nibbles(blocks[:, 4:]).float() + _block_scale(blocks, 2)


# The common types, in torch so they run on the target device (seconds for an 8B model on a GPU).
# Same float32 arithmetic as gguf.quants, which handles every other type on the CPU.
_TORCH_DEQUANTIZERS = {
    gguf.GGMLQuantizationType.Q8_0: _dequantize_q8_0,
    gguf.GGMLQuantizationType.Q4_0: _dequantize_q4_0,
    gguf.GGMLQuantizationType.Q4_1: _dequantize_q4_1,
}


_Q = gguf.GGMLQuantizationType
# Every tensor type the loader reads; tests check each against gguf.quants' reference.
SUPPORTED_TYPES = (
    _Q.F32, _Q.F16, _Q.BF16,
    _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
)


def dequantize(tensor: gguf.ReaderTensor, device: torch.device) -> torch.Tensor:
    """One GGUF tensor as float32 on `device`, in HF shape (ggml's `ne` reversed, row-major)."""
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    kind = tensor.tensor_type
    if kind not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"GGUF tensor {tensor.name!r} has type {kind.name}, which hetero does not read (it reads {names})")
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        values = torch.from_numpy(np.array(tensor.data)).to(device).float()
    elif kind == gguf.GGMLQuantizationType.BF16:
        values = torch.from_numpy(np.array(tensor.data)).to(device).view(torch.bfloat16).float()
    elif kind in _TORCH_DEQUANTIZERS:
        _, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        blocks = torch.from_numpy(np.array(tensor.data)).to(device).reshape(-1, block_bytes)
        values = _TORCH_DEQUANTIZERS[kind](blocks)
    else:
        values = torch.from_numpy(gguf.quants.dequantize(np.array(tensor.data), kind)).to(device)
    return values.reshape(shape)


def load_tensors(
    path: pathlib.Path, config: ModelConfig, names: list[str], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    reader = open_reader(path)
    _, _, permuted, _ = _architecture(reader, path)
    by_name = {t.name: t for t in reader.tensors}
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        source = gguf_name(name)
        if source not in by_name:
            raise ValueError(f"{path}: GGUF has no tensor {source!r} (needed for {name!r})")
        weight = dequantize(by_name[source], device)
        if permuted and ".self_attn.q_proj." in name:
            weight = unpermute_rotary_rows(weight, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            weight = unpermute_rotary_rows(weight, config.num_kv_heads)
        tensors[name] = weight.to(dtype)
    if ROPE_FREQS_GGUF_NAME in by_name:
        tensors[ROPE_FREQ_FACTORS_NAME] = dequantize(by_name[ROPE_FREQS_GGUF_NAME], device)
    return tensors


def load_tensor_slices(
    path: pathlib.Path, config: ModelConfig, slices: dict[str, Optional[tuple[int, int, int]]],
    dtype: torch.dtype, device: torch.device,
) -> dict[str, torch.Tensor]:
    """`load_tensors`, each tensor cut to its (dim, start, stop) slice (None: whole) right after
    it is dequantised (and its rotary rows restored), before the next one is read."""
    tensors: dict[str, torch.Tensor] = {}
    for name, part in slices.items():
        whole = load_tensors(path, config, [name], torch.float32, device)
        tensor = whole.pop(name)
        if part is not None:
            dim, start, stop = part
            tensor = tensor.narrow(dim, start, stop - start)
        tensors[name] = tensor.to(dtype).clone()
        tensors.update(whole)  # the rope frequency factors, when the file has them
    return tensors


def load_tokenizer(path: pathlib.Path) -> transformers.PreTrainedTokenizerBase:
    """transformers' tokenizer built from the GGUF's `tokenizer.*` metadata (works offline).

    It carries the chat template, BOS/EOS/UNK/PAD and the control tokens as special tokens.
    For the vocabularies in `_INDIVIDUAL_DIGIT_PRE_TOKENIZERS` the pre-tokenizer is set to the
    one their HF tokenizer.json has, so ids match the original tokenizer exactly.
    """
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    pre = _field(open_reader(path), "tokenizer.ggml.pre")
    if pre in _INDIVIDUAL_DIGIT_PRE_TOKENIZERS:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    return tokenizer
