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

* a split is SPLIT logical keys of one row and one KV head; its online softmax runs over
  TILE keys at a time for all GROUP query heads of that KV head together (GQA: each K/V
  tile is loaded once), the scores and P·V as ``tl.dot`` MMAs of SLOTS = max(MMA_ROWS, GROUP
  rounded up to a power of two) rows, so an element's sum is the same instruction sequence
  whatever the batch;
* a row with one split writes its output directly; a row with more combines its splits'
  (max, sum, unnormalised output) one after another in index order (`_combine`, the online
  softmax's rescaling once more): in registers when one program runs all of them (below),
  else from fp32 partial results written by each split's program, in a second kernel.

Row groups. The MMA's SLOTS rows hold ROWS = SLOTS / GROUP_SLOTS query rows (GROUP_SLOTS:
GROUP rounded up to a power of two): a decode row fills the first, and the rows of a
sequence with several new tokens (a speculative verification's chain or tree, a causal
chunk) fill them ROWS at a time from its first row (or a launch's), so a K/V tile is read
once for the group. A slot's numbers do not depend on its neighbours: an MMA row and a
row's max and sum are computed from that row alone, in a layout the same for every slot,
and each slot has its own mask, so a key it must not see scores -inf and adds p = 0 (no
change to its max; its product with a real V is a zero). The MMA keeps its shape (MMA_ROWS
is one constant, not chosen per batch), so grouping changes no instruction. Every slot
still walks its own logical tiles: where all of a tile's keys of the group's slots sit at
storage index = logical index (the context; a causal row's new tokens; a tree row's
ancestors 0, 1, 2, ... up to the first gap, as in a chain) the group shares one load and
one MMA per tile; a tree row whose tile reaches past a gap in its ancestors gathers that
tile's keys (storage order, as above) in a step of its own (the same MMA, only its slots
updated), at most a tile or two per row.

The number of splits of a row is ceil(n / SPLIT), a function of the row alone. Which
program computes a split does not change its numbers, so the grid is sized for the GPU:
``workers`` programs per (row group, KV head), worker w taking splits w, w + workers, ...;
a batch that fills the SMs has one worker per group, writes no partial results, and
max_seq_len only bounds its loop.
Unlike gpu_target/triton_attention.py, nothing the sums depend on is chosen from the batch.

