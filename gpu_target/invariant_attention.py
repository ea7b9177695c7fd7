"""Batch-invariant paged attention for the GPU batch-invariant mode.

A query row's result is a function of the keys it may see, in storage order, and nothing
else: not the batch's other sequences, not its own sequence's other new tokens, and not
whether it is a tree node or the same token decoded alone. Then, with the mode's GEMM
(gpu_target/invariant_matmul.py), a speculative step verifies each draft node with exactly
the numbers plain decoding computes for that token, and a request's tokens do not depend
on what else is batched.

The row's visible keys are numbered 0..n-1 (its *logical* keys): the cached context and,
of the new tokens, those before it (causal rows) or its ancestors by its tree mask (tree
rows). A tree node at depth d and the token decoded plainly after the same d accepted
tokens have the same logical keys. Everything the kernel sums is cut along logical indices
with fixed sizes, as Thinking Machines' "Defeating Nondeterminism in LLM Inference" (2025)
prescribes for attention (a fixed split *size*, not a fixed number of splits):

* a program owns one query row, one query head and one split of SPLIT logical keys; it
  runs an online softmax over TILE keys at a time, in fp32 (products and sums);
* a second kernel merges a row's splits in index order.

The number of splits of a row is ceil(n / SPLIT), a function of the row alone. The grid
has ceil(max_seq_len / SPLIT) split programs per row; those past a row's keys exit. Unlike
gpu_target/triton_attention.py, nothing is chosen from the batch's shape.

Like that kernel it reads every per-sequence quantity on the device (no host syncs), so
the calls capture into CUDA graphs, and it runs under Triton's CPU interpreter.
"""
from __future__ import annotations

import functools
import math

import torch

from gpu_target.attention import AttentionMetadata
from gpu_target.fused_ops import device_function, jit_device_functions

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = tl = None

TILE = 64  # logical keys per online-softmax step
SPLIT = 256  # logical keys per split (a multiple of TILE)
PARTIAL_BYTES = 256 << 20  # a launch's fp32 partial results stay below this; more rows take more launches


