"""Paged attention in Triton: decode, tree verification and causal chunks in one kernel.

Computes exactly what :func:`gpu_target.attention.reference_attention` computes, over the
same :class:`~gpu_target.attention.AttentionMetadata`.

Design, for memory-bound decode and verification on a large GPU:

* **GQA packing.** One program owns one KV head and a tile of ``BLOCK_Q`` new tokens of one
  sequence, and stacks all query heads of that KV head into the tile's rows
  (row = token * GROUP_PAD + head-in-group). Each K/V tile is loaded once and used by every
  query head that shares it, and decode's tiny M (one token × group) is padded to the
  16 rows ``tl.dot`` needs instead of to 16 per head.
* **Split-K (flash-decoding).** When there are too few (sequence, KV head, token tile)
  programs to fill the SMs, each program's KV range is cut into ``num_splits`` chunks run
  by separate programs; they write partial outputs with their log-sum-exp, and a second
  kernel merges them. With one split the first kernel writes the output directly.
* **Two loop phases.** KV tiles wholly inside the cached context need no mask; only the
  tiles that reach the new tokens evaluate the causal rule or the ancestor bitmask.
* **CUDA-graph safe.** Grid and buffer sizes depend only on tensor shapes and on the host
  integers ``max_query_len`` / ``max_seq_len`` (upper bounds the caller may bucket); every
  per-sequence quantity is read on the device. No host syncs, no ``.item()``.

The kernels also run under Triton's CPU interpreter (``TRITON_INTERPRET=1``), which is how
the tests check them on machines without a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from gpu_target.attention import AttentionMetadata

MAX_BLOCK_M = 128  # rows (tokens × heads of a group) per program
MIN_DOT_DIM = 16  # tl.dot needs every dimension >= 16
TARGET_PROGRAMS_PER_SM = 2
MIN_TOKENS_PER_SPLIT = 512  # of the length bound a graph is planned for; shorter splits cost more to merge than they save
MAX_SPLITS = 64


@dataclass(frozen=True)
class LaunchPlan:
    """Static launch parameters: a function of shapes and host upper bounds only."""

    block_q: int  # new tokens per program
    block_m: int  # rows per program: block_q * group_pad, at least 16
    block_n: int  # KV tokens per inner-loop tile
    num_splits: int  # KV-length splits per program; >1 adds the merge pass
    q_blocks_per_seq: int  # >0: program i serves sequence i // q_blocks_per_seq; 0: searched
    num_q_programs: int  # grid size along the token-tile axis
    num_warps: int


def plan_launch(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int,
) -> LaunchPlan:
    """Pick tile sizes, the token-tile grid and the number of KV splits.

    Two ways of mapping token-tile programs to sequences are both upper bounds on the
    tiles needed; the smaller grid wins. ``q_blocks_per_seq`` gives every sequence the same
    number of tiles (tight for decode and uniform trees); otherwise sequence b's tiles start
    at program ``query_start_loc[b] // block_q + b`` and programs binary-search for their
    sequence (tight for a long prefill chunk batched with decodes).
    """
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    block_q = min(triton.next_power_of_2(max(max_query_len, 1)), _max_block_q(num_heads, num_kv_heads))
    block_m = max(MIN_DOT_DIM, block_q * group_pad)
    block_n = 64 if head_dim <= 128 else 32
    q_blocks_per_seq = triton.cdiv(max(max_query_len, 1), block_q)
    uniform_grid = num_seqs * q_blocks_per_seq
    searched_grid = num_tokens // block_q + num_seqs
    if uniform_grid > searched_grid:
        q_blocks_per_seq, num_q_programs = 0, searched_grid
    else:
        num_q_programs = uniform_grid
    return LaunchPlan(
        block_q=block_q,
        block_m=block_m,
        block_n=block_n,
        num_splits=_choose_num_splits(num_q_programs * num_kv_heads, max_seq_len, num_sms),
        q_blocks_per_seq=q_blocks_per_seq,
        num_q_programs=num_q_programs,
        num_warps=4 if block_m <= 64 else 8,
    )


def _choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Enough splits to put TARGET_PROGRAMS_PER_SM programs on every SM, as a power of two
    (so few kernel variants get compiled), without splits shorter than MIN_TOKENS_PER_SPLIT."""
    if num_programs >= num_sms:
        return 1
    wanted = triton.cdiv(TARGET_PROGRAMS_PER_SM * num_sms, num_programs)
    useful = triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(wanted, useful, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    max_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    plan: Optional[LaunchPlan] = None,
) -> torch.Tensor:
    """Attention of the new tokens over the paged cache (K/V already written). [T, H, D].

    ``max_query_len`` / ``max_seq_len`` default to the metadata's and must bound the
    batch's real lengths; pass bucketed values to reuse one captured CUDA graph across
    steps. ``plan`` overrides :func:`plan_launch` (tests use it to force splits).
    Output rows beyond ``query_start_loc[-1]`` (token padding) are not computed.
    """
    _check_inputs(query, k_cache, v_cache, meta)
    T, H, D = query.shape
    _, block_size, KVH, _ = k_cache.shape
    B = meta.num_seqs
    if plan is None:
        plan = plan_launch(
            T,
            B,
            H,
            KVH,
            D,
            meta.max_query_len if max_query_len is None else max_query_len,
            meta.max_seq_len if max_seq_len is None else max_seq_len,
            num_sms(query.device),
        )
    out = torch.empty((T, H, D), dtype=query.dtype, device=query.device)
    if T == 0 or B == 0:
        return out
    split = plan.num_splits > 1
    if split:
        out_partial = torch.empty((plan.num_splits, T, H, D), dtype=torch.float32, device=query.device)
        lse_partial = torch.empty((plan.num_splits, T, H), dtype=torch.float32, device=query.device)
    else:  # never written with one split; float32 all the same, so both cases share a variant
        out_partial = lse_partial = torch.empty((1,), dtype=torch.float32, device=query.device)
    has_tree = meta.tree_mask is not None
    group = H // KVH
    _paged_attention_kernel[(plan.num_q_programs, KVH, plan.num_splits)](
        query,
        k_cache,
        v_cache,
        out,
        out_partial,
        lse_partial,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.tree_mask if has_tree else meta.slot_mapping,  # int64 like a tree mask; never read without a tree
        scale * math.log2(math.e),
        B,
        T,
        H,
        plan.num_splits,
        plan.q_blocks_per_seq,
        int(has_tree),
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=D,
        BLOCK_SIZE=block_size,
        BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=_interpreting() and query.dtype == torch.bfloat16,
        num_warps=plan.num_warps,
    )
    if split:
        _merge_splits_kernel[(T, H)](
            out_partial,
            lse_partial,
            out,
            T,
            H,
            plan.num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=D,
        )
    return out


