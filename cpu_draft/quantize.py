"""INT8 weight-only linear layers for the draft model (activations stay BF16/FP32).

Weights are quantised per output channel (symmetric, scale = max|w| / 127). On CPU the
matmul runs in ``torch._weight_int8pack_mm`` (oneDNN/AVX-512 VNNI kernels that read the
int8 weights directly), which halves or quarters the bytes a memory-bound decode step
streams; where that op is missing the weights are dequantised on the fly.
The model definition is untouched: only its projection modules are swapped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_target.model import CausalLM

_PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight [N, K] and float32 scales [N] with weight ~= q * scales[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype):
        super().__init__()
        q, scales = quantize_per_channel(linear.weight.data)
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scales.to(compute_dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_kernel = _has_int8pack_mm(q.device, compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.packed_kernel:
            out = torch._weight_int8pack_mm(flat, self.qweight, self.scales.to(flat.dtype))
        else:
            out = F.linear(flat, self.qweight.to(flat.dtype) * self.scales.to(flat.dtype)[:, None])
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_model_int8(model: CausalLM, compute_dtype: torch.dtype) -> CausalLM:
    """Swap every decoder projection for an Int8Linear in place; embeddings and lm_head stay as they are."""
    for layer in model.layers:
        for block_name, proj_name in _PROJECTIONS:
            block = getattr(layer, block_name)
            setattr(block, proj_name, Int8Linear(getattr(block, proj_name), compute_dtype))
    return model


def _has_int8pack_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_weight_int8pack_mm"):
        return False
    try:
        x = torch.zeros(1, 64, dtype=dtype, device=device)
        torch._weight_int8pack_mm(x, torch.zeros(8, 64, dtype=torch.int8, device=device), torch.ones(8, dtype=dtype, device=device))
        return True
    except (RuntimeError, NotImplementedError):
        return False
