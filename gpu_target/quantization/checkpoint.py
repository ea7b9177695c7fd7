"""Pre-quantised HF checkpoints: config.json's `quantization_config`, and each projection's tensors
unpacked into `Fp8Weight` / `Int4Weight`, as vLLM reads them.

- FP8 (`quant_method` "fp8", vllm/model_executor/layers/quantization/fp8.py; or
  "compressed-tensors" with 8-bit float weights, the llm-compressor FP8 format): `weight` in
  float8_e4m3fn with `weight_scale` per tensor or per channel, or `weight_scale_inv` per
  [128, 128] block (`weight_block_size`), re-quantised here per channel. Static
  `input_scale`s are not read: activations are scaled per token at run time.
- GPTQ (AutoGPTQ's layout): `qweight` int32 [K/8, N], eight 4-bit codes along K per word,
  lowest bits first; `qzeros` int32 [K/G, N/8] packed along N, stored minus one unless
  `checkpoint_format` is "gptq_v2"; `scales` fp16 [K/G, N]; `g_idx` int32 [K], each input
  column's group (act-order checkpoints permute it).
- AWQ (AutoAWQ's "gemm" version): `qweight` int32 [K, N/8] and `qzeros` int32 [K/G, N/8],
  packed along N in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7; `scales` fp16 [K/G, N].
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Callable, Optional

import torch

from gpu_target.quantization.fp8 import FP8_DTYPE, Fp8Weight, quantize_fp8
from gpu_target.quantization.int4 import Int4Weight, pack_nibbles

ReadTensors = Callable[[list[str]], dict[str, torch.Tensor]]  # HF names -> tensors as stored, on the device
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_PACK_ORDER[i] of its 8
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a word's 8 sits in nibble AWQ_UNPACK_ORDER[j]


def read_quantization_config(directory: pathlib.Path) -> Optional[dict[str, Any]]:
    with open(directory / "config.json", encoding="utf-8") as f:
        return json.load(f).get("quantization_config") or None


def checkpoint_method(config: Optional[dict[str, Any]], source: str) -> Optional[str]:
    """"fp8", "gptq" or "awq" for a supported quantization_config, None without one."""
    if config is None:
        return None
    method = config.get("quant_method")
    if method == "fp8":
        return "fp8"
    if method == "compressed-tensors":
        for name, group in (config.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if (weights.get("num_bits"), weights.get("type"), weights.get("strategy")) not in (
                (8, "float", "tensor"), (8, "float", "channel")
            ):
                raise ValueError(f"{source}: compressed-tensors group {name!r} quantises weights as {weights}; "
                                 "only 8-bit float weights per tensor or per channel are supported")
        return "fp8"
    if method in ("gptq", "awq"):
        if config.get("bits", 4) != 4:
            raise ValueError(f"{source}: {method} checkpoints of {config.get('bits')} bits are not supported (only 4)")
        if method == "awq" and config.get("version", "gemm").lower() != "gemm":
            raise ValueError(f"{source}: AWQ version {config.get('version')!r} is not supported (only 'gemm')")
        return method
    raise ValueError(f"{source}: quantization_config.quant_method {method!r} is not supported "
                     "(supported: fp8, compressed-tensors FP8, gptq, awq)")


def load_projection(read: ReadTensors, available: set[str], prefix: str, method: str,
                    config: dict[str, Any]) -> Fp8Weight | Int4Weight:
    """The projection `prefix` (e.g. "model.layers.0.self_attn.q_proj") of a pre-quantised checkpoint."""
    if method == "fp8":
        return _load_fp8(read, available, prefix, config)
    names = [f"{prefix}.{part}" for part in ("qweight", "qzeros", "scales") if method == "gptq" or part != "qzeros"
             or config.get("zero_point", True)]
    if method == "gptq" and f"{prefix}.g_idx" in available:
        names.append(f"{prefix}.g_idx")
    _require(names, available, prefix)
    tensors = read(names)
    get = lambda part: tensors.get(f"{prefix}.{part}")  # noqa: E731
    if method == "gptq":
        return unpack_gptq(get("qweight"), get("qzeros"), get("scales"), get("g_idx"), _group_size(config, get("scales")),
                           zeros_minus_one=config.get("checkpoint_format", "gptq") != "gptq_v2")
    return unpack_awq(get("qweight"), get("qzeros"), get("scales"), _group_size(config, get("scales")))


def _require(names: list[str], available: set[str], prefix: str) -> None:
    missing = [name for name in names if name not in available]
    if missing:
        raise ValueError(f"quantised checkpoint is missing {missing} for {prefix}")


def _group_size(config: dict[str, Any], scales: torch.Tensor) -> int:
    """quantization_config's group_size; -1 (one group per row) is K, i.e. K/G = 1."""
    group = int(config.get("group_size", 128))
    return group if group > 0 else 1 << 62


