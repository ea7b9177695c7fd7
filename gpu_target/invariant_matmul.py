"""A batch-invariant GEMM for the GPU batch-invariant mode: row i of x W^T (+ b) comes out
bit for bit the same whatever the number of rows M and whatever the other rows hold.

cuBLAS (and gpu_target/gemv.py's dispatch) picks its kernel, tile and split-K by M, and a
split-K or another MMA shape sums an element's K products in another order. Here the
tile a function of N only, as in Thinking Machines' batch-invariant ops ("Defeating
Nondeterminism in LLM Inference", 2025) and the vLLM/SGLang modes adapted from them
(``VLLM_BATCH_INVARIANT``): each element is summed over the whole K range, with no split-K,
by one MMA of 16 rows per K tile. It is gemv.py's skinny GEMM (`_skinny_w_tile`,
`_skinny_accumulate`) with the rows in blocks of 16: a program owns up to ROW_BLOCKS of them
(`max_row_blocks`, 2 or 4 by N) and BLOCK_N columns, loads each W tile once and multiplies every row block
with it, each into its own accumulator. An element's sum is then the same sequence of MMA
instructions for every M; M only changes how many row blocks a program and the grid hold.
A one-row decode computes 16 rows, not the 128 of those projects' persistent kernel, and a
batch-64 step reads each W tile once or twice, not four times.

Under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) `_skinny_accumulate` sums exact
fp32 products per element instead of calling ``tl.dot`` (gemv.py's ``_interpreting``); the
sum order is again the same for every row.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from gpu_target import fused_ops, gemv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = tl = None

BLOCK_M = 16  # rows per MMA: tl.dot's minimum
WIDE_N = 16384  # from this many columns a program takes four row blocks; below, two


def max_row_blocks(n: int) -> int:
    """Row blocks a program may own: four (64 rows) where N's column tiles alone fill the
    GPU's SMs, two where fewer programs would leave SMs idle."""
    return 4 if n >= WIDE_N else 2


