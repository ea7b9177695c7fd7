"""Linear layers whose weights oneDNN has reordered once, at load, into its blocked layout.

A plain ``F.linear`` on the CPU hands oneDNN a row-major weight every call, and for BF16
oneDNN re-lays it out (into AMX/VNNI tiles) on each call: at decode batch sizes that copy
costs as much as the matmul. ``torch.ops.mkldnn._reorder_linear_weight`` does it once and
``_linear_pointwise`` reads the packed weight directly (what inductor's CPU freezing
does). BF16 results are bit-identical to ``F.linear``; FP32 ones differ in summation order.
Where these ops are missing or refuse the dtype, the layer stays a plain ``nn.Linear``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from gpu_target.model import CausalLM

_PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))
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


def pack_model_linears(model: CausalLM, dtype: torch.dtype) -> bool:
    """Swap every decoder projection that is a plain nn.Linear for a PackedLinear, in place.

    Returns whether packing is available (False leaves the model as it was).
    """
    if not can_pack(dtype):
        return False
    for layer in model.layers:
        for block_name, proj_name in _PROJECTIONS:
            block = getattr(layer, block_name)
            linear = getattr(block, proj_name)
            if type(linear) is nn.Linear:
                setattr(block, proj_name, PackedLinear(linear.weight, linear.bias))
    return True


def packed_logits_head(model: CausalLM, dtype: torch.dtype) -> Optional[PackedLinear]:
    """A PackedLinear of the output projection (the tied embeddings or lm_head), or None if packing is unavailable."""
    if not can_pack(dtype):
        return None
    weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return PackedLinear(weight, None)
