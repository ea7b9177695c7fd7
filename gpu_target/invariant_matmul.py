"""A batch-invariant GEMM for the GPU batch-invariant mode: row i of x W^T (+ b) comes out
bit for bit the same whatever the number of rows M and whatever the other rows hold.

cuBLAS (and gpu_target/gemv.py's dispatch) picks its kernel, tile and split-K by M, and a
split-K or another MMA shape sums an element's K products in another order. Here the
launch configuration is a function of (N, K) only, as in Thinking Machines' batch-invariant
ops ("Defeating Nondeterminism in LLM Inference", 2025) and the vLLM/SGLang modes adapted
from them (``VLLM_BATCH_INVARIANT``): every program owns a [BLOCK_M, BLOCK_N] output tile
and walks the whole K range in BLOCK_K steps, accumulating ``tl.dot`` in fp32, with no
split-K. An element's sum is then the same sequence of MMA instructions for every M; M only
changes how many M tiles the grid holds. BLOCK_M is the 16 rows ``tl.dot`` needs at least,
so a one-row decode computes 16 rows, not 128 as the persistent kernel of those projects
does, and BLOCK_N is narrow so that a decode step's few columns still spread over the SMs.
The M tiles are the grid's fastest axis: the programs that share a W tile run together and
a batch-64 step reads W from memory about once.

Under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) the tile products are
widened to fp32 and summed per element instead of ``tl.dot``, for the reasons
gpu_target/gemv.py's ``_interpreting`` gives; the sum order is again the same for every row.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = tl = None

BLOCK_M = 16  # rows per program: tl.dot's minimum
BLOCK_K = 128
WIDE_N = 8192  # wider matrices (gate_up, the LM head) take BLOCK_N 64, narrower ones 32


def tile_for(n: int) -> dict:
    """The launch configuration for an N-column output: it depends on N only, never on M."""
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=64 if n > WIDE_N else 32, BLOCK_K=BLOCK_K, num_warps=4, num_stages=4)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] and weight [N, K] in one dtype, rounded to it; batch-invariant."""
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
    grid = (triton.cdiv(m, tile["BLOCK_M"]), triton.cdiv(n, tile["BLOCK_N"]))
    _kernel()[grid](
        x, weight, weight if bias is None else bias, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        DOT_IN_FP32=_interpreting(),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **tile,
    )
    return out


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _kernel():
    # M, N and K change with the batch and the matrix: not specialised on, so that M's
    # divisibility never picks another compiled variant (it would not change the sums, but
    # would compile a variant per (M == 1, M % 16 == 0) case).
    return triton.jit(_invariant_matmul_kernel, do_not_specialize=("M",))


def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile over the whole K range, in BLOCK_K steps."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_IN_FP32:
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
