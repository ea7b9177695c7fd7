"""Batch-invariant CPU mode: every token's numbers independent of what else is in the batch.

With it, a token's K/V, hidden states and logits come out bit for bit the same whether
it is decoded alone (M=1), verified as a tree node among 63 others, or prefilled with
its prompt, so a speculative run leaves exactly the KV cache of a plain run (vLLM calls
the same idea ``VLLM_BATCH_INVARIANT``). Normal mode differs in the last bits because:

* MKL's GEMM rounds a row differently for different numbers of rows M, and even for
  different address alignments of the same row;
* torch splits elementwise work across threads at arbitrary element offsets, and its
  vectorised exp (inside SiLU) differs from the scalar one used for a split's tail, so
  with many threads a row's SiLU depends on where the row sits in the batch;
* the reference attention's softmax runs over a padded, masked key range whose length
  depends on the longest sequence of the batch.

So this mode runs every op that mixes numbers within a token one row at a time, on a
fresh (allocator-aligned) copy of the row: the linear layers, the whole MLP, the RMSNorms
and the logits. Attention gives each query row exactly the keys it may see, in storage
order, so its result is a function of those keys alone. What is left runs on whole
batches but is exact per element: the embedding gather, rotary (gathered tables,
correctly rounded multiplies and adds), the KV writes and copies.

This is the CPU mode; on CUDA the engine runs gpu_target/batch_invariant_gpu.py's kernels instead.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from gpu_target.attention import AttentionMetadata, gather_kv, visibility_mask
from gpu_target.model import CausalLM


def per_row(fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:
    """``fn(*inputs)`` computed one row at a time: row i of the result depends on row i only.

    `inputs` are row-aligned [T, ...] tensors; `fn` returns a tensor or a tuple of tensors,
    concatenated back along the rows. Each row is copied first, because a view's address
    alignment (and so MKL's rounding) depends on its row index.
    """
    num_rows = inputs[0].shape[0]
    if num_rows == 0:
        return fn(*inputs)
    results = [fn(*(x[i : i + 1].clone(memory_format=torch.contiguous_format) for x in inputs)) for i in range(num_rows)]
    if isinstance(results[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*results))
    return torch.cat(results)


def _run_per_row(owner: nn.Module, *method_names: str) -> None:
    """Rebind the instance's methods to run per row (parameters and names stay as they are)."""
    for name in method_names:
        setattr(owner, name, functools.partial(per_row, getattr(owner, name)))


def make_batch_invariant(model: CausalLM) -> None:
    """Switch `model` (in place, no weight copies) to row-at-a-time linears, MLPs, norms and logits.

    Attention is the caller's attention function: pass `batch_invariant_attention`.
    """
    for layer in model.layers:
        layer.fuse_fp8_quantization = False  # the norms and the MLP take and give model-dtype rows
        _run_per_row(layer.input_layernorm, "forward", "add_and_norm")
        _run_per_row(layer.post_attention_layernorm, "add_and_norm")
        _run_per_row(layer.self_attn.qkv_proj, "forward")
        _run_per_row(layer.self_attn.o_proj, "forward")
        _run_per_row(layer.mlp, "forward")  # gate_up, SiLU-and-mul and down together
    _run_per_row(model.norm, "add_and_norm")
    _run_per_row(model, "compute_logits")


def attend_one(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·Kᵀ·scale)·V of one token, in float32: query [H, D], keys/values [n, KVH, D] -> [H, D].

    The shapes depend only on n, so equal inputs give equal outputs whatever the batch.
    """
    num_heads, head_dim = query.shape
    q = query.to(torch.float32, copy=True).view(keys.shape[1], -1, head_dim)  # [KVH, group, D]
    scores = torch.matmul(q, keys.float().permute(1, 2, 0)) * scale  # [KVH, group, n]
    out = torch.matmul(scores.softmax(dim=-1), values.float().transpose(0, 1))
    return out.reshape(num_heads, head_dim).to(query.dtype)


def batch_invariant_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """`AttentionFn` where each query row attends over exactly its visible keys, alone. [T, H, D].

    Visibility (cached tokens, causal or tree rules) is `visibility_mask`'s; the keys are
    taken in storage order, so a tree node and the same token decoded plainly see the
    same keys in the same order.
    """
    keys = gather_kv(k_cache, meta)  # [B, S, KVH, D]
    values = gather_kv(v_cache, meta)
    visible = visibility_mask(meta, query.device)  # [B, max_q, S]
    rows, start = [], 0
    for b, q_len in enumerate(meta.query_lens_host):
        for i in range(q_len):
            seen = visible[b, i]
            rows.append(attend_one(query[start + i], keys[b, seen], values[b, seen], scale))
        start += q_len
    return torch.stack(rows) if rows else torch.empty_like(query)
