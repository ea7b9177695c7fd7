"""A batch-invariant GEMM for the GPU batch-invariant mode: row i of x W^T (+ b) comes out
bit for bit the same whatever the number of rows M and whatever the other rows hold.

cuBLAS (and gpu_target/gemv.py's dispatch) picks its kernel, tile and split-K by M, and a
split-K or another MMA shape sums an element's K products in another order. Here the
launch configuration is a function of N only, as in Thinking Machines' batch-invariant ops
("Defeating Nondeterminism in LLM Inference", 2025) and the vLLM/SGLang modes adapted from
them (``VLLM_BATCH_INVARIANT``): every program owns 16 rows and BLOCK_N columns and walks
the whole K range, with no split-K. It is gemv.py's skinny GEMM (`_skinny_rows`, with
`skinny_tile`'s tile for 16 rows) with one more grid axis over M tiles: an element's sum is
the same sequence of MMA instructions for every M, and M only changes how many M tiles the
grid holds. A one-row decode computes 16 rows, not the 128 of those projects' persistent
kernel, and the M tiles are the grid's fastest axis, so the programs that share W tiles run
together and a batch-64 step reads W from memory about once.

Under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) `_skinny_rows` sums exact
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

BLOCK_M = 16  # rows per program: tl.dot's minimum


def tile_for(n: int) -> dict:
    """The kernel's tile and launch options for an N-column output: a function of N only, never of M."""
    tile = gemv.skinny_tile(n, BLOCK_M)
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=tile["block_n"], BLOCK_K=tile["block_k"], W_FIRST=tile["w_first"],
                num_warps=tile["num_warps"], num_stages=tile["num_stages"])


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
    tile = tile_for(n)
    (w, scales, zeros, stride_wn, stride_sn), formats = gemv.weight_arguments(weight)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, tile["BLOCK_N"]))
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
    fused_ops.jit_device_functions()  # gemv._skinny_rows
    # M changes with the batch: not specialised on, so that its divisibility never picks
    # another compiled variant (it would not change the sums, but would compile more).
    return triton.jit(_invariant_matmul_kernel, do_not_specialize=("M",))


def _invariant_matmul_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    HAS_BIAS: tl.constexpr, DOT_IN_FP32: tl.constexpr, EVEN_K: tl.constexpr, W_FIRST: tl.constexpr,
    W_FORMAT: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Rows [pid0 * BLOCK_M, +BLOCK_M) by columns [pid1 * BLOCK_N, +BLOCK_N), over the whole K range."""
    first_row = tl.program_id(0).to(tl.int64) * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = gemv._skinny_rows(x_ptr + first_row * stride_xm, w_ptr, s_ptr, z_ptr, cols, row_mask, col_mask, K, stride_xm,
                            stride_wn, stride_sn, W_FORMAT, HAS_ZEROS, GROUP, DOT_IN_FP32, EVEN_K, W_FIRST,
                            BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
