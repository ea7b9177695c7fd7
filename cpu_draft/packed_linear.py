"""Linear layers whose weights oneDNN has reordered once, at load, into its blocked layout.

A plain ``F.linear`` on the CPU hands oneDNN a row-major weight every call, and for BF16
oneDNN re-lays it out (into AMX/VNNI tiles) on each call: at decode batch sizes that copy
costs as much as the matmul. ``torch.ops.mkldnn._reorder_linear_weight`` does it once and
``_linear_pointwise`` reads the packed weight directly (what inductor's CPU freezing
does). BF16 results are bit-identical to ``F.linear``; FP32 ones differ in summation order.
Where these ops are missing or refuse the dtype (`can_pack`), callers keep a plain ``nn.Linear``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


BATCH_SIZE_HINT = 8  # the decode batch oneDNN picks its blocking for; any batch size runs


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_SIZE_HINT)
        self.bias = bias
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs for ``dtype`` here (and matches F.linear on a probe)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(16, 32, generator=generator).to(dtype)
        x = torch.randn(3, 32, generator=generator).to(dtype)
        return torch.allclose(PackedLinear(weight, None)(x).float(), (x @ weight.T).float(), rtol=2e-2, atol=2e-2)
    except (RuntimeError, NotImplementedError):
        return False
