"""Batch-invariant GPU mode: a token's numbers bit-identical whatever else is in the batch.

The CPU mode (gpu_target/batch_invariant.py) runs the row-mixing ops one row at a time;
on the GPU that would cost a launch per row, so here every op that sums within a token
runs a kernel whose reduction order is fixed by the token alone (Thinking Machines,
"Defeating Nondeterminism in LLM Inference", 2025; vLLM's ``VLLM_BATCH_INVARIANT``):

* the decoder projections and the LM head: `invariant_matmul.invariant_linear`, one tile
  configuration for every M and no split-K (cuBLAS and gemv.py's dispatch choose by M);
* attention: `invariant_attention.invariant_paged_attention`, fixed split and tile sizes
  over the row's own visible keys, so a tree node verifies with the numbers plain decoding
  of the same token computes;
* RMSNorm, rotary with the KV write, SiLU-and-mul: fused_ops' Triton kernels as they are,
  one program per row (or per element) with tiles set by the hidden size only.

The projections are swapped for `InvariantLinear`s sharing the weights (the LM head is
one inside `compute_logits`), which also turns off model.py's fused GEMV epilogues (they apply only to its own `Linear`). Quantised
targets are refused (their kernels choose by M), and float32 ones (tl.dot would multiply
them in TF32).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from gpu_target.invariant_matmul import invariant_linear
from gpu_target.model import CausalLM, Linear


class InvariantLinear(nn.Module):
    """A projection through `invariant_linear`, holding the original projection's parameters."""

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter]):
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x.contiguous(), self.weight, self.bias)


def _swap(owner: nn.Module, name: str) -> None:
    projection = getattr(owner, name)
    if not isinstance(projection, Linear):
        raise ValueError(f"batch_invariant on the GPU needs full-precision projections; {name} is a "
                         f"{type(projection).__name__} (turn quantization off or batch_invariant off)")
    if projection.weight.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"batch_invariant on the GPU runs bfloat16 or float16 targets, not {projection.weight.dtype} "
                         f"(its GEMM would multiply float32 in TF32); pass dtype='bfloat16'")
    setattr(owner, name, InvariantLinear(projection.weight, projection.bias))


def _logits(head: InvariantLinear, hidden: torch.Tensor) -> torch.Tensor:
    """`CausalLM.compute_logits` through the head's `invariant_linear` (no reference back to the model)."""
    return head(hidden).float()


def make_batch_invariant_gpu(model: CausalLM) -> None:
    """Switch `model` (in place, no weight copies) to the batch-invariant projections and logits.

    Attention is the caller's attention function: pass `invariant_paged_attention`.
    """
    for layer in model.layers:
        _swap(layer.self_attn, "qkv_proj")
        _swap(layer.self_attn, "o_proj")
        _swap(layer.mlp, "gate_up_proj")
        _swap(layer.mlp, "down_proj")
    weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.compute_logits = functools.partial(_logits, InvariantLinear(weight, None))
