"""FP8 E4M3 weights with one scale per output channel.

Follows vLLM's dynamic FP8 scheme (`quantization="fp8"`, vllm/model_executor/layers/quantization/fp8.py):
weights are scaled per output channel so that each row's largest magnitude maps to E4M3's
largest finite value (448), then rounded. One row of x multiplies them dequantised in
registers (W8A16, gpu_target/gemv.py); more rows are quantised per token at run time and
multiplied in FP8 (W8A8, gpu_target/fp8_gemm.py), as vLLM does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale
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
        scale = (rows.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
        qweight[start : start + len(rows)] = (rows / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scales[start : start + len(rows)] = scale
    return Fp8Weight(qweight, scales)
