"""The quantised linear layer: (quantised weight, bias) and a forward that picks a kernel by rows.

- 1 row: `gemv.gemv` (CUDA, or Triton's interpreter in tests), W dequantised in registers
  (W8A16: a GEMV streams W and nothing else, so converting x would only add a kernel).
- 2..64 rows, 4-bit: `gemv.skinny_gemm`, the codes less zero points converted in registers
  and the group scales applied to the MMA's sums, tiles per shape from
  gpu_target/gemv_tiles.py. 4-bit weights whose K or group size is not a multiple of 8
  take the last path.
- 2..64 rows, FP8: the kernel gemv_tiles.py's `fp8_path` names for the shape and BLOCK_M,
  measured by `python -m bench.quant_gemv --write-tiles` (default: the Triton W8A8 GEMM,
  `fp8_gemm.w8a8_gemm`): "w8a16" (`gemv.skinny_gemm`), "w8a8" or "scaled_mm" (x quantised
  per token, then FP8 x FP8, as vLLM's fp8 runs every size). `w8a8_path` is the rule; the
  model's fused skinny kernels (W8A16) serve a projection only where it names none, and
  where it names one the model feeds the projection rows its norm or SiLU-and-mul kernel
  quantised already (gpu_target/fp8_activations.py, through `forward_fp8`).
- more rows, FP8 on CUDA in bf16: `fp8_gemm.scaled_mm` (W8A8, per-token activation scales).
- 65..128 rows, 4-bit, where the streaming kernels apply but for the row count (CUDA):
  `gemv.skinny_gemm` on each half of the rows (two passes over the codes still beat one
  dequantised copy of W: `bench.quant_gemv --rows 65,128,192`).
- more rows, 4-bit on CUDA: W dequantised whole by one Triton pass (`int4_dequant.dequantize`),
  then F.linear (cuBLAS), as vLLM runs AWQ's large batches.
- otherwise (the CPU): W dequantised to x's dtype by torch, then F.linear.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gpu_target import fp8_gemm, gemv, gemv_tiles, int4_dequant
from gpu_target.fp8_activations import Fp8Rows
from gpu_target.quantization import QuantizedWeight, fp8
from gpu_target.quantization.int4 import Int4Weight


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W held quantised (`Fp8Weight` or `Int4Weight`), b in the compute dtype.

    Built empty (the model is allocated on the meta device first) and given its weight by
    `load_weight`, so no full-precision copy of W is ever allocated.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.quantized: Optional[QuantizedWeight] = None

    def load_weight(self, weight: QuantizedWeight) -> None:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"quantised weight of shape {tuple(weight.shape)} does not fit a linear layer "
                f"[{self.out_features}, {self.in_features}]"
            )
        self.quantized = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.quantized
        if getattr(weight, "perm", None) is not None:  # act-order: gather x's columns into the stored order
            x, weight = x.index_select(-1, weight.perm), weight.in_stored_order()
        path = w8a8_path(x, weight)
        if path == "w8a8":
            return fp8_gemm.w8a8_gemm(x, weight, self.bias)
        if path == "scaled_mm":
            return fp8_gemm.scaled_mm(x, weight, self.bias)
        if gemv.streaming_applies(x, weight):
            return gemv.gemv(x, weight, self.bias) if x.shape[0] == 1 else gemv.skinny_gemm(x, weight, self.bias)
        if isinstance(weight, Int4Weight):  # more rows than the streaming kernels take; W in stored order
            # x[:1]: whether these rows, but for their count, are ones the streaming kernels take
            if x.shape[0] <= 2 * gemv.MAX_STREAMING_ROWS and gemv.streaming_applies(x[:1], weight):
                half = (x.shape[0] + 1) // 2
                return torch.cat([gemv.skinny_gemm(rows, weight, self.bias) for rows in (x[:half], x[half:])])
            return F.linear(x, int4_dequant.dequantize(weight, x.dtype), self.bias)
        return F.linear(x, weight.dequantize(x.dtype), self.bias)

    def forward_fp8(self, x: Fp8Rows, path: str) -> torch.Tensor:
        """x W^T (+ b) of rows quantised per token already, by `path`'s W8A8 kernel: what
        `forward` computes of the unquantised rows where `w8a8_path` names `path` for them."""
        if path == "w8a8":
            return fp8_gemm.w8a8_gemm_quantized(x.codes, x.scales, self.quantized, self.bias, x.dtype)
        if path == "scaled_mm":
            return fp8_gemm.scaled_mm_quantized(x.codes, x.scales, self.quantized, self.bias, x.dtype)
        raise ValueError(f"forward_fp8: {path!r} is no W8A8 path (w8a8, scaled_mm)")

    def extra_repr(self) -> str:
        kind = type(self.quantized).__name__ if self.quantized is not None else "empty"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kind}"


def w8a8_path(x: torch.Tensor, weight: QuantizedWeight) -> Optional[str]:
    """The W8A8 kernel x's rows take with this weight ("w8a8": the Triton FP8 GEMM,
    "scaled_mm": torch._scaled_mm), or None where W is dequantised instead (in registers by
    gpu_target/gemv.py's kernels, or whole): FP8 weights at 2..64 streaming rows take their
    shape's `gemv_tiles.fp8_path` ("scaled_mm" where torch's conditions hold), at more rows
    on CUDA in bf16 `scaled_mm`; one row, 4-bit weights and the CPU never."""
    if not isinstance(weight, fp8.Fp8Weight):
        return None
    if gemv.streaming_applies(x, weight):
        if x.shape[0] == 1:
            return None
        n, k = weight.shape
        path = gemv_tiles.fp8_path(n, k, gemv.skinny_block_m(x.shape[0]))
        if path == "scaled_mm" and not fp8_gemm.scaled_mm_applies(x, weight):
            return "w8a8"
        return None if path == "w8a16" else path
    return "scaled_mm" if fp8_gemm.scaled_mm_applies(x, weight) else None


PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def replace_projections(model: nn.Module) -> None:
    """Swap every decoder layer's projections for empty `QuantizedLinear`s (embeddings and
    lm_head stay in the compute dtype). Call on the meta-device model, before allocation."""
    for layer in model.layers:
        for block_name, proj_name in PROJECTIONS:
            block = getattr(layer, block_name)
            old = getattr(block, proj_name)
            replacement = QuantizedLinear(old.in_features, old.out_features, old.bias is not None)
            setattr(block, proj_name, replacement.to(old.weight.dtype))


def fuse_weights(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The parts stacked along N (q/k/v, gate/up), consuming them: each part's tensors are
    dropped once copied, so fusing a loaded model's projections needs memory for one layer's
    copy, not the model's."""
    if len(parts) == 1:
        return parts[0]
    fused = type(parts[0]).cat(parts)
    for part in parts:
        for field in dataclasses.fields(part):
            if isinstance(getattr(part, field.name), torch.Tensor) and field.name != "perm":
                setattr(part, field.name, None)
    return fused
