"""Weight-streaming linear layers at small M: y = x W^T (+ b) for 1..64 rows of x.

At batch-1 decode (M = 1) and batch-1 tree verification (M = 1 + a few tree nodes) every
projection is bound by reading W once. cuBLAS picks split-K GEMM kernels for these shapes
that stream W at 2.4-2.7 TB/s on an H100 and add a reduction kernel per call; kernels
whose programs each own a few output columns (rows of W) and stream them whole over K
need no reduction and keep more loads in flight.

- M = 1: `gemv`. Each program accumulates a [BLOCK_N, BLOCK_K] tile of fp32 products and
  reduces it once at the end, so the inner loop is loads and FMAs only.
- 2 <= M <= 64: `skinny_gemm`. Each program streams its BLOCK_N rows of W once and, per
  K tile, multiplies them with `tl.dot` against the whole x tile ([M padded to BLOCK_M,
  BLOCK_K], small and read from L2), accumulating in fp32.
- larger M, CPU tensors, other dtypes: F.linear.

At M = 1 the two projections that an elementwise op follows take that op into their
epilogue, so a layer's batch-1 decode step runs 8 kernels instead of 10 (norm, qkv +
rotary + KV write, attention and its split merge, o_proj, norm, gate_up + SiLU-and-mul,
down): `gemv_rotary_and_store_kv` and `gemv_silu_and_mul`. The two ops' own kernels took
~0.16 ms of a ~5.9 ms Llama-3-8B step on an H100, plus a gap each in the CUDA graph. Each
fused program streams the W rows whose outputs the op combines, as pairs (the GEMV's
BLOCK_N rows a program: two for bf16), summed by the GEMV's own code on the same tile, rounds them as the GEMV
stores them and applies the op through the device functions its fused_ops kernel uses:
the results are meant to be bit-identical to the unfused kernels', and the tests check
that they are. gpu_target/model.py picks them for one row where `streaming_applies`.

The skinny GEMM does the same for tree verification: `skinny_gemm_rotary_and_store_kv`
and `skinny_gemm_silu_and_mul` keep its programs, tile (`streaming_tile` of the whole
matrix), bytes and K loop (`_skinny_rows`), and gather each program's BLOCK_N W rows as
BLOCK_N/2 pairs (gate row j and up row I + j; dimension d and d + D/2 of one head, so
BLOCK_N/2 must divide D/2: `rotary_fits`), the pairs' first rows in the tile's first half
and their partners in the second, as the fused GEMVs do (pairs interleaved row by row
streamed slower: `bench.fused_epilogues`). The rounded [BLOCK_M, BLOCK_N] result then
splits into its halves in registers. The model takes them wherever the
plain path would call `skinny_gemm` for that projection (`skinny_wins`), and the separate
kernels elsewhere.

Every kernel also streams quantised weights (gpu_target/quantization: `Fp8Weight`, `Int4Weight`),
chosen by the constexpr W_FORMAT, so the fused epilogues serve quantised targets unchanged
(`weight_arguments` passes either kind). The GEMV converts W straight to fp32 (FP8: E4M3 ->
f16 -> f32, packed conversions; the row's scale multiplies its sum once, after the K loop)
and reads x in W's tile shape, so both load in one layout. 4-bit W is read as int32 words
of eight codes, a group of K at a time, with three instructions a code and the group's scale
and zero point once a word (`_int4_gemv_sums`); as its x work is per thread and column,
its tiles give each thread several rows and split K (`split_k`: each share's sums in fp32,
added in share order by the last program of the row tile, which also runs the fused
epilogue, `_split_sum`) where rows alone leave too few programs. The skinny GEMMs'
`_weight_tile` gives `tl.dot` W in x's dtype; a 4-bit W's K tiles lie in one group, and
`_int4_codes_tile` gives it the codes less their zero points, exact small integers, whose
fp32 sums take the group's scale after the MMA (as Marlin applies it). Quantised W
streams fewer bytes a row than bf16, so its kernels take their tiles per shape from
gpu_target/gemv_tiles.py (a table the GPU sweep writes, else a heuristic): more rows a
program, so each program streams tens of KB (`streaming_tile`).

`linear` is the entry point for a plain projection and dispatches on M. Results are
rounded to the input dtype, as cuBLAS rounds its fp32 accumulator. Nothing in the
dispatch syncs with the device, so the calls capture into CUDA graphs (each M compiles
its own BLOCK_M once, on the warm-up run before capture).
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from gpu_target import fused_ops, gemv_tiles
from gpu_target.fused_ops import device_function
from gpu_target.quantization.fp8 import Fp8Weight
from gpu_target.quantization.int4 import Int4Weight

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = tl = None

STREAMING_DTYPES = (torch.bfloat16, torch.float16)
PLAIN, FP8, INT4 = 0, 1, 2  # W_FORMAT: W in x's dtype, FP8 E4M3 codes + row scales, 4-bit codes + group scales
StreamedWeight = Union[torch.Tensor, Fp8Weight, Int4Weight]
MAX_STREAMING_ROWS = 64  # above this many rows, cuBLAS's tiled GEMMs win: W is reused enough


def _interpreting() -> bool:
    """Under Triton's interpreter the skinny GEMMs (``DOT_IN_FP32``) widen their tiles to fp32
    and sum the exact products per output element instead of calling ``tl.dot``: Triton 3.9's
    interpreter multiplies bf16 bit patterns as integers there, and numpy's matmul, which it
    calls, sums an element in an order that depends on its row in the tile (BLAS blocking), so
    the fused skinny kernels, whose W tiles order the rows differently, would not match the
    plain one bit for bit as they do on the GPU, where every element of an MMA is summed alike."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _jit(kernel: Callable, do_not_specialize: tuple[str, ...] = ()) -> Callable:
    fused_ops.jit_device_functions()  # _gemv_rows and the fused kernels' epilogues
    return triton.jit(kernel, do_not_specialize=do_not_specialize)


# Tests set this (monkeypatch) to stream CPU tensors through the kernels under Triton's
# interpreter, so the model's GPU dispatch runs without a GPU; it has no effect otherwise.
_stream_cpu_tensors_when_interpreting = False