Like that kernel it reads every per-sequence quantity on the device (no host syncs), so
the calls capture into CUDA graphs, and it runs under Triton's CPU interpreter, where
(as in invariant_matmul.py) the MMAs become exact fp32 products summed per element.
"""
from __future__ import annotations

import functools
import math

import torch

from gpu_target import gemv
from gpu_target.attention import AttentionMetadata
from gpu_target.fused_ops import device_function, jit_device_functions

try:
    import triton
    import triton.language as tl

    from gpu_target.triton_attention import num_sms
except ImportError:  # CPU-only installs
    triton = tl = None

TILE = 64  # logical keys per online-softmax step
SPLIT = 256  # logical keys per split (a multiple of TILE)
MIN_DOT_ROWS = 16  # tl.dot's smallest M
MMA_ROWS = 16  # the MMAs' slots (at least GROUP_SLOTS): one shape for every program, whatever the batch; more
#               put more rows of a sequence in a program, for more MMA work on a decode row's padding slots
PROGRAMS_PER_SM = 2  # split programs wanted per SM before rows stop taking more than one worker
PARTIAL_BYTES = 256 << 20  # a launch's fp32 partial results (several workers) stay below this; more rows, more launches


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
    if H % KVH or D & (D - 1) or D < MIN_DOT_ROWS or query.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"invariant attention needs H % KVH == 0, a power-of-two head_dim >= {MIN_DOT_ROWS}, contiguous heads "
                         f"and caches; got query {tuple(query.shape)}, cache {tuple(k_cache.shape)}")
    out = torch.empty((T, H, D), dtype=query.dtype, device=query.device)
    if T == 0 or meta.num_seqs == 0:
        return out
    group = H // KVH
    group_slots = triton.next_power_of_2(group)
    slots = max(MMA_ROWS, group_slots)  # the interpreter's too: it runs the padding slots
    rows_per_program = slots // group_slots
    num_splits = triton.cdiv(max(meta.max_seq_len, 1), SPLIT)
    workers = split_workers(row_groups(T, rows_per_program, meta.num_seqs) * KVH, num_splits, num_sms(query.device))
    partials = workers > 1 and num_splits > 1  # else every row is combined in registers
    rows_per_launch = max(1, PARTIAL_BYTES // (num_splits * H * (D + 2) * 4)) if partials else T
    has_tree = meta.tree_mask is not None
    tree_mask = meta.tree_mask if has_tree else meta.slot_mapping  # int64 like a mask; never read without a tree
    for first in range(0, T, rows_per_launch):
        rows = min(rows_per_launch, T - first)
        if partials:
            acc = torch.empty((num_splits, rows, H, D), dtype=torch.float32, device=query.device)
            stats = torch.empty((num_splits, rows, H, 2), dtype=torch.float32, device=query.device)  # max, sum
        else:
            acc = stats = torch.empty((1,), dtype=torch.float32, device=query.device)
        common = (meta.query_start_loc, meta.seq_lens, tree_mask, first, meta.num_seqs, int(has_tree))
        _jit(_split_kernel, ("stride_bt",))[(row_groups(rows, rows_per_program, meta.num_seqs), KVH, workers)](
            query, k_cache, v_cache, out, acc, stats, meta.block_tables, *common,
            scale * math.log2(math.e), rows, H, workers,
            query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            meta.block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, GROUP_SLOTS=group_slots, SLOTS=slots, ROWS=rows_per_program,
            HEAD_DIM=D, BLOCK_SIZE=block_size, TILE=TILE, SPLIT=SPLIT,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", DOT_IN_FP32=gemv._interpreting(),
            num_warps=4,
        )
        if partials:
            _jit(_merge_kernel)[(rows, KVH)](
                acc, stats, out, *common, rows, H, out.stride(0), out.stride(1),
                GROUP=group, GROUP_PAD=max(MIN_DOT_ROWS, group_slots), HEAD_DIM=D, SPLIT=SPLIT, num_warps=4,
            )
    return out


def row_groups(rows: int, rows_per_group: int, num_seqs: int) -> int:
    """A bound on the row groups of a launch of `rows` rows (its grid): a sequence's rows make
    ceil(its rows / rows_per_group) groups, one more for the sequence cut by the launch's start."""
    return min(rows, triton.cdiv(rows, rows_per_group) + num_seqs + 1)


def split_workers(programs: int, num_splits: int, sms: int) -> int:
    """Programs per (row group, KV head): enough that `programs` of them put PROGRAMS_PER_SM on
    every SM, at most one per split. It changes which program runs a split, never its numbers."""
    return max(1, min(num_splits, triton.cdiv(PROGRAMS_PER_SM * sms, programs)))


# Step-to-step integers (the block-table width too) are not specialised on (see triton_attention.STEP_COUNTS).
STEP_COUNTS = ("first", "num_seqs", "has_tree", "rows", "workers")


@functools.lru_cache(maxsize=None)
def _jit(kernel, extra_counts=()):
    jit_device_functions()  # _group_start, _row_sequence, _spans, _select_bits, _attend_tile, _combine
    return triton.jit(kernel, do_not_specialize=STEP_COUNTS + extra_counts)


@device_function
def _row_sequence(query_start_loc, seq_lens, t, num_seqs):
    """(valid, seq, q_start, q_end, ctx) of token row t: whether it is a real token; its
    sequence; the sequence's first and end rows; its cached length."""
    # The last sequence whose first row is at or before t: the starts do not decrease, so it
    # is their count at or before t, less one; counted 64 starts per load, not by a binary
    # search's chain of dependent loads.
    seq = tl.zeros((), tl.int32) - 1
    for base in range(0, num_seqs, 64):
        index = base + tl.arange(0, 64)
        starts = tl.load(query_start_loc + index, mask=index < num_seqs, other=2**31 - 1)
        seq += tl.sum((starts <= t).to(tl.int32), axis=0)
    q_start = tl.load(query_start_loc + seq)
    q_end = tl.load(query_start_loc + seq + 1)
    ctx = tl.load(seq_lens + seq) - (q_end - q_start)
    valid = t < tl.load(query_start_loc + num_seqs)
    return valid, seq, q_start, q_end, ctx