def tile_for(n: int, m: int) -> dict:
    """The kernel's tile and launch options for [m, K] x W^T with N columns. The tile (and so
    every element's sum) is a function of N only: skinny_tile's for as many rows as a program
    may own, whose K tile leaves shared memory for them; the row blocks per program and the
    pipeline depth follow M, which changes no sum."""
    most = max_row_blocks(n)
    tile = gemv.skinny_tile(n, BLOCK_M * most)
    row_blocks = min(most, triton.cdiv(m, BLOCK_M))
    return dict(BLOCK_M=BLOCK_M, ROW_BLOCKS=row_blocks, BLOCK_N=tile["block_n"], BLOCK_K=tile["block_k"],
                W_FIRST=tile["w_first"], num_warps=tile["num_warps"], num_stages=tile["num_stages"] if row_blocks <= 2 else 3)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] and weight [N, K] in one dtype, rounded to it; batch-invariant.

    On the GPU float32 inputs multiply in TF32 (``tl.dot``'s default), half precision exactly.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"invariant_linear needs x [M, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must have one dtype")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("invariant_linear needs a contiguous K in x and weight")
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tile = tile_for(n, m)
    (w, scales, zeros, stride_wn, stride_sn), formats = gemv.weight_arguments(weight)
    grid = (triton.cdiv(m, BLOCK_M * tile["ROW_BLOCKS"]), triton.cdiv(n, tile["BLOCK_N"]))
    _kernel()[grid](
        x, w, scales, zeros, weight if bias is None else bias, out,
        m, n, k, x.stride(0), stride_wn, stride_sn, out.stride(0),
        HAS_BIAS=bias is not None,
        DOT_IN_FP32=gemv._interpreting(),
        EVEN_K=k % tile["BLOCK_K"] == 0,
        **formats,
        **tile,
    )
    return out


@functools.lru_cache(maxsize=None)
def _kernel():
    fused_ops.jit_device_functions()  # gemv._skinny_w_tile, _skinny_accumulate, _skinny_result
    # M changes with the batch: not specialised on, so that its divisibility never picks
    # another compiled variant (it would not change the sums, but would compile more).
    return triton.jit(_invariant_matmul_kernel, do_not_specialize=("M",))


def _invariant_matmul_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    HAS_BIAS: tl.constexpr, DOT_IN_FP32: tl.constexpr, EVEN_K: tl.constexpr, W_FIRST: tl.constexpr,
    W_FORMAT: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, ROW_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Rows [pid0 * ROW_BLOCKS * BLOCK_M, +ROW_BLOCKS * BLOCK_M) by columns [pid1 * BLOCK_N, +BLOCK_N),
    over the whole K range: each W tile loaded once, multiplied into one accumulator per row block."""
    first_row = tl.program_id(0).to(tl.int64) * (ROW_BLOCKS * BLOCK_M)
    rows = first_row + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    x_tile = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    step = BLOCK_M * stride_xm
    acc0 = tl.zeros([BLOCK_N, BLOCK_M] if W_FIRST else [BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros_like(acc0)
    acc2 = tl.zeros_like(acc0)
    acc3 = tl.zeros_like(acc0)
    for start in range(0, K, BLOCK_K):
        w = gemv._skinny_w_tile(x_ptr, w_ptr, s_ptr, z_ptr, w_tile, cols, col_mask, start, K, stride_wn, stride_sn,
                                W_FORMAT, HAS_ZEROS, GROUP, EVEN_K, BLOCK_K)
        acc0 = gemv._skinny_accumulate(acc0, x_tile, w, rows < M, start, K, DOT_IN_FP32, EVEN_K, W_FIRST, BLOCK_K)
        if ROW_BLOCKS > 1:
            acc1 = gemv._skinny_accumulate(acc1, x_tile + step, w, rows + BLOCK_M < M, start, K, DOT_IN_FP32, EVEN_K,
                                           W_FIRST, BLOCK_K)
        if ROW_BLOCKS > 2:
            acc2 = gemv._skinny_accumulate(acc2, x_tile + 2 * step, w, rows + 2 * BLOCK_M < M, start, K, DOT_IN_FP32,
                                           EVEN_K, W_FIRST, BLOCK_K)
        if ROW_BLOCKS > 3:
            acc3 = gemv._skinny_accumulate(acc3, x_tile + 3 * step, w, rows + 3 * BLOCK_M < M, start, K, DOT_IN_FP32,
                                           EVEN_K, W_FIRST, BLOCK_K)
    _store_rows(acc0, s_ptr, bias_ptr, out_ptr, rows, cols, col_mask, M, stride_om, HAS_BIAS, W_FORMAT, W_FIRST)
    if ROW_BLOCKS > 1:
        _store_rows(acc1, s_ptr, bias_ptr, out_ptr, rows + BLOCK_M, cols, col_mask, M, stride_om, HAS_BIAS, W_FORMAT, W_FIRST)
    if ROW_BLOCKS > 2:
        _store_rows(acc2, s_ptr, bias_ptr, out_ptr, rows + 2 * BLOCK_M, cols, col_mask, M, stride_om, HAS_BIAS, W_FORMAT,
                    W_FIRST)
    if ROW_BLOCKS > 3:
        _store_rows(acc3, s_ptr, bias_ptr, out_ptr, rows + 3 * BLOCK_M, cols, col_mask, M, stride_om, HAS_BIAS, W_FORMAT,
                    W_FIRST)


@fused_ops.device_function
def _store_rows(acc, s_ptr, bias_ptr, out_ptr, rows, cols, col_mask, M, stride_om, HAS_BIAS: tl.constexpr,
                W_FORMAT: tl.constexpr, W_FIRST: tl.constexpr):
    """One row block's accumulator, scaled (FP8), biased and rounded into ``out``."""
    acc = gemv._skinny_result(acc, s_ptr, cols, col_mask, W_FORMAT, W_FIRST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_mask[None, :])