def streaming_applies(x: torch.Tensor, weight: StreamedWeight) -> bool:
    """1..MAX_STREAMING_ROWS rows on a CUDA device, half precision, contiguous K; W in x's
    dtype, or quantised (stored contiguous) with its columns in x's order (no act-order `perm`)."""
    if isinstance(weight, torch.Tensor):
        weight_streams = weight.dtype == x.dtype and weight.stride(1) == 1
    else:
        weight_streams = getattr(weight, "perm", None) is None and (not isinstance(weight, Int4Weight) or int4_streams(weight))
    return (
        triton is not None
        and (x.is_cuda or (_stream_cpu_tensors_when_interpreting and _interpreting()))
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_STREAMING_ROWS
        and x.dtype in STREAMING_DTYPES
        and weight_streams
        and x.stride(1) == 1
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear: one row through `gemv`, a few rows through `skinny_gemm`, else cuBLAS."""
    if streaming_applies(x, weight):
        if x.shape[0] == 1:
            return gemv(x, weight, bias)
        if skinny_wins(x.shape[0], weight.shape[0]):
            return skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


MIN_SKINNY_COLUMNS = 4096  # narrower W (a small draft model's projections) leaves most SMs idle


def skinny_wins(m: int, n: int) -> bool:
    """Where the skinny GEMM measured at least cuBLAS's speed on an H100: Llama-3-8B's matrices
    (N >= 4096) at up to 32 rows, and up to 64 for the wide gate_up and LM-head matrices (at
    33-64 rows and N = 4096 it was 0.85-0.96x; `python -m bench.gemv --rows 2,17,33,64`,
    bench/results/gemv-20261123-013507.md). With 64-128 W rows per program, a narrow matrix
    would run on a handful of programs."""
    return n >= MIN_SKINNY_COLUMNS and (m <= 32 or n >= 16384)


def weight_arguments(weight: StreamedWeight) -> tuple[tuple, dict]:
    """The kernels' W arguments: (W, scales, zeros, W's row stride, the scales' row stride)
    and the format constexprs (W_FORMAT, HAS_ZEROS, GROUP). Unused pointers repeat W's."""
    if isinstance(weight, torch.Tensor):
        return (weight, weight, weight, weight.stride(0), 0), dict(W_FORMAT=PLAIN, HAS_ZEROS=False, GROUP=1)
    if isinstance(weight, Fp8Weight):
        return (weight.qweight, weight.scales, weight.scales, weight.qweight.stride(0), 0), dict(
            W_FORMAT=FP8, HAS_ZEROS=False, GROUP=1)
    if not int4_streams(weight):
        raise ValueError(f"the 4-bit kernels need K and the group size multiples of 8 and contiguous rows, got a weight of "
                         f"shape {tuple(weight.shape)} in groups of {weight.group_size}")
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    words = weight.qweight.view(torch.int32)  # eight codes a word, column 8j + i in nibble i (little-endian bytes)
    return (words, weight.scales, zeros, words.stride(0), weight.scales.stride(0)), dict(
        W_FORMAT=INT4, HAS_ZEROS=weight.zeros is not None, GROUP=weight.group_size)


def int4_streams(weight: Int4Weight) -> bool:
    """The 4-bit kernels read W as int32 words of eight codes, whole tiles per group: K and
    the group size must be multiples of 8, the rows contiguous."""
    return weight.shape[1] % 8 == 0 and weight.group_size % 8 == 0 and weight.qweight.is_contiguous()


def int4_block_k(block_k: int, group: int, whole_groups: bool) -> int:
    """block_k, or less, so that each K tile lies in one group (the skinny GEMM's tiles) or,
    with ``whole_groups`` (the GEMV's, which streams a tile a group at a time), holds whole
    ones: the largest power of two dividing the group size where block_k does not fit."""
    if group % block_k == 0 or (whole_groups and block_k % group == 0):
        return block_k
    return min(block_k, group & -group)


# bf16's GEMV tile (see `gemv`); quantised weights take gemv_tiles.py's. The fused GEMVs
# stream the same tile, their rows paired, so each row's dot product is summed in the same
# order as in the plain GEMV.
GEMV_BLOCK_N = 2
GEMV_BLOCK_K = 2048
GEMV_NUM_WARPS = 8
GEMV_NUM_STAGES = 1


def streaming_tile(weight: StreamedWeight, m: int, **overrides) -> dict:
    """The tile of the kernel that streams `weight` at `m` rows (the GEMV at 1, the skinny
    GEMM above), with ``overrides`` (a sweep's, a test's) on top: bf16 W takes the GEMV's
    constants and `skinny_tile`; FP8 / 4-bit W the per-shape tile of gemv_tiles.py, the
    4-bit K tile cut to fit the group size (`int4_block_k`)."""
    n, k = weight.shape
    if isinstance(weight, torch.Tensor):
        tile = (dict(block_n=GEMV_BLOCK_N, block_k=GEMV_BLOCK_K, num_warps=GEMV_NUM_WARPS, num_stages=GEMV_NUM_STAGES)
                if m == 1 else skinny_tile(n, skinny_block_m(m)))
    else:
        w_format = FP8 if isinstance(weight, Fp8Weight) else INT4
        tile = (gemv_tiles.gemv_tile(w_format, n, k) if m == 1
                else gemv_tiles.skinny_tile(w_format, n, k, skinny_block_m(m)))
    tile = {**tile, **overrides}
    if isinstance(weight, Int4Weight):
        tile["block_k"] = int4_block_k(tile["block_k"], weight.group_size, whole_groups=m == 1)
    return tile


MAX_SPLIT_TILES = 4096  # row tiles the split-K counters cover (N / BLOCK_N)


@functools.lru_cache(maxsize=None)
def split_counters(device: torch.device) -> torch.Tensor:
    """Per-device int32 counters of the split programs that have finished each row (column)
    tile, zero between calls (the last program of a tile resets its counter); the split-K
    GEMV here and fp8_gemm.py's split GEMM share them, one kernel at a time."""
    return torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)


def _split_arguments(name: str, n: int, k: int, tiles: int, tile: dict, out: torch.Tensor) -> tuple[tuple, dict]:
    """A GEMV's split-K arguments (fp32 partials [split_k, n], counters, each split's K) and
    constexprs (EVEN_K, SPLIT_K, PREFETCH): ``tile``'s split_k (1 where it has none) shares of
    K, each whole K tiles, and its prefetch (`_gemv_rows`)."""
    split_k, block_k = tile.get("split_k", 1), tile["block_k"]
    constexprs = dict(EVEN_K=k % block_k == 0, SPLIT_K=split_k, PREFETCH=tile.get("prefetch", False))
    if split_k == 1:
        return (out, out, k), constexprs
    if tiles > MAX_SPLIT_TILES:
        raise ValueError(f"{name}: {tiles} row tiles exceed the {MAX_SPLIT_TILES} split-K counters")
    k_share = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    partials = torch.empty((split_k, n), dtype=torch.float32, device=out.device)
    return (partials, split_counters(out.device), k_share), constexprs


def _x_for(x: torch.Tensor, weight: StreamedWeight) -> torch.Tensor:
    """x as the GEMV reads it: the 4-bit GEMV loads x eight bytes at a time (`_int4_gemv_sums`),
    so its start must be 8-byte aligned (a copy where a view starts elsewhere)."""
    if isinstance(weight, Int4Weight) and x.data_ptr() % 8:
        return x.clone()
    return x


def gemv(
    x: torch.Tensor,  # [1, K]
    weight: StreamedWeight,  # [N, K], rows contiguous (or quantised: see weight_arguments)
    bias: Optional[torch.Tensor] = None,  # [N]
    **tile,
) -> torch.Tensor:
    """[1, N] = x W^T (+ bias), in x's dtype; ``tile`` (block_n, block_k, num_warps,
    num_stages, split_k, and for 4-bit W prefetch) overrides `streaming_tile`'s.

    bf16's tile was the fastest of a sweep (block_n 1-16, block_k 256-4096, 4/8 warps,
    1-4 stages) on an H100 for every Llama-3-8B projection and its LM head: 2.6-3.2 TB/s
    against cuBLAS's 2.1-2.9 (`python -m bench.gemv --sweep`, bench/results/gemv-*).
    """
    N, K = weight.shape
    tile = streaming_tile(weight, 1, **tile)
    (w, scales, zeros, stride_wn, stride_sn), formats = weight_arguments(weight)
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(N, tile["block_n"])
    (partials, counters, k_share), split = _split_arguments("gemv", N, K, tiles, tile, out)
    _jit(_gemv_kernel)[(tiles, split["SPLIT_K"])](
        _x_for(x, weight),
        w,
        scales,
        zeros,
        bias if bias is not None else out,
        out,
        partials,
        counters,
        N,
        K,
        k_share,
        stride_wn,
        stride_sn,
        HAS_BIAS=bias is not None,
        **formats,
        **split,
        BLOCK_N=tile["block_n"],
        BLOCK_K=tile["block_k"],
        num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
    )
    return out


def _gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, K_SHARE, stride_wn, stride_sn,
                 HAS_BIAS: tl.constexpr, W_FORMAT: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr,
                 EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PREFETCH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    y, last = _gemv_rows(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, part_ptr, count_ptr, rows, row_mask, N, K, K_SHARE,
                         stride_wn, stride_sn, HAS_BIAS, W_FORMAT, HAS_ZEROS, GROUP, EVEN_K, SPLIT_K, BLOCK_N, BLOCK_K,
                         PREFETCH)
    if last:
        tl.store(out_ptr + rows, y, mask=row_mask)