def invariant_paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """`AttentionFn`: attention of the new tokens over the paged cache (K/V already written). [T, H, D].

    Rows beyond ``query_start_loc[num_seqs]`` (token padding) are not computed.
    """
    T, H, D = query.shape
    _, block_size, KVH, _ = k_cache.shape
    if H % KVH or D & (D - 1) or query.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"invariant attention needs H % KVH == 0, a power-of-two head_dim, contiguous heads and caches; "
                         f"got query {tuple(query.shape)}, cache {tuple(k_cache.shape)}")
    out = torch.empty((T, H, D), dtype=query.dtype, device=query.device)
    if T == 0 or meta.num_seqs == 0:
        return out
    num_splits = triton.cdiv(max(meta.max_seq_len, 1), SPLIT)
    rows_per_launch = max(1, PARTIAL_BYTES // (num_splits * H * (D + 2) * 4))
    has_tree = meta.tree_mask is not None
    tree_mask = meta.tree_mask if has_tree else meta.slot_mapping  # int64 like a mask; never read without a tree
    for first in range(0, T, rows_per_launch):
        rows = min(rows_per_launch, T - first)
        acc = torch.empty((num_splits, rows, H, D), dtype=torch.float32, device=query.device)
        stats = torch.empty((num_splits, rows, H, 2), dtype=torch.float32, device=query.device)  # running max, sum
        common = (meta.query_start_loc, meta.seq_lens, tree_mask, first, meta.num_seqs, int(has_tree))
        _jit(_split_kernel, ("stride_bt",))[(rows, H, num_splits)](
            query, k_cache, v_cache, acc, stats, meta.block_tables, *common,
            scale * math.log2(math.e), rows, H,
            query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            meta.block_tables.stride(0),
            GROUP=H // KVH, HEAD_DIM=D, BLOCK_SIZE=block_size, TILE=TILE, SPLIT=SPLIT, num_warps=4,
        )
        _jit(_merge_kernel)[(rows, H)](
            acc, stats, out, *common, rows, H, out.stride(0), out.stride(1),
            HEAD_DIM=D, SPLIT=SPLIT, num_warps=4,
        )
    return out


# Step-to-step integers (the block-table width too) are not specialised on (see triton_attention.STEP_COUNTS).
STEP_COUNTS = ("first", "num_seqs", "has_tree", "rows")


@functools.lru_cache(maxsize=None)
def _jit(kernel, extra_counts=()):
    jit_device_functions()  # _row_keys, _select_bits
    return triton.jit(kernel, do_not_specialize=STEP_COUNTS + extra_counts)


@device_function
def _row_keys(query_start_loc, seq_lens, tree_mask, t, num_seqs, has_tree):
    """(valid, ctx, dense, n, bits) of token row t: whether it is a real token; its sequence's
    cached length; how many logical keys are its first storage indices (the context, and for
    a causal row the new tokens up to itself); its number of logical keys; its tree bits."""
    lo = tl.zeros((), tl.int32)
    hi = lo + num_seqs - 1
    while lo < hi:  # the last sequence whose first row is at or before t
        mid = (lo + hi + 1) // 2
        at_or_before = tl.load(query_start_loc + mid) <= t
        lo = tl.where(at_or_before, mid, lo)
        hi = tl.where(at_or_before, hi, mid - 1)
    q_start = tl.load(query_start_loc + lo)
    q_len = tl.load(query_start_loc + lo + 1) - q_start
    ctx = tl.load(seq_lens + lo) - q_len
    valid = t < tl.load(query_start_loc + num_seqs)
    bits = tl.load(tree_mask + t, mask=has_tree != 0, other=0).to(tl.int64)
    num_ancestors = tl.sum(((bits >> tl.arange(0, 64).to(tl.int64)) & 1).to(tl.int32), axis=0)
    dense = tl.where(bits == 0, ctx + t - q_start + 1, ctx)
    n = tl.where(bits == 0, dense, ctx + num_ancestors)
    return valid, lo, ctx, dense, n, bits


@device_function
def _select_bits(bits, r, TILE: tl.constexpr):
    """For each r of a [TILE] vector: the index of the r-th set bit of `bits` (0 where there is none)."""
    j = tl.arange(0, 64)  # a tree mask is one int64
    bit = ((bits >> j.to(tl.int64)) & 1).to(tl.int32)
    below = tl.cumsum(bit, axis=0) - bit  # set bits below j
    hit = (bit[None, :] == 1) & (below[None, :] == r[:, None])
    return tl.sum(tl.where(hit, j[None, :], 0), axis=1)


def _split_kernel(
    query, k_cache, v_cache, acc_out, stats_out, block_tables,
    query_start_loc, seq_lens, tree_mask, first, num_seqs, has_tree,
    qk_scale_log2, rows, num_heads,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
):
    """Online softmax of one (row, head) over logical keys [split * SPLIT, (split + 1) * SPLIT)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    t = first + row
    valid, seq, ctx, dense, n, bits = _row_keys(query_start_loc, seq_lens, tree_mask, t, num_seqs, has_tree)
    lo = split * SPLIT
    if valid & (lo < n):
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(query + t.to(tl.int64) * stride_qt + head * stride_qh + d).to(tl.float32)
        kv_head = (head // GROUP).to(tl.int64) * stride_kh
        table = block_tables + seq.to(tl.int64) * stride_bt
        m_i = tl.full((), float("-inf"), tl.float32)
        l_i = tl.zeros((), tl.float32)
        acc = tl.zeros((HEAD_DIM,), tl.float32)
        hi = tl.minimum(lo + SPLIT, n)
        for start in range(lo, hi, TILE):
            logical = start + tl.arange(0, TILE)
            in_range = logical < hi
            storage = logical
            if (start + TILE > dense) & (bits != 0):  # the tile reaches a tree row's ancestors, in storage order
                ancestor = _select_bits(bits, logical - dense, TILE)
                storage = tl.where(logical < dense, logical, ctx + ancestor)
            page = tl.load(table + storage // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
            slot = page * stride_kb + (storage % BLOCK_SIZE).to(tl.int64) * stride_kt + kv_head
            k = tl.load(k_cache + slot[:, None] + d[None, :], mask=in_range[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_cache + slot[:, None] + d[None, :], mask=in_range[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[None, :] * k, axis=1) * qk_scale_log2
            s = tl.where(in_range, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        at = (split * rows + row).to(tl.int64) * num_heads + head
        tl.store(acc_out + at * HEAD_DIM + d, acc)
        tl.store(stats_out + at * 2, m_i)
        tl.store(stats_out + at * 2 + 1, l_i)


def _merge_kernel(
    acc_in, stats_in, out,
    query_start_loc, seq_lens, tree_mask, first, num_seqs, has_tree,
    rows, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
):
    """A row's splits combined in index order: sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    t = first + row
    valid, seq, ctx, dense, n, bits = _row_keys(query_start_loc, seq_lens, tree_mask, t, num_seqs, has_tree)
    if valid:
        num_splits = tl.cdiv(n, SPLIT)
        d = tl.arange(0, HEAD_DIM)
        m = tl.full((), float("-inf"), tl.float32)
        for s in range(0, num_splits):
            m = tl.maximum(m, tl.load(stats_in + ((s * rows + row).to(tl.int64) * num_heads + head) * 2))
        numerator = tl.zeros((HEAD_DIM,), tl.float32)
        denominator = tl.zeros((), tl.float32)
        for s in range(0, num_splits):
            at = (s * rows + row).to(tl.int64) * num_heads + head
            weight = tl.exp2(tl.load(stats_in + at * 2) - m)
            numerator += weight * tl.load(acc_in + at * HEAD_DIM + d)
            denominator += weight * tl.load(stats_in + at * 2 + 1)
        result = numerator / denominator
        tl.store(out + t.to(tl.int64) * stride_ot + head * stride_oh + d, result.to(out.dtype.element_ty))
