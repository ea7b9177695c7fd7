"""FP8 E4M3 weights with one scale per output channel (W8A16 kernels, W8A8 `torch._scaled_mm`).

Follows vLLM's dynamic FP8 scheme (`quantization="fp8"`, vllm/model_executor/layers/quantization/fp8.py):
weights are scaled per output channel so that each row's largest magnitude maps to E4M3's
largest finite value (448), then rounded; for prefill-sized products the activations are
quantised per token at run time and multiplied in FP8 by `torch._scaled_mm`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale
_ROWS_PER_CHUNK = 4096  # bounds the float32 copy made while quantising a large matrix


@dataclass
class Fp8Weight:
    """W ~= qweight * scales[:, None]: qweight float8_e4m3fn [N, K], scales float32 [N]."""

    qweight: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W in `dtype`, each element rounded once from its float32 value."""
        return (self.qweight.float() * self.scales[:, None]).to(dtype)

    @classmethod
    def cat(cls, parts: list["Fp8Weight"]) -> "Fp8Weight":
        """The weights stacked along N (fused q/k/v or gate/up); per-channel scales stack too."""
        return cls(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]))


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """Per-output-channel E4M3 quantisation of a [N, K] weight: scale = max|row| / 448."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_fp8 needs a 2-D weight, got shape {tuple(weight.shape)}")
    qweight = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        rows = weight[start : start + _ROWS_PER_CHUNK].float()
        scale = (rows.abs().amax(dim=1) / FP8_MAX).clamp(min=_MIN_SCALE)
        qweight[start : start + len(rows)] = (rows / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scales[start : start + len(rows)] = scale
    return Fp8Weight(qweight, scales)


def scaled_mm_applies(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """`torch._scaled_mm` with row-wise scales: CUDA, bf16 output, K and N multiples of 16."""
    n, k = weight.shape
    return x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and k % 16 == 0 and n % 16 == 0


def scaled_mm(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) in FP8 x FP8 (W8A8): x is quantised per token (row) at run time.

    No host sync: the activation scales stay on the device, so the call captures into CUDA graphs.
    """
    x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    x_fp8 = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    out = torch._scaled_mm(x_fp8, weight.qweight.t(), scale_a=x_scale, scale_b=weight.scales.view(1, -1), out_dtype=x.dtype)
    return out if bias is None else out + bias  # added apart: not every build takes a bias with row-wise scales