@device_function
def _gemv_rows(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, part_ptr, count_ptr, rows, row_mask, N, K, K_SHARE, stride_wn,
               stride_sn, HAS_BIAS: tl.constexpr, W_FORMAT: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr,
               EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PREFETCH: tl.constexpr):
    """(x W^T + b)[rows] in x's dtype, for the BLOCK_N `rows` of W (any rows: the fused
    kernels pair rows far apart). The products accumulate in a [BLOCK_N, BLOCK_K] fp32 tile
    (4-bit: a word's eight products, scaled, in a [BLOCK_N, words] tile) reduced once at the
    end, so the inner loop is loads, the weight's conversion and FMAs only; each row's sum
    order depends only on the tile's shape and warps, not on which rows share it. Quantised
    weights are converted straight to fp32 (FP8 codes exactly; 4-bit codes as 1 + q/16,
    exactly), not rounded to x's dtype first.

    With SPLIT_K > 1 the program sums K_SHARE columns (grid axis 1 picks which) and returns
    ``last``: whether it was the last of its row tile to finish, and then holds the whole
    sums (`_split_sum`); only that program may use the result.

    With PREFETCH (4-bit W) each segment's loads (W, x, the group's scale and zero point)
    are issued before the previous segment's arithmetic and held in registers across the
    loop, so a thread has the next bytes in flight while it converts and sums the current
    ones (a software pipeline in registers; the sums and their order are the same). The
    4-bit GEMV is bound by instructions as much as by bytes, and its tiles keep few
    programs per SM, so without it a thread mostly waits for its loads or computes, seldom
    both."""
    k_start, k_end = _k_share(K, K_SHARE, SPLIT_K, BLOCK_K)
    if W_FORMAT == 2:
        # K tiles of whole groups are streamed a group at a time (unrolled: the segments' loads are independent)
        SEG: tl.constexpr = BLOCK_K if BLOCK_K < GROUP else GROUP
        acc = tl.zeros([BLOCK_N, SEG // 8], dtype=tl.float32)
        if PREFETCH:  # a segment at a time, the next one's loads before this one's arithmetic
            # With EVEN_K the loads go unmasked, each from a segment inside K: the last segment's
            # "next" loads are its own again, and an empty share (K_SHARE past K) loads K's last.
            first = k_start if not EVEN_K else tl.minimum(k_start, K - SEG)
            loads = _int4_gemv_loads(x_ptr, w_ptr, s_ptr, z_ptr, rows, row_mask, first, k_end, stride_wn, stride_sn,
                                     HAS_ZEROS, GROUP, EVEN_K, not EVEN_K, SEG)
            for start in range(k_start, k_end, SEG):
                following = start + SEG if not EVEN_K else tl.minimum(start + SEG, k_end - SEG)
                following = _int4_gemv_loads(x_ptr, w_ptr, s_ptr, z_ptr, rows, row_mask, following, k_end, stride_wn,
                                             stride_sn, HAS_ZEROS, GROUP, EVEN_K, not EVEN_K, SEG)
                acc = _int4_gemv_sums(acc, loads, x_ptr.dtype.element_ty, stride_wn)
                loads = following
        else:
            for start in range(k_start, k_end, BLOCK_K):
                for seg in tl.static_range(BLOCK_K // SEG):
                    loads = _int4_gemv_loads(x_ptr, w_ptr, s_ptr, z_ptr, rows, row_mask, start + seg * SEG, K, stride_wn,
                                             stride_sn, HAS_ZEROS, GROUP, EVEN_K, True, SEG)
                    acc = _int4_gemv_sums(acc, loads, x_ptr.dtype.element_ty, stride_wn)
        y = tl.sum(acc, axis=1)
    else:
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        w_rows = rows.to(tl.int64)[:, None] * stride_wn
        for start in range(k_start, k_end, BLOCK_K):
            k = start + cols
            k_mask = k < K
            w = tl.load(w_ptr + w_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            if W_FORMAT == 1:
                # x read in W's [BLOCK_N, BLOCK_K] shape (each row's copy from L1), so x and W
                # load in one layout, 16 FP8 codes and 16 x values a thread, with no shuffle of
                # x through shared memory between the loads and the FMAs.
                x = tl.load(x_ptr + (rows * 0)[:, None] + k[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
            else:
                x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            acc += w.to(tl.float32) * x
        y = tl.sum(acc, axis=1)
    if SPLIT_K > 1:
        y, last = _split_sum(y, part_ptr, count_ptr, rows, row_mask, N, SPLIT_K)
    else:
        last = True
    if W_FORMAT == 1:  # FP8: the row's scale, once
        y *= tl.load(s_ptr + rows, mask=row_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    return y.to(x_ptr.dtype.element_ty), last


@device_function
def _k_share(K, K_SHARE, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K columns [start, end) this program sums: all of K, or with SPLIT_K > 1 the share
    that grid axis 1 picks (shares are whole K tiles)."""
    if SPLIT_K > 1:
        k_start = tl.multiple_of(tl.program_id(1) * K_SHARE, BLOCK_K)
        k_end = tl.minimum(k_start + K_SHARE, K)
    else:
        k_start = 0
        k_end = K
    return k_start, k_end


@device_function
def _split_sum(y, part_ptr, count_ptr, rows, row_mask, N, SPLIT_K: tl.constexpr):
    """(the whole sums of ``rows``, whether this program has them) from this split's sums
    ``y``: each split stores its fp32 sums; the last program of the row tile to finish
    (an atomic counter that program resets, as fp8_gemm.py's split GEMM does) sums all
    splits in split order, so the result does not depend on which finishes last."""
    tl.store(part_ptr + tl.program_id(1) * N + rows, y, mask=row_mask)
    # Every thread's partials, then one release at GPU scope; the last program acquires them all.
    tl.debug_barrier()
    finished = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
    last = finished == SPLIT_K - 1
    total = tl.zeros_like(y)
    if last:
        for split in tl.static_range(SPLIT_K):
            total += tl.load(part_ptr + split * N + rows, mask=row_mask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + tl.program_id(0), 0)
    return total, last


@device_function
def _int4_gemv_loads(x_ptr, w_ptr, s_ptr, z_ptr, rows, row_mask, start, end, stride_wn, stride_sn,
                     HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr, MASKED: tl.constexpr,
                     WIDTH: tl.constexpr):
    """What `_int4_gemv_sums` reads of W[rows, start:start + WIDTH] of a 4-bit weight and x
    there, nothing from column ``end`` on (the WIDTH columns lie in one group, `int4_block_k`):
    W as stored, [BLOCK_N, WIDTH / 8] int32 (eight codes a word, column 8j + i in nibble i),
    so each thread loads several consecutive words as one vector; the rows' group scale
    (fp32) and zero point; x as two [1, WIDTH / 8] int64 tiles, each word's first and second
    four columns (8 bytes a load). Without MASKED the caller vouches that the columns lie
    inside K: the loads take no predicates (nor the zeros a masked load first writes), and
    rows outside W read row 0."""
    words = tl.multiple_of(start // 8, WIDTH // 8) + tl.arange(0, WIDTH // 8)  # segments start at multiples of WIDTH
    if MASKED:
        read_rows = rows.to(tl.int64)
        # With K a multiple of the tile (EVEN_K) a segment lies wholly inside K or past it: a mask
        # constant along the words lets each thread load its words as one vector.
        word_mask = (words < end // 8) if not EVEN_K else (tl.full([WIDTH // 8], start, tl.int32) < end)
        w_mask, x_mask = row_mask[:, None] & word_mask[None, :], word_mask[None, :]
        group_mask = row_mask & (tl.full([1], start, tl.int32) < end)  # a GEMV tile's segments may end past K
        fill = 0
    else:
        read_rows = tl.where(row_mask, rows, 0).to(tl.int64)
        w_mask, x_mask, group_mask, fill = None, None, None, None
    packed = tl.load(w_ptr + read_rows[:, None] * stride_wn + words[None, :], mask=w_mask, other=fill)
    group = read_rows * stride_sn + start // GROUP
    scale = tl.load(s_ptr + group, mask=group_mask, other=fill).to(tl.float32)[:, None]
    if HAS_ZEROS:
        zero = tl.load(z_ptr + group, mask=group_mask, other=fill).to(tl.float32)[:, None]
    else:
        zero = tl.full([1, 1], 8.0, tl.float32)  # int4.SYMMETRIC_ZERO (a kernel reads no module globals)
    x_quads = x_ptr.to(tl.pointer_type(tl.int64)) + (words * 2)[None, :]
    first = tl.load(x_quads, mask=x_mask, other=fill)
    second = tl.load(x_quads + 1, mask=x_mask, other=fill)
    return packed, scale, zero, first, second


@device_function
def _int4_gemv_sums(acc, loads, dtype: tl.constexpr, stride_wn):
    """``acc`` ([BLOCK_N, WIDTH / 8] fp32, one element a packed word) plus the products of a
    segment's W and x, as `_int4_gemv_loads` read them.

    W is unpacked one nibble position at a time: nibble i of every word is a [BLOCK_N, words]
    tile whose x is x[start + 8j + i]. A code q placed in the mantissa of 1.0 reads 1 + q/16
    at bits 19..22 or 1 + q/256 at bits 15..18, so one shift serves two codes,
    an odd and an even nibble, and one LOP3 each makes the float. Its product with a bf16 or
    fp16 x is exact in fp32, so one FMA a code sums, over a word's codes,
    G = sum_odd (1 + q_i/16) x_i and H = sum_even (1 + q_i/256) x_i; with their x's sums
    X_odd and X_even, sum_i q_i x_i = 16 (G - X_odd) + 256 (H - X_even), and the group's
    scale and zero point apply once a word: sum_i (q_i - z) s x_i = s (16 G + 256 H - (16 X_odd
    + 256 X_even + z X)). (The sums of x are the same for every row a thread holds.)"""
    packed, scale, zero, first, second = loads
    # The masks are read from registers (shifted by stride_wn >> 31, which is 0 but which the
    # compiler cannot fold), so each and-or is one LOP3 (an instruction holds one immediate).
    high = tl.full([1], 0x00780000, tl.int32) >> (stride_wn >> 31)  # bits 19..22: 1 + q/16
    low = tl.full([1], 0x00078000, tl.int32) >> (stride_wn >> 31)  # bits 15..18: 1 + q/256
    g = tl.zeros_like(acc)
    h = tl.zeros_like(acc)
    x_odd = tl.zeros([1, acc.shape[1]], dtype=tl.float32)
    x_even = tl.zeros([1, acc.shape[1]], dtype=tl.float32)
    for half in tl.static_range(2):
        quad = first if half == 0 else second
        for pair in tl.static_range(2):
            bits = (quad >> (32 * pair)).to(tl.int32)  # the x of nibbles 2n (low half) and 2n + 1
            n = 2 * half + pair
            if dtype == tl.bfloat16:  # a bf16's bits are the top half of its fp32's
                even = (bits << 16).to(tl.float32, bitcast=True)
                odd = (bits & -65536).to(tl.float32, bitcast=True)
            else:
                even = bits.to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
                odd = (bits >> 16).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
            # nibble 2n + 1 to bits 19..22, nibble 2n to bits 15..18: a shift by 15 - 8n
            if n < 2:
                nibbles = packed << (15 - 8 * n)
            else:
                nibbles = packed >> (8 * n - 15)
            g = tl.fma(((nibbles & high) | 0x3F800000).to(tl.float32, bitcast=True), odd, g)
            h = tl.fma(((nibbles & low) | 0x3F800000).to(tl.float32, bitcast=True), even, h)
            x_odd += odd
            x_even += even
    ones = 16.0 * x_odd + 256.0 * x_even  # what the 1s of 1 + q/16 and 1 + q/256 added
    return tl.fma(scale, tl.fma(h, 256.0, tl.fma(g, 16.0, -tl.fma(zero, x_odd + x_even, ones))), acc)


def _int4_codes_ptx(magic: str, one: str, packed_type: str) -> str:
    """The PTX of `_int4_codes_tile`: words $8 and $9 (two elements of W's packed tile) to their
    eight codes less zero points, $0..$7 (nibble i of both words in $i's two halves), $10 the
    packed -(magic + z). Per pair of codes: PRMT puts byte i of each word (or of each word
    shifted by 4) in the two halves, LOP3 keeps its low nibble in the mantissa of ``magic``'s
    halves (then they read magic + q) and a packed FMA by ``one`` adds $10."""
    lines = ["{", ".reg .b32 s0, s1, t, one;", f"mov.b32 one, {one};", "shr.u32 s0, $8, 4;", "shr.u32 s1, $9, 4;"]
    for byte, selector in enumerate(("0x4400", "0x5511", "0x6622", "0x7733")):
        for half, (low, high) in enumerate((("$8", "$9"), ("s0", "s1"))):
            lines += [f"prmt.b32 t, {low}, {high}, {selector};", f"lop3.b32 t, t, 0x000F000F, {magic}, 0xEA;",
                      f"fma.rn.{packed_type} ${2 * byte + half}, t, one, $10;"]
    return "\n".join(lines + ["}"])


INT4_CODES_PTX_BF16 = tl.constexpr(_int4_codes_ptx("0x43004300", "0x3F803F80", "bf16x2"))  # 128 + q, bf16 1.0
INT4_CODES_PTX_F16 = tl.constexpr(_int4_codes_ptx("0x64006400", "0x3C003C00", "f16x2"))  # 1024 + q, fp16 1.0


@device_function
def _int4_codes_tile(x_ptr, w_ptr, z_ptr, rows, row_mask, start, K, stride_wn, stride_sn, HAS_ZEROS: tl.constexpr,
                     GROUP: tl.constexpr, INTERPRETED: tl.constexpr, EVEN_K: tl.constexpr, REORDER: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """The codes less their zero point, q - z, of W[rows, start:start + BLOCK_K] of a 4-bit
    weight, in x's dtype (small integers: exact), columns in `_int4_k_order` with REORDER, 0 <= q < 16
    read where masked; the BLOCK_K columns lie in one group (`int4_block_k`), whose scale the
    skinny GEMM applies to the tile's sums (Marlin's order: Frantar et al., 2024, arXiv:2408.11743).

    W is read as stored, int32 words of eight codes (nibble i of word j is column 8j + i), and
    each word is converted in PTX by the magic-number trick of FasterTransformer's and Marlin's
    dequantisers: PRMT puts byte i of the word and of the word shifted by 4 in the two halves
    of a register, one LOP3 keeps their low nibbles in the mantissa of 128 (bf16 0x4300;
    fp16: 1024, 0x6400), which then reads 128 + q, and one packed FMA subtracts 128 + z: two
    codes (columns 8j + 2i and 8j + 2i + 1) a PRMT, a LOP3 and an FMA. Triton's interpreter
    runs no PTX: there the same integers come from shifts and masks."""
    WORDS: tl.constexpr = BLOCK_K // 8
    words = tl.multiple_of(start // 8, WORDS) + tl.arange(0, WORDS)
    w_words = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + words[None, :]
    if EVEN_K:  # a mask constant along K: each thread loads its words as vectors
        packed = tl.load(w_words, mask=row_mask[:, None], other=0)
    else:
        packed = tl.load(w_words, mask=row_mask[:, None] & (words < K // 8)[None, :], other=0)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + rows.to(tl.int64) * stride_sn + start // GROUP, mask=row_mask, other=0).to(tl.int32)
    else:
        zero = tl.full(rows.shape, 8, tl.int32)  # int4.SYMMETRIC_ZERO (a kernel reads no module globals)
    dtype = x_ptr.dtype.element_ty
    if INTERPRETED:  # nibble i of each word by a shift and a mask, laid out as the PTX's eight results
        z = zero[:, None]
        c0 = (((packed >> 0) & 15) - z).to(tl.float32).to(dtype)
        c1 = (((packed >> 4) & 15) - z).to(tl.float32).to(dtype)
        c2 = (((packed >> 8) & 15) - z).to(tl.float32).to(dtype)
        c3 = (((packed >> 12) & 15) - z).to(tl.float32).to(dtype)
        c4 = (((packed >> 16) & 15) - z).to(tl.float32).to(dtype)
        c5 = (((packed >> 20) & 15) - z).to(tl.float32).to(dtype)
        c6 = (((packed >> 24) & 15) - z).to(tl.float32).to(dtype)
        c7 = (((packed >> 28) & 15) - z).to(tl.float32).to(dtype)
    else:
        # (a constexpr string passed straight on: assigned to a local it would become a tensor)
        if dtype == tl.bfloat16:
            offset = tl.broadcast_to((-128 - zero).to(tl.float32).to(dtype)[:, None], packed.shape)
            c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
                INT4_CODES_PTX_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [packed, offset],
                dtype=(dtype, dtype, dtype, dtype, dtype, dtype, dtype, dtype), is_pure=True, pack=2)
        else:
            offset = tl.broadcast_to((-1024 - zero).to(tl.float32).to(dtype)[:, None], packed.shape)
            c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
                INT4_CODES_PTX_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [packed, offset],
                dtype=(dtype, dtype, dtype, dtype, dtype, dtype, dtype, dtype), is_pure=True, pack=2)
    # tl.join adds its axis last, so the outermost join varies fastest: nibble i lands at column 8w + i
    codes = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    codes = tl.reshape(codes, [rows.shape[0], BLOCK_K])
    if REORDER:
        codes = _int4_k_order(codes, BLOCK_K)
    return codes


@device_function
def _int4_k_order(t, BLOCK_K: tl.constexpr):
    """A [R, BLOCK_K] tile's columns in the order the 4-bit skinny GEMM sums them: in each 64
    columns (eight words of codes), column 8w + i (nibble i of word w = 2c + a) moves to
    8i + 2c + a, so that each pair of columns an MMA thread holds in one register (2c + a at
    k, k + 8, ...: the A operand's fragments, PTX ISA "wgmma" and "mma.m16n8k16") is one
    nibble of two neighbouring words, which `_int4_codes_tile` converts together. Applied alike
    to x and W's codes, it changes which products an MMA sums together, not the products."""
    if BLOCK_K % 64 == 0:
        t = tl.reshape(tl.permute(tl.reshape(t, [t.shape[0], BLOCK_K // 64, 4, 2, 8]), [0, 1, 4, 2, 3]),
                       [t.shape[0], BLOCK_K])
    return t


@device_function
def _weight_tile(x_ptr, w_ptr, s_ptr, z_ptr, rows, row_mask, start, K, stride_wn, stride_sn, W_FORMAT: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[rows, start:start + BLOCK_K] in x's dtype for the skinny GEMMs' `tl.dot`, 0 where
    masked: as stored (W_FORMAT 0) or FP8 codes (1; their row scale applies after the K
    loop). 4-bit W takes `_int4_codes_tile`. FP8 goes through fp32, not straight to bf16:
    E4M3 -> f16 -> f32 -> bf16 are packed conversions, E4M3 -> bf16 one element a time."""
    k = start + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + k[None, :], mask=row_mask[:, None] & (k < K)[None, :],
                other=0.0)
    if W_FORMAT == 1:
        w = w.to(tl.float32).to(x_ptr.dtype.element_ty)
    return w


# --------------------------------------------------------------------------- GEMVs with an epilogue
# (see the module docstring): the GEMV's programs and tile (`streaming_tile`), each
# program's BLOCK_N W rows gathered as BLOCK_N/2 interleaved pairs (pair i in tile rows 2i
# and 2i + 1), the two rows whose outputs the elementwise op combines.


def gemv_silu_and_mul(
    x: torch.Tensor,  # [1, K]
    weight: StreamedWeight,  # [2I, K]: the gate rows, then the up rows; rows contiguous
    **tile,
) -> torch.Tensor:
    """[1, I] = `fused_ops.silu_and_mul(gemv(x, weight))`, bit for bit, in one kernel.

    Program p streams gate rows p BLOCK_N/2 .. + BLOCK_N/2 in the first half of its tile and
    the matching up rows in the second (see the module docstring).
    """
    N, K = weight.shape
    if x.shape != (1, K) or N % 2:
        raise ValueError(f"gemv_silu_and_mul needs x [1, K] and weight [2I, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    inter = N // 2
    tile = streaming_tile(weight, 1, **tile)
    (w, scales, zeros, stride_wn, stride_sn), formats = weight_arguments(weight)
    out = torch.empty((1, inter), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(inter, tile["block_n"] // 2)
    (partials, counters, k_share), split = _split_arguments("gemv_silu_and_mul", N, K, tiles, tile, out)
    _jit(_gemv_silu_and_mul_kernel)[(tiles, split["SPLIT_K"])](
        _x_for(x, weight), w, scales, zeros, out, partials, counters, inter, K, k_share, stride_wn, stride_sn, **split,
        BLOCK_N=tile["block_n"], BLOCK_K=tile["block_k"],
        num_warps=tile["num_warps"], num_stages=tile["num_stages"], **formats,
    )
    return out


def _gemv_silu_and_mul_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, inter, K, K_SHARE, stride_wn,
                              stride_sn, W_FORMAT: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr,
                              EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              PREFETCH: tl.constexpr):
    PAIRS: tl.constexpr = BLOCK_N // 2
    lanes = tl.arange(0, BLOCK_N)
    j = tl.program_id(0) * PAIRS + lanes % PAIRS  # the output column each W row feeds
    rows = j + (lanes // PAIRS) * inter  # the tile's first half gate rows j, its second the up rows I + j
    y, last = _gemv_rows(x_ptr, w_ptr, s_ptr, z_ptr, x_ptr, part_ptr, count_ptr, rows, j < inter, 2 * inter, K, K_SHARE,
                         stride_wn, stride_sn, False, W_FORMAT, HAS_ZEROS, GROUP, EVEN_K, SPLIT_K, BLOCK_N, BLOCK_K,
                         PREFETCH)
    if last:
        gate, up = tl.split(tl.permute(tl.reshape(y, [2, PAIRS]), [1, 0]))
        cols = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
        tl.store(out_ptr + cols, fused_ops._silu_mul(gate, up), mask=cols < inter)


def rotary_fits(m: int, weight: StreamedWeight, head_dim: int) -> bool:
    """Whether the fused qkv kernels (`gemv_rotary_and_store_kv` at one row,
    `skinny_gemm_rotary_and_store_kv` above) can keep the plain kernel's tile for this qkv
    weight at m rows: each program's BLOCK_N/2 rotary pairs must lie in one head. (With each
    pair's rows interleaved in the tile, the fused skinny kernel that splits K measured slower
    than the kernels apart; with them in two halves, faster: `bench.fused_epilogues`.)"""
    block_n = streaming_tile(weight, m)["block_n"]
    return head_dim % 2 == 0 and (head_dim // 2) % (block_n // 2) == 0


def _check_qkv_and_caches(name: str, weight: torch.Tensor, num_heads: int, k_cache: torch.Tensor,
                          v_cache: torch.Tensor) -> tuple[int, int]:
    """(KV heads, head size) of the caches, after checking that the fused qkv weight's rows are
    num_heads q heads then as many k and v heads as the caches hold, of an even head size, and
    that the caches are contiguous (the kernels address slots by their shape)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if head_dim % 2 or weight.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"{name}: weight {tuple(weight.shape)} does not fit {num_heads} q heads and a cache of "
            f"{num_kv_heads} heads of {head_dim}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{name} needs contiguous KV caches")
    return num_kv_heads, head_dim


def gemv_rotary_and_store_kv(
    x: torch.Tensor,  # [1, K]
    weight: StreamedWeight,  # [(H + 2 KVH) D, K]: the q heads' rows, then k's, then v's; rows contiguous
    bias: Optional[torch.Tensor],  # [(H + 2 KVH) D] (Qwen2) or None
    cos: torch.Tensor,  # fp32 [max_positions, D/2], rows contiguous
    sin: torch.Tensor,
    positions: torch.Tensor,  # int [1]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [1]
    num_heads: int,
    **tile,
) -> torch.Tensor:
    """The qkv projection of one token, rotated and stored: `gemv(x, weight, bias)` split
    into q, k and v heads, then `fused_ops.rotary_and_store_kv`, bit for bit, in one kernel.

    Returns the rotated q [1, H, D]; k (rotated) and v go into the caches at
    ``slot_mapping[0]``. Each program streams BLOCK_N/2 rotary pairs of rows, d and d + D/2
    of one head, so BLOCK_N/2 must divide D/2 (`rotary_fits`). The position and slot are
    read on the device: no host sync, graph-capturable.
    """
    N, K = weight.shape
    if x.shape != (1, K):
        raise ValueError(f"gemv_rotary_and_store_kv needs x [1, {K}], got {tuple(x.shape)}")
    num_kv_heads, head_dim = _check_qkv_and_caches("gemv_rotary_and_store_kv", weight, num_heads, k_cache, v_cache)
    half = head_dim // 2
    tile = streaming_tile(weight, 1, **tile)
    block_n = tile["block_n"]
    if half % (block_n // 2):
        raise ValueError(f"gemv_rotary_and_store_kv: {block_n // 2} rotary pairs per program do not divide {half}")
    (w, scales, zeros, stride_wn, stride_sn), formats = weight_arguments(weight)
    q_out = torch.empty((1, num_heads, head_dim), dtype=x.dtype, device=x.device)
    (partials, counters, k_share), split = _split_arguments("gemv_rotary_and_store_kv", N, K, N // block_n, tile, q_out)
    _jit(_gemv_rotary_kv_kernel)[(N // block_n, split["SPLIT_K"])](
        _x_for(x, weight),
        w,
        scales,
        zeros,
        bias if bias is not None else x,
        q_out,
        k_cache,
        v_cache,
        cos,
        sin,
        positions,
        slot_mapping,
        partials,
        counters,
        N,
        K,
        k_share,
        stride_wn,
        stride_sn,
        cos.stride(0),
        sin.stride(0),
        num_heads,
        num_kv_heads,
        half,
        HAS_BIAS=bias is not None,
        **formats,
        **split,
        BLOCK_N=block_n,
        BLOCK_K=tile["block_k"],
        num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
    )
    return q_out


def _gemv_rotary_kv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr,
                           positions_ptr, slots_ptr, part_ptr, count_ptr, N, K, K_SHARE, stride_wn, stride_sn, stride_cos,
                           stride_sin, num_heads, num_kv_heads, half, HAS_BIAS: tl.constexpr, W_FORMAT: tl.constexpr,
                           HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    """Program p owns dimensions d0 .. d0 + BLOCK_N/2 of one head (and their partners + D/2),
    counting the q heads, then the k heads, then the v heads, as the fused weight's rows
    are ordered."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    programs_per_head = half // PAIRS
    head = tl.program_id(0) // programs_per_head
    d0 = (tl.program_id(0) % programs_per_head) * PAIRS
    head_dim = 2 * half
    lanes = tl.arange(0, BLOCK_N)
    rows = head * head_dim + d0 + lanes % PAIRS + (lanes // PAIRS) * half  # dims d0 + i, then their partners
    y, last = _gemv_rows(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, part_ptr, count_ptr, rows, lanes < BLOCK_N, N, K, K_SHARE,
                         stride_wn, stride_sn, HAS_BIAS, W_FORMAT, HAS_ZEROS, GROUP, EVEN_K, SPLIT_K, BLOCK_N, BLOCK_K,
                         PREFETCH)
    if last:
        x1, x2 = tl.split(tl.permute(tl.reshape(y, [2, PAIRS]), [1, 0]))
        dims = d0 + tl.arange(0, PAIRS)
        position = tl.load(positions_ptr).to(tl.int64)
        cos = tl.load(cos_ptr + position * stride_cos + dims).to(tl.float32)
        sin = tl.load(sin_ptr + position * stride_sin + dims).to(tl.float32)
        # Each branch names its own pointers: Triton requires a name assigned in both branches of
        # an `if` to have one type, and a cache of another dtype than q's makes them differ.
        if head < num_heads:
            q_first, q_second = fused_ops._rotate_half(x1, x2, cos, sin)
            q_dst = q_out_ptr + head * head_dim + dims
            tl.store(q_dst, q_first)
            tl.store(q_dst + half, q_second)
        else:
            slot = tl.load(slots_ptr).to(tl.int64)
            if head < num_heads + num_kv_heads:
                k_first, k_second = fused_ops._rotate_half(x1, x2, cos, sin)
                k_dst = k_cache_ptr + (slot * num_kv_heads + head - num_heads) * head_dim + dims
                cache_dtype = k_cache_ptr.dtype.element_ty
                tl.store(k_dst, k_first.to(cache_dtype))
                tl.store(k_dst + half, k_second.to(cache_dtype))
            else:
                v_dst = v_cache_ptr + (slot * num_kv_heads + head - num_heads - num_kv_heads) * head_dim + dims
                value_dtype = v_cache_ptr.dtype.element_ty
                tl.store(v_dst, x1.to(value_dtype))
                tl.store(v_dst + half, x2.to(value_dtype))


def skinny_tile(n: int, block_m: int) -> dict:
    """The skinny GEMM's tile for N output columns and BLOCK_M padded rows, from a sweep on an
    H100 at M = 17 and 64 (`python -m bench.gemv --sweep skinny`, bench/results/gemv-20261123-012121.md).

    W goes first in the product (out^T = W x^T), so W's rows fill the MMA's large M
    dimension and x's few rows the small N one. 128 W rows per program for the wide
    gate_up and LM-head matrices, 64 for the rest, so every shape still has 64+ programs:
    1.00-1.08x cuBLAS at M = 17. At BLOCK_M = 64 the K tiles and the pipeline are shallower,
    so the staged x and W tiles fit in shared memory.
    """
    if n >= 16384:
        return dict(block_n=128, block_k=128, num_warps=4, num_stages=3 if block_m > 32 else 4, w_first=True)
    return dict(block_n=64, block_k=128 if block_m > 32 else 256, num_warps=4, num_stages=4, w_first=True)


def skinny_gemm(
    x: torch.Tensor,  # [M, K], 2 <= M <= 64, K contiguous
    weight: StreamedWeight,  # [N, K], rows contiguous (or quantised: see weight_arguments)
    bias: Optional[torch.Tensor] = None,  # [N]
    **tile,
) -> torch.Tensor:
    """[M, N] = x W^T (+ bias), in x's dtype, streaming W once.

    M is padded (by masks, not by memory traffic) to BLOCK_M, a power of two >= 16, the
    smallest `tl.dot` tile; block_n must be >= 16 as well. ``tile`` overrides `streaming_tile`'s
    choice (block_n, block_k, num_warps, num_stages, w_first, split_k: K in that many shares
    where a tile says so, as the GEMV splits it), as the sweep does.
    """
    M, K = x.shape
    N = weight.shape[0]
    options = _skinny_launch_options(M, weight, tile)
    (w, scales, zeros, stride_wn, stride_sn), formats = weight_arguments(weight)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(N, options["BLOCK_N"])
    partials, counters, k_share = _skinny_split("skinny_gemm", M, N, K, tiles, options, out)
    # M is not specialised (Triton would compile M % 16 == 0 apart from the rest), so each
    # BLOCK_M (16, 32, 64) compiles once, whatever tree sizes a server sees.
    _jit(_skinny_gemm_kernel, ("M",))[(tiles, options["SPLIT_K"])](
        x,
        w,
        scales,
        zeros,
        bias if bias is not None else out,
        out,
        partials,
        counters,
        M,
        N,
        K,
        k_share,
        x.stride(0),
        stride_wn,
        stride_sn,
        out.stride(0),
        HAS_BIAS=bias is not None,
        **formats,
        **options,
    )
    return out


def _skinny_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SHARE, stride_xm,
                        stride_wn, stride_sn, stride_om, HAS_BIAS: tl.constexpr, W_FORMAT: tl.constexpr,
                        HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr, DOT_IN_FP32: tl.constexpr, EVEN_K: tl.constexpr,
                        W_FIRST: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)  # rows of x (tokens)
    row_mask = rows < M
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = rows of W
    col_mask = cols < N
    acc, last = _skinny_rows(x_ptr, w_ptr, s_ptr, z_ptr, part_ptr, count_ptr, cols, row_mask, col_mask, M, N, K, K_SHARE,
                             stride_xm, stride_wn, stride_sn, W_FORMAT, HAS_ZEROS, GROUP, DOT_IN_FP32, EVEN_K, W_FIRST,
                             SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@device_function
def _skinny_rows(x_ptr, w_ptr, s_ptr, z_ptr, part_ptr, count_ptr, cols, row_mask, col_mask, M, N, K, K_SHARE, stride_xm,
                 stride_wn, stride_sn, W_FORMAT: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr,
                 DOT_IN_FP32: tl.constexpr, EVEN_K: tl.constexpr, W_FIRST: tl.constexpr, SPLIT_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(the fp32 [BLOCK_M, BLOCK_N] product of x's rows with the BLOCK_N rows ``cols`` of W
    (any rows: the fused kernels gather pairs far apart), streamed over K; whether this
    program holds it). With SPLIT_K > 1 the program sums K_SHARE columns (grid axis 1 picks
    which) and the last program of the column tile adds the shares' sums in share order
    (`_split_sum`, over the [SPLIT_K, M, N] fp32 partials); only that one may use the result,
    the others get ``last`` False. Each element's
    sum depends only on the tile's shape and warps, not on which W rows share it. An FP8 W's
    tiles come from `_weight_tile` (always masked), its row scales apply last; a 4-bit W's
    codes less zero points from `_int4_codes_tile`, each K tile's sums scaled by its group's
    scales (a K tile lies in one group), x's columns put in the codes' order (`_int4_k_order`,
    at BLOCK_M <= 32)."""
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + tl.arange(0, BLOCK_M)[:, None] * stride_xm + ks[None, :]
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    # W_FIRST computes out^T = W x^T, so W's rows fill the MMA's large M dimension.
    acc = tl.zeros([BLOCK_N, BLOCK_M] if W_FIRST else [BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start, k_end = _k_share(K, K_SHARE, SPLIT_K, BLOCK_K)
    # x's columns reordered as the codes' (`_int4_k_order`) pass through registers: at 64 rows
    # that costs more instructions than the codes' conversion saves (sm_90 SASS, offline compile).
    REORDER: tl.constexpr = BLOCK_M <= 32
    for start in range(k_start, k_end, BLOCK_K):
        if W_FORMAT == 2:  # the tile's codes (q - z), exact; the group's scale on the tile's fp32 sums
            codes = _int4_codes_tile(x_ptr, w_ptr, z_ptr, cols, col_mask, start, K, stride_wn, stride_sn, HAS_ZEROS, GROUP,
                                     DOT_IN_FP32, EVEN_K, REORDER, BLOCK_K)
            x = _skinny_x(x_tile, row_mask, start, K, EVEN_K, BLOCK_K)
            if REORDER:
                x = _int4_k_order(x, BLOCK_K)
            sums = _skinny_dot(tl.zeros_like(acc), x, codes, DOT_IN_FP32, W_FIRST)
            scale = tl.load(s_ptr + cols.to(tl.int64) * stride_sn + start // GROUP, mask=col_mask, other=0.0).to(tl.float32)
            acc = tl.fma(sums, scale[:, None] if W_FIRST else scale[None, :], acc)
        else:
            w = _skinny_w_tile(x_ptr, w_ptr, s_ptr, z_ptr, w_tile, cols, col_mask, start, K, stride_wn, stride_sn, W_FORMAT,
                               HAS_ZEROS, GROUP, EVEN_K, BLOCK_K)
            acc = _skinny_accumulate(acc, x_tile, w, row_mask, start, K, DOT_IN_FP32, EVEN_K, W_FIRST, BLOCK_K)
    acc = _skinny_result(acc, s_ptr, cols, col_mask, W_FORMAT, W_FIRST)
    if SPLIT_K > 1:
        at = tl.arange(0, BLOCK_M)[:, None] * N + cols[None, :]  # [x row, W row] of an [M, N] share
        acc, last = _split_sum(acc, part_ptr, count_ptr, at, row_mask[:, None] & col_mask[None, :], M * N, SPLIT_K)
    else:
        last = True
    return acc, last


@device_function
def _skinny_w_tile(x_ptr, w_ptr, s_ptr, z_ptr, w_tile, cols, col_mask, start, K, stride_wn, stride_sn, W_FORMAT: tl.constexpr,
                   HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """W's [BLOCK_N, BLOCK_K] tile at K offset ``start`` (``w_tile``: its pointers at 0), in x's dtype."""
    if W_FORMAT == 0:
        if EVEN_K:
            w = tl.load(w_tile + start, mask=col_mask[:, None], other=0.0)
        else:
            w = tl.load(w_tile + start, mask=col_mask[:, None] & ((start + tl.arange(0, BLOCK_K)) < K)[None, :], other=0.0)
    else:
        w = _weight_tile(x_ptr, w_ptr, s_ptr, z_ptr, cols, col_mask, start, K, stride_wn, stride_sn, W_FORMAT,
                         HAS_ZEROS, GROUP, BLOCK_K)
    return w


@device_function
def _skinny_accumulate(acc, x_tile, w, row_mask, start, K, DOT_IN_FP32: tl.constexpr, EVEN_K: tl.constexpr,
                       W_FIRST: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc`` plus x's [BLOCK_M, BLOCK_K] tile at K offset ``start`` times W's tile ``w``."""
    return _skinny_dot(acc, _skinny_x(x_tile, row_mask, start, K, EVEN_K, BLOCK_K), w, DOT_IN_FP32, W_FIRST)


@device_function
def _skinny_x(x_tile, row_mask, start, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """x's [BLOCK_M, BLOCK_K] tile at K offset ``start``, 0 past K and M."""
    if EVEN_K:
        x = tl.load(x_tile + start, mask=row_mask[:, None], other=0.0)
    else:
        x = tl.load(x_tile + start, mask=row_mask[:, None] & ((start + tl.arange(0, BLOCK_K)) < K)[None, :], other=0.0)
    return x


@device_function
def _skinny_dot(acc, x, w, DOT_IN_FP32: tl.constexpr, W_FIRST: tl.constexpr):
    """``acc`` plus the tiles' product, x w^T (W_FIRST: its transpose, w x^T)."""
    if DOT_IN_FP32:  # Triton's interpreter (see `_interpreting`): exact products, summed per element
        x, w = x.to(tl.float32), w.to(tl.float32)
        if W_FIRST:
            acc += tl.sum(w[:, None, :] * x[None, :, :], axis=2)
        else:
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    elif W_FIRST:
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@device_function
def _skinny_result(acc, s_ptr, cols, col_mask, W_FORMAT: tl.constexpr, W_FIRST: tl.constexpr):
    """The accumulated tile as [rows, cols], with an FP8 W's row scales applied."""
    if W_FIRST:
        acc = tl.trans(acc)
    if W_FORMAT == 1:  # FP8: each output column's (W row's) scale, once
        acc *= tl.load(s_ptr + cols, mask=col_mask, other=0.0)[None, :]
    return acc


# --------------------------------------------------------------------------- skinny GEMMs with an epilogue
# The skinny GEMM's programs, tile and K loop, each program's BLOCK_N W rows gathered as
# BLOCK_N/2 pairs whose outputs the op combines, interleaved (pair i in tile rows 2i and
# 2i + 1) so the rounded [BLOCK_M, BLOCK_N] result splits into the pair's halves in place.


def skinny_block_m(m: int) -> int:
    """M padded to a power of two >= 16, the smallest `tl.dot` tile."""
    return max(16, triton.next_power_of_2(m))


def _skinny_launch_options(m: int, weight: StreamedWeight, tile: dict) -> dict:
    """The skinny kernels' launch options for [m, K] x W^T: `streaming_tile`'s choice,
    overridden by ``tile``, as the kernels' constexprs and launch parameters."""
    block_m = skinny_block_m(m)
    tile = streaming_tile(weight, m, **tile)
    k = weight.shape[1]
    return dict(
        DOT_IN_FP32=_interpreting(),
        EVEN_K=k % tile["block_k"] == 0,
        W_FIRST=tile["w_first"],
        SPLIT_K=tile.get("split_k", 1),
        BLOCK_M=block_m,
        BLOCK_N=tile["block_n"],
        BLOCK_K=tile["block_k"],
        num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
    )


def _skinny_split(name: str, m: int, n: int, k: int, tiles: int, options: dict, out: torch.Tensor) -> tuple:
    """A skinny kernel's split-K arguments (fp32 partials [split_k, m n], counters, each
    share's K) for ``tiles`` column tiles (`_split_arguments`)."""
    tile = dict(split_k=options["SPLIT_K"], block_k=options["BLOCK_K"])
    return _split_arguments(name, m * n, k, tiles, tile, out)[0]


def skinny_gemm_silu_and_mul(
    x: torch.Tensor,  # [M, K], 2 <= M <= 64, K contiguous
    weight: StreamedWeight,  # [2I, K]: the gate rows, then the up rows; rows contiguous
    **tile,
) -> torch.Tensor:
    """[M, I] = `fused_ops.silu_and_mul(skinny_gemm(x, weight))`, bit for bit, in one kernel.

    The programs, their tile (`streaming_tile` of the [2I, K] weight) and their bytes are the skinny
    GEMM's; program p streams gate rows p BLOCK_N/2 .. + BLOCK_N/2 and the matching up rows.
    """
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or N % 2:
        raise ValueError(f"skinny_gemm_silu_and_mul needs x [M, K] and weight [2I, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    inter = N // 2
    options = _skinny_launch_options(M, weight, tile)
    (w, scales, zeros, stride_wn, stride_sn), formats = weight_arguments(weight)
    out = torch.empty((M, inter), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(inter, options["BLOCK_N"] // 2)
    partials, counters, k_share = _skinny_split("skinny_gemm_silu_and_mul", M, N, K, tiles, options, out)
    _jit(_skinny_silu_and_mul_kernel, ("M",))[(tiles, options["SPLIT_K"])](
        x,
        w,
        scales,
        zeros,
        out,
        partials,
        counters,
        M,
        inter,
        K,
        k_share,
        x.stride(0),
        stride_wn,
        stride_sn,
        out.stride(0),
        **formats,
        **options,
    )
    return out


def _skinny_silu_and_mul_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, inter, K, K_SHARE, stride_xm,
                                stride_wn, stride_sn, stride_om, W_FORMAT: tl.constexpr, HAS_ZEROS: tl.constexpr,
                                GROUP: tl.constexpr, DOT_IN_FP32: tl.constexpr, EVEN_K: tl.constexpr,
                                W_FIRST: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PAIRS: tl.constexpr = BLOCK_N // 2
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    lanes = tl.arange(0, BLOCK_N)
    j = tl.program_id(0) * PAIRS + lanes % PAIRS  # the output column each W row feeds
    w_rows = j + (lanes // PAIRS) * inter  # the tile's first half gate rows j, its second the up rows I + j
    acc, last = _skinny_rows(x_ptr, w_ptr, s_ptr, z_ptr, part_ptr, count_ptr, w_rows, row_mask, j < inter, M, 2 * inter, K,
                             K_SHARE, stride_xm, stride_wn, stride_sn, W_FORMAT, HAS_ZEROS, GROUP, DOT_IN_FP32, EVEN_K,
                             W_FIRST, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K)
    if last:
        gate, up = tl.split(tl.permute(tl.reshape(acc.to(out_ptr.dtype.element_ty), [BLOCK_M, 2, PAIRS]), [0, 2, 1]))
        cols = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
        out = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out, fused_ops._silu_mul(gate, up), mask=row_mask[:, None] & (cols < inter)[None, :])


def skinny_gemm_rotary_and_store_kv(
    x: torch.Tensor,  # [M, K], 2 <= M <= 64, K contiguous
    weight: StreamedWeight,  # [(H + 2 KVH) D, K]: the q heads' rows, then k's, then v's; rows contiguous
    bias: Optional[torch.Tensor],  # [(H + 2 KVH) D] (Qwen2) or None
    cos: torch.Tensor,  # fp32 [max_positions, D/2], rows contiguous
    sin: torch.Tensor,
    positions: torch.Tensor,  # int [M], any order (tree nodes share and skip positions)
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [M]
    num_heads: int,
    **tile,
) -> torch.Tensor:
    """The qkv projection of M tokens, rotated and stored: `skinny_gemm(x, weight, bias)`
    split into q, k and v heads, then `fused_ops.rotary_and_store_kv`, bit for bit, in one
    kernel.

    Returns the rotated q [M, H, D]; k (rotated) and v go into the caches at
    ``slot_mapping``. Each program streams the skinny GEMM's BLOCK_N W rows as BLOCK_N/2
    rotary pairs: dimensions d0 .. d0 + BLOCK_N/2 of one head and the same ones + D/2, so
    BLOCK_N/2 must divide D/2 (`rotary_fits`). Positions and slots are read on the
    device: no host sync, graph-capturable.
    """
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"skinny_gemm_rotary_and_store_kv: x {tuple(x.shape)} and weight {tuple(weight.shape)} differ in K")
    num_kv_heads, head_dim = _check_qkv_and_caches("skinny_gemm_rotary_and_store_kv", weight, num_heads, k_cache, v_cache)
    options = _skinny_launch_options(M, weight, tile)
    block_n = options["BLOCK_N"]
    half = head_dim // 2
    if half % (block_n // 2):
        raise ValueError(f"skinny_gemm_rotary_and_store_kv: {block_n // 2} rotary pairs per program do not divide {half}")
    (w, scales, zeros, stride_wn, stride_sn), formats = weight_arguments(weight)
    q_out = torch.empty((M, num_heads, head_dim), dtype=x.dtype, device=x.device)
    partials, counters, k_share = _skinny_split("skinny_gemm_rotary_and_store_kv", M, N, K, N // block_n, options, q_out)
    _jit(_skinny_rotary_kv_kernel, ("M",))[(N // block_n, options["SPLIT_K"])](
        x,
        w,
        scales,
        zeros,
        bias if bias is not None else x,
        q_out,
        k_cache,
        v_cache,
        cos,
        sin,
        positions,
        slot_mapping,
        partials,
        counters,
        M,
        N,
        K,
        k_share,
        x.stride(0),
        stride_wn,
        stride_sn,
        cos.stride(0),
        sin.stride(0),
        num_heads,
        num_kv_heads,
        half,
        HAS_BIAS=bias is not None,
        **formats,
        **options,
    )
    return q_out


def _skinny_rotary_kv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr,
                             positions_ptr, slots_ptr, part_ptr, count_ptr, M, N, K, K_SHARE, stride_xm, stride_wn,
                             stride_sn, stride_cos, stride_sin, num_heads, num_kv_heads, half, HAS_BIAS: tl.constexpr,
                             W_FORMAT: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr,
                             DOT_IN_FP32: tl.constexpr, EVEN_K: tl.constexpr, W_FIRST: tl.constexpr,
                             SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program p owns dimensions d0 .. d0 + BLOCK_N/2 of one head (and their partners + D/2),
    counting the q heads, then the k heads, then the v heads, as the fused weight's rows
    are ordered."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    programs_per_head = half // PAIRS
    head = tl.program_id(0) // programs_per_head
    d0 = (tl.program_id(0) % programs_per_head) * PAIRS
    head_dim = 2 * half
    rows = tl.arange(0, BLOCK_M)  # tokens
    row_mask = rows < M
    lanes = tl.arange(0, BLOCK_N)
    w_rows = head * head_dim + d0 + lanes % PAIRS + (lanes // PAIRS) * half  # dims d0 + i, then their partners
    acc, last = _skinny_rows(x_ptr, w_ptr, s_ptr, z_ptr, part_ptr, count_ptr, w_rows, row_mask, lanes < BLOCK_N, M, N, K,
                             K_SHARE, stride_xm, stride_wn, stride_sn, W_FORMAT, HAS_ZEROS, GROUP, DOT_IN_FP32, EVEN_K,
                             W_FIRST, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
        x1, x2 = tl.split(tl.permute(tl.reshape(acc.to(x_ptr.dtype.element_ty), [BLOCK_M, 2, PAIRS]), [0, 2, 1]))
        dims = d0 + tl.arange(0, PAIRS)[None, :]
        mask = row_mask[:, None]
        # Each branch names its own pointers: Triton requires a name assigned in both branches of
        # an `if` to have one type, and a cache of another dtype than q's makes them differ.
        if head < num_heads + num_kv_heads:
            position = tl.load(positions_ptr + rows, mask=row_mask, other=0).to(tl.int64)[:, None]
            cos = tl.load(cos_ptr + position * stride_cos + dims, mask=mask, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + position * stride_sin + dims, mask=mask, other=0.0).to(tl.float32)
            first, second = fused_ops._rotate_half(x1, x2, cos, sin)
            if head < num_heads:
                q_dst = q_out_ptr + (rows.to(tl.int64)[:, None] * num_heads + head) * head_dim + dims
                tl.store(q_dst, first, mask=mask)
                tl.store(q_dst + half, second, mask=mask)
            else:
                slot = tl.load(slots_ptr + rows, mask=row_mask, other=0).to(tl.int64)[:, None]
                k_dst = k_cache_ptr + (slot * num_kv_heads + head - num_heads) * head_dim + dims
                cache_dtype = k_cache_ptr.dtype.element_ty
                tl.store(k_dst, first.to(cache_dtype), mask=mask)
                tl.store(k_dst + half, second.to(cache_dtype), mask=mask)
        else:
            value_slot = tl.load(slots_ptr + rows, mask=row_mask, other=0).to(tl.int64)[:, None]
            v_dst = v_cache_ptr + (value_slot * num_kv_heads + head - num_heads - num_kv_heads) * head_dim + dims
            value_dtype = v_cache_ptr.dtype.element_ty
            tl.store(v_dst, x1.to(value_dtype), mask=mask)
            tl.store(v_dst + half, x2.to(value_dtype), mask=mask)