def _max_block_q(num_heads: int, num_kv_heads: int) -> int:
    return max(1, MAX_BLOCK_M // triton.next_power_of_2(num_heads // num_kv_heads))


def tile_shapes(num_heads: int, num_kv_heads: int) -> list[int]:
    """Every ``block_q`` :func:`plan_launch` can choose for a model: each compiles a variant."""
    return [1 << i for i in range(_max_block_q(num_heads, num_kv_heads).bit_length())]


@torch.inference_mode()
def compile_variants(query_dtype: torch.dtype, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Compile every variant of the attention kernels before the first request; returns how many shapes ran.

    Decode and verification steps only meet the tile shapes their CUDA graphs were captured
    with, but a step that prefills next to decodes runs eagerly with the prompt's shape, and
    a first compile there stalls the whole batch for a second or more. Each shape runs once
    on a one-sequence batch that reads the cache's first blocks and writes nothing to it,
    with two KV splits so the merge kernel is built too.
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    shapes = tile_shapes(num_heads, num_kv_heads)
    for block_q in shapes:
        blocks = triton.cdiv(block_q, block_size)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, block_q], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([block_q], dtype=torch.int32, device=device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=device).unsqueeze(0),
            slot_mapping=torch.arange(block_q, dtype=torch.int64, device=device),
            tree_mask=None,
            max_query_len=block_q,
            max_seq_len=block_q,
            query_lens_host=[block_q],
            seq_lens_host=[block_q],
        )
        query = torch.zeros((block_q, num_heads, head_dim), dtype=query_dtype, device=device)
        plan = plan_launch(block_q, 1, num_heads, num_kv_heads, head_dim, block_q, block_q, num_sms(device))
        paged_attention(query, k_cache, v_cache, meta, 1.0, plan=dataclasses.replace(plan, num_splits=2))
    return len(shapes)