def _load_fp8(read: ReadTensors, available: set[str], prefix: str, config: dict[str, Any]) -> Fp8Weight:
    weight_name = f"{prefix}.weight"
    block_scale, scale = f"{prefix}.weight_scale_inv", f"{prefix}.weight_scale"
    scale_name = block_scale if block_scale in available else scale
    _require([weight_name, scale_name], available, prefix)
    tensors = read([weight_name, scale_name])
    weight, scales = tensors[weight_name], tensors[scale_name].float()
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{weight_name} is {weight.dtype}, but an FP8 checkpoint's weights must be {FP8_DTYPE}")
    n, k = weight.shape
    if scale_name == block_scale:
        block_n, block_k = config.get("weight_block_size") or (128, 128)
        expanded = scales.repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
        return quantize_fp8(weight.float() * expanded)
    if scales.numel() == 1:
        return Fp8Weight(weight, scales.reshape(1).expand(n).contiguous())
    if scales.numel() == n:
        return Fp8Weight(weight, scales.reshape(n).contiguous())
    raise ValueError(f"{scale_name} has shape {tuple(scales.shape)}: expected one scale or one per output channel ({n})")


def _unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: each word's eight 4-bit fields, lowest bits first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.to(torch.int32)[..., None] >> shifts) & 15).to(torch.uint8)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: Optional[torch.Tensor],
                group_size: int, zeros_minus_one: bool = True) -> Int4Weight:
    """GPTQ's tensors (module docstring) as an `Int4Weight`: act-order checkpoints get `perm`,
    the columns sorted by group, so each group of `group_size` columns is contiguous."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    codes = _unpack_words(qweight).permute(0, 2, 1).reshape(k, n).t()  # [N, K]
    zeros = _unpack_words(qzeros).reshape(qzeros.shape[0], n) + (1 if zeros_minus_one else 0)
    group_size = min(group_size, k)
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        in_order = torch.arange(k, device=g_idx.device) // group_size
        if not torch.equal(g_idx, in_order):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], in_order):
                raise ValueError(f"GPTQ g_idx does not put {group_size} columns in each group")
            codes = codes[:, perm]
    return Int4Weight(pack_nibbles(codes.contiguous()), scales.t().half().contiguous(), zeros.t().contiguous(), group_size, perm)


def unpack_awq(qweight: torch.Tensor, qzeros: Optional[torch.Tensor], scales: torch.Tensor, group_size: int) -> Int4Weight:
    """AutoAWQ's "gemm" tensors (module docstring) as an `Int4Weight`."""
    order = list(AWQ_UNPACK_ORDER)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    codes = _unpack_words(qweight)[..., order].reshape(k, n).t()
    zeros = None if qzeros is None else _unpack_words(qzeros)[..., order].reshape(qzeros.shape[0], n).t().contiguous()
    return Int4Weight(pack_nibbles(codes.contiguous()), scales.t().half().contiguous(), zeros, min(group_size, k))