@device_function
def _group_start(query_start_loc, seq_lens, g, first, rows, num_seqs, ROWS: tl.constexpr):
    """(valid, seq, t, q_start, q_end, ctx) of the launch's row group g: whether it exists; its
    sequence; its first token row; the sequence's first and end rows and cached length. A
    sequence's rows in the launch (rows first..first+rows-1) form groups of ROWS from its first
    row, the first group starting at the launch's first row where the sequence began before."""
    # Groups counted per sequence, 64 sequences per load; g's sequence is the first whose
    # running count passes g (as in `_row_sequence`).
    seq = tl.zeros((), tl.int32)
    before = tl.zeros((), tl.int32)  # groups of the sequences before g's
    total = tl.zeros((), tl.int32)
    for base in range(0, num_seqs, 64):
        index = base + tl.arange(0, 64)
        real = index < num_seqs
        starts = tl.load(query_start_loc + index, mask=real, other=0)
        ends = tl.load(query_start_loc + index + 1, mask=real, other=0)
        lo = tl.maximum(starts, first)
        hi = tl.minimum(ends, first + rows)
        count = tl.where(real & (lo < hi), 1 + (hi - 1 - starts) // ROWS - (lo - starts) // ROWS, 0)
        running = total + tl.cumsum(count, axis=0)
        passed = running <= g
        seq += tl.sum(passed.to(tl.int32), axis=0)
        before = tl.maximum(before, tl.max(tl.where(passed, running, 0), axis=0))
        total += tl.sum(count, axis=0)
    valid = g < total
    seq = tl.minimum(seq, num_seqs - 1)
    q_start = tl.load(query_start_loc + seq)
    q_end = tl.load(query_start_loc + seq + 1)
    lo = tl.maximum(q_start, first)
    index = g - before  # of the group within its sequence's rows in the launch
    t = tl.where(index == 0, lo, q_start + ((lo - q_start) // ROWS + index) * ROWS)
    ctx = tl.load(seq_lens + seq) - (q_end - q_start)
    return valid, seq, t, q_start, q_end, ctx


@device_function
def _spans(tree_mask, rows, q_start, ctx, has_tree):
    """For a vector of a sequence's token rows: (dense, n, plain, bits) of each. dense: how
    many logical keys are its first storage indices (the context, and for a causal row the new
    tokens up to itself); n: its number of logical keys; plain: how many of them sit at their
    own storage index (for a tree row, the context and the ancestors that are new tokens
    0, 1, 2, ... without a gap, as in a chain); bits: its tree bits."""
    bits = tl.load(tree_mask + rows, mask=rows * 0 + has_tree != 0, other=0).to(tl.int64)
    j = tl.arange(0, 64)  # a tree mask is one int64
    bit = ((bits[:, None] >> j[None, :].to(tl.int64)) & 1).to(tl.int32)
    num_ancestors = tl.sum(bit, axis=1)
    leading_ancestors = tl.min(tl.where(bit == 0, j[None, :], 64), axis=1)  # new tokens 0.. before the first gap
    dense = tl.where(bits == 0, ctx + rows - q_start + 1, ctx)
    n = tl.where(bits == 0, dense, ctx + num_ancestors)
    plain = tl.where(bits == 0, n, ctx + leading_ancestors)
    return dense, n, plain, bits


@device_function
def _select_bits(bits, r, TILE: tl.constexpr):
    """For each r of a [TILE] vector: the index of the r-th set bit of `bits` (0 where there is none)."""
    j = tl.arange(0, 64)  # a tree mask is one int64
    bit = ((bits >> j.to(tl.int64)) & 1).to(tl.int32)
    below = tl.cumsum(bit, axis=0) - bit  # set bits below j
    hit = (bit[None, :] == 1) & (below[None, :] == r[:, None])
    return tl.sum(tl.where(hit, j[None, :], 0), axis=1)


def _split_kernel(
    query, k_cache, v_cache, out, acc_out, stats_out, block_tables,
    query_start_loc, seq_lens, tree_mask, first, num_seqs, has_tree,
    qk_scale_log2, rows, num_heads, workers,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_SLOTS: tl.constexpr, SLOTS: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """Online softmax of a row group's query heads of one KV head over each of its splits
    w, w + workers, ... (logical keys [split * SPLIT, (split + 1) * SPLIT)). Slot
    i * GROUP_SLOTS + h of the MMAs holds query head h of the group's row i."""
    kv_head = tl.program_id(1)
    worker = tl.program_id(2)
    valid, seq, t, q_start, q_end, ctx = _group_start(query_start_loc, seq_lens, tl.program_id(0), first, rows, num_seqs, ROWS)
    if valid:
        group_rows = tl.minimum(ROWS - (t - q_start) % ROWS, tl.minimum(q_end, first + rows) - t)
        slot = tl.arange(0, SLOTS)
        in_row = slot // GROUP_SLOTS
        head = kv_head * GROUP + slot % GROUP_SLOTS
        real = (slot % GROUP_SLOTS < GROUP) & (in_row < group_rows)
        token = t + tl.where(in_row < group_rows, in_row, 0)  # padding rows repeat the first (never stored)
        dense, n, plain, bits = _spans(tree_mask, token, q_start, ctx, has_tree)
        n_max = tl.max(n, axis=0)
        num_splits = tl.cdiv(n_max, SPLIT)
        row_splits = tl.cdiv(n, SPLIT)
        if worker < num_splits:
            d = tl.arange(0, HEAD_DIM)
            q = tl.load(query + token[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                        mask=real[:, None], other=0.0)
            kv_offset = kv_head.to(tl.int64) * stride_kh
            table = block_tables + seq.to(tl.int64) * stride_bt
            out_rows = out + token[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
            m_row = tl.full((SLOTS,), float("-inf"), tl.float32)  # splits 0..s combined (one worker)
            l_row = tl.zeros((SLOTS,), tl.float32)
            acc_row = tl.zeros((SLOTS, HEAD_DIM), tl.float32)
            for split in range(worker, num_splits, workers):
                lo = split * SPLIT
                hi = tl.minimum(lo + SPLIT, n_max)
                m_i = tl.full((SLOTS,), float("-inf"), tl.float32)
                l_i = tl.zeros((SLOTS,), tl.float32)
                acc = tl.zeros((SLOTS, HEAD_DIM), tl.float32)
                for start in range(lo, hi, TILE):
                    logical = start + tl.arange(0, TILE)
                    visible = logical[None, :] < n[:, None]
                    active = start < n
                    shared = active & (tl.minimum(start + TILE, n) <= plain)  # this tile's keys at logical = storage
                    gathered = active & ~shared  # tree rows whose tile reaches past a gap in their ancestors
                    # Pass 0: the shared slots; pass 1 + i: row i's gathered slots. One call site,
                    # so every slot runs the one inlined copy of _attend_tile.
                    passes = 1 + ROWS * (tl.max(gathered.to(tl.int32), axis=0) > 0).to(tl.int32)
                    for step in range(0, passes):
                        storage = logical
                        loaded = logical < hi
                        update = shared
                        if step > 0:
                            first_slot = slot == (step - 1) * GROUP_SLOTS
                            bits_i = tl.sum(tl.where(first_slot, bits, 0), axis=0)
                            dense_i = tl.sum(tl.where(first_slot, dense, 0), axis=0)
                            ancestor = _select_bits(bits_i, logical - dense_i, TILE)
                            storage = tl.where(logical < dense_i, logical, ctx + ancestor)
                            loaded = logical < tl.sum(tl.where(first_slot, n, 0), axis=0)
                            update = gathered & (in_row == step - 1)
                        if tl.max(update.to(tl.int32), axis=0) > 0:
                            acc, m_i, l_i = _attend_tile(
                                acc, m_i, l_i, q, k_cache, v_cache, table, kv_offset, storage, loaded, visible, update,
                                qk_scale_log2, stride_kb, stride_kt, HEAD_DIM, BLOCK_SIZE, TILE, DOT_PRECISION, DOT_IN_FP32,
                            )
                has_split = lo < n
                if workers == 1:
                    m_c, l_c, acc_c = _combine(m_row, l_row, acc_row, m_i, l_i, acc)
                    alone = row_splits == 1  # its one split is its result
                    m_row = tl.where(has_split, tl.where(alone, m_i, m_c), m_row)
                    l_row = tl.where(has_split, tl.where(alone, l_i, l_c), l_row)
                    acc_row = tl.where(has_split[:, None], tl.where(alone[:, None], acc, acc_c), acc_row)
                else:
                    done = real & has_split & (row_splits == 1)
                    l_done = tl.where(done, l_i, 1.0)  # the others have no keys in this split
                    tl.store(out_rows, (acc / l_done[:, None]).to(out.dtype.element_ty), mask=done[:, None])
                    partial = real & has_split & (row_splits > 1)
                    at = (split * rows + token - first).to(tl.int64) * num_heads + head
                    tl.store(acc_out + at[:, None] * HEAD_DIM + d[None, :], acc, mask=partial[:, None])
                    tl.store(stats_out + at * 2, m_i, mask=partial)
                    tl.store(stats_out + at * 2 + 1, l_i, mask=partial)
            if workers == 1:
                tl.store(out_rows, (acc_row / l_row[:, None]).to(out.dtype.element_ty), mask=real[:, None])


@device_function
def _attend_tile(
    acc, m_i, l_i, q, k_cache, v_cache, table, kv_offset, storage, loaded, visible, update,
    qk_scale_log2, stride_kb, stride_kt,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """One online-softmax step of the slots `update` over a tile of TILE keys at `storage`
    (those not `loaded` read as zeros): each slot sees its `visible` ones; the other slots
    keep their state as it was."""
    d = tl.arange(0, HEAD_DIM)
    page = tl.load(table + storage // BLOCK_SIZE, mask=loaded, other=0).to(tl.int64)
    slot = page * stride_kb + (storage % BLOCK_SIZE).to(tl.int64) * stride_kt + kv_offset
    k = tl.load(k_cache + slot[None, :] + d[:, None], mask=loaded[None, :], other=0.0).to(q.dtype)  # [D, TILE]
    v = tl.load(v_cache + slot[:, None] + d[None, :], mask=loaded[:, None], other=0.0).to(q.dtype)  # [TILE, D]
    if DOT_IN_FP32:  # Triton's interpreter: exact products, summed per element (see module docstring)
        s = tl.sum(q.to(tl.float32)[:, :, None] * k.to(tl.float32)[None, :, :], axis=1)
    else:
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
    s = tl.where(visible, s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_new = tl.where(update, m_new, 0.0)  # a slot it updates sees a key here; the others would be -inf - -inf
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(q.dtype)  # as flash attention's P·V: P in the inputs' precision, fp32 accumulation
    if DOT_IN_FP32:
        pv = tl.sum(p.to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    else:
        pv = tl.dot(p, v, input_precision=DOT_PRECISION)
    acc_new = acc * alpha[:, None] + pv
    return tl.where(update[:, None], acc_new, acc), tl.where(update, m_new, m_i), tl.where(update, l_new, l_i)


def _merge_kernel(
    acc_in, stats_in, out,
    query_start_loc, seq_lens, tree_mask, first, num_seqs, has_tree,
    rows, num_heads, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
):
    """A row's splits, computed by several worker programs, combined in index order for a KV
    head's query heads together, as one worker combines them in registers. Rows with one
    split wrote their output already."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    t = first + row
    valid, seq, q_start, q_end, ctx = _row_sequence(query_start_loc, seq_lens, t, num_seqs)
    _, n, _, _ = _spans(tree_mask, t + tl.zeros((GROUP_PAD,), tl.int32), q_start, ctx, has_tree)
    num_splits = tl.cdiv(tl.max(n, axis=0), SPLIT)
    if valid & (num_splits > 1):
        d = tl.arange(0, HEAD_DIM)
        in_group = tl.arange(0, GROUP_PAD)
        head = kv_head * GROUP + in_group
        real = in_group < GROUP
        m_row = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_row = tl.zeros((GROUP_PAD,), tl.float32)
        acc_row = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        for s in range(0, num_splits):
            at = (s * rows + row).to(tl.int64) * num_heads + head
            m_s = tl.load(stats_in + at * 2, mask=real, other=0.0)
            l_s = tl.load(stats_in + at * 2 + 1, mask=real, other=1.0)
            acc_s = tl.load(acc_in + at[:, None] * HEAD_DIM + d[None, :], mask=real[:, None], other=0.0)
            m_row, l_row, acc_row = _combine(m_row, l_row, acc_row, m_s, l_s, acc_s)
        tl.store(out + t.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
                 (acc_row / l_row[:, None]).to(out.dtype.element_ty), mask=real[:, None])


@device_function
def _combine(m, l, acc, m_s, l_s, acc_s):
    """Splits 0..s-1's running max, sum and unnormalised output (m = -inf before the first)
    with split s's: both rescaled to their larger max and added."""
    m_new = tl.maximum(m, m_s)
    before = tl.exp2(m - m_new)
    this = tl.exp2(m_s - m_new)
    return m_new, l * before + l_s * this, acc * before[:, None] + acc_s * this[:, None]