def _interpreting() -> bool:
    """Triton 3.9's interpreter multiplies bf16 bit patterns as integers in ``tl.dot``, so
    under it bf16 tiles are widened to fp32 first (exact: products accumulate in fp32 on the
    GPU too)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check_inputs(query, k_cache, v_cache, meta: AttentionMetadata) -> None:
    if query.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"query must be [T, H, D] and k_cache [blocks, block_size, KVH, D]; got {tuple(query.shape)}, {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache differ: {tuple(k_cache.shape)} {k_cache.dtype} vs {tuple(v_cache.shape)} {v_cache.dtype}")
    T, H, D = query.shape
    KVH = k_cache.shape[2]
    if k_cache.shape[3] != D:
        raise ValueError(f"head_dim of query ({D}) and k_cache ({k_cache.shape[3]}) differ")
    if H % KVH:
        raise ValueError(f"num_heads ({H}) must be a multiple of num_kv_heads ({KVH})")
    if D < MIN_DOT_DIM or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two >= {MIN_DOT_DIM}, got {D}")
    if query.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("query, k_cache and v_cache need a contiguous head_dim")
    if T != meta.num_tokens:
        raise ValueError(f"query has {T} tokens but the metadata {meta.num_tokens}")
    tensors = [meta.query_start_loc, meta.seq_lens, meta.block_tables, k_cache, v_cache]
    if meta.tree_mask is not None:
        if meta.tree_mask.dtype != torch.int64:
            raise ValueError(f"tree_mask must be int64, got {meta.tree_mask.dtype}")
        tensors.append(meta.tree_mask)
    for t in tensors:
        if t.device != query.device:
            raise ValueError(f"all attention inputs must be on {query.device}; found one on {t.device}")


@triton.jit
def _find_sequence(query_start_loc, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence b whose first tile program, query_start_loc[b] // BLOCK_Q + b, is
    at or before ``pid``. Those starts strictly increase, so the search is exact."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        starts_before = tl.load(query_start_loc + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(starts_before, mid, lo)
        hi = tl.where(starts_before, hi, mid - 1)
    return lo


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q,
    k_cache, v_cache, block_table_row, kv_head_offset_k, kv_head_offset_v,
    start, hi, ctx, q_new_index, bits,
    qk_scale_log2,
    stride_kb, stride_kt, stride_vb, stride_vt,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """One online-softmax step over KV storage indices [start, start + BLOCK_N).

    Rows with ancestor ``bits`` see the new tokens those bits name; rows without (causal
    rows, and every row of a batch without trees) follow the causal rule."""
    kv_pos = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = kv_pos < hi
    page = tl.load(block_table_row + kv_pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    in_page = (kv_pos % BLOCK_SIZE).to(tl.int64)
    k_ptrs = k_cache + page[None, :] * stride_kb + in_page[None, :] * stride_kt + kv_head_offset_k + offs_d[:, None]
    v_ptrs = v_cache + page[:, None] * stride_vb + in_page[:, None] * stride_vt + kv_head_offset_v + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=in_range[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    if DOT_IN_FP32:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
    s = s * qk_scale_log2
    if MASKED:
        new_j = kv_pos - ctx  # index among the new tokens; negative for cached ones
        sees_new = new_j[None, :] <= q_new_index[:, None]  # causal rule
        shift = tl.minimum(tl.maximum(new_j, 0), 63).to(tl.int64)
        in_tree = ((bits[:, None] >> shift[None, :]) & 1) != 0
        sees_new = tl.where(bits[:, None] != 0, in_tree, sees_new)
        visible = (new_j[None, :] < 0) | sees_new
        visible = visible & in_range[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(q.dtype)
    if DOT_IN_FP32:
        pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p, v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


# Only the tile shape (BLOCK_Q, BLOCK_M, BLOCK_N: `plan_launch`) picks a compiled variant,
# so `compile_variants` can build every variant a model will use before the first request.
# Whether the step splits KV, searches for its sequences or has trees is a runtime branch,
# and the integers that change from step to step (the block-table width too) are not
# specialised on: Triton would compile a variant per (value == 1, value % 16 == 0)
# combination, and a server's mixed prefill/decode steps hit new combinations for minutes,
# each a compile of a second or more in the middle of a step.
STEP_COUNTS = ("num_seqs", "num_tokens", "num_splits", "q_blocks_per_seq", "has_tree", "stride_bt")


@triton.jit(do_not_specialize=STEP_COUNTS)
def _paged_attention_kernel(
    query, k_cache, v_cache, out, out_partial, lse_partial,
    query_start_loc, seq_lens, block_tables, tree_mask,
    qk_scale_log2,
    num_seqs, num_tokens, num_heads, num_splits, q_blocks_per_seq, has_tree,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if q_blocks_per_seq == 0:
        seq = _find_sequence(query_start_loc, pid_q, num_seqs, BLOCK_Q)
        q_block = pid_q - (tl.load(query_start_loc + seq) // BLOCK_Q + seq)
    else:
        seq = pid_q // q_blocks_per_seq
        q_block = pid_q % q_blocks_per_seq
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    ctx = seq_len - q_len

    # Rows: new token (q_block * BLOCK_Q + row // GROUP_PAD) × query head (row % GROUP_PAD).
    rows = tl.arange(0, BLOCK_M)
    q_new_index = q_block * BLOCK_Q + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (rows // GROUP_PAD < BLOCK_Q) & (head_in_group < GROUP) & (q_new_index < q_len)
    token = (q_start + q_new_index).to(tl.int64)
    head = kv_head * GROUP + head_in_group
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        query + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    # Causal rows see at most up to the tile's last new token; tree rows may see any new one.
    causal_end = ctx + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)
    tree_rows = row_valid & (tl.full([BLOCK_M], has_tree, tl.int32) != 0)
    bits = tl.load(tree_mask + token, mask=tree_rows, other=0)
    any_tree_row = tl.max((bits != 0).to(tl.int32), 0) > 0
    kv_end = tl.where(any_tree_row, seq_len, causal_end)

    chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    unmasked_end = lo + tl.maximum(tl.minimum(ctx, hi) - lo, 0) // BLOCK_N * BLOCK_N

    block_table_row = block_tables + seq * stride_bt
    kv_head_offset_k = kv_head.to(tl.int64) * stride_kh
    kv_head_offset_v = kv_head.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache, v_cache, block_table_row, kv_head_offset_k, kv_head_offset_v,
            start, hi, ctx, q_new_index, bits, qk_scale_log2,
            stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, DOT_IN_FP32,
        )
    for start in range(unmasked_end, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache, v_cache, block_table_row, kv_head_offset_k, kv_head_offset_v,
            start, hi, ctx, q_new_index, bits, qk_scale_log2,
            stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, DOT_IN_FP32,
        )

    seen = l_i > 0
    result = acc / tl.where(seen, l_i, 1.0)[:, None]
    if num_splits > 1:
        row = (split * num_tokens + token) * num_heads + head
        tl.store(out_partial + row[:, None] * HEAD_DIM + offs_d[None, :], result, mask=row_valid[:, None])
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_partial + row, lse, mask=row_valid)
    else:
        tl.store(
            out + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            result.to(out.dtype.element_ty),
            mask=row_valid[:, None],
        )


@triton.jit(do_not_specialize=("num_tokens", "num_splits"))
def _merge_splits_kernel(
    out_partial, lse_partial, out,
    num_tokens, num_heads, num_splits,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
):
    """out[t, h] = Σ_s 2^(lse_s − lse) · out_s[t, h], lse = log2 Σ_s 2^lse_s (empty splits: −inf).

    A loop over the splits, not a tile of them, so one variant serves every split count."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    split_stride = num_tokens * num_heads
    row = token * num_heads + head
    m = tl.full([], float("-inf"), dtype=tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(lse_partial + s * split_stride + row))
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s in range(0, num_splits):
        weight = tl.exp2(tl.load(lse_partial + s * split_stride + row) - m)
        total += weight
        acc += weight * tl.load(out_partial + (s * split_stride + row) * HEAD_DIM + offs_d)
    result = acc / tl.where(total > 0, total, 1.0)
    tl.store(out + token * stride_ot + head * stride_oh + offs_d, result.to(out.dtype.element_ty))
