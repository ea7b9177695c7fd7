"""Batch-1 linear layers as a Triton GEMV: y = x W^T (+ b) for a single row x.

At batch-1 decode every projection is a matrix-vector product bound by reading W once.
cuBLAS picks split-K GEMM kernels for these shapes that stream W at 2.4-2.7 TB/s on an
H100 and add a reduction kernel per call; a plain GEMV whose programs each own a few
output rows and stream them whole needs no reduction and keeps more loads in flight.

Each program accumulates a [BLOCK_N, BLOCK_K] tile of fp32 products and reduces it once
at the end, so the inner loop is loads and FMAs only. The result is rounded to the
input dtype, as cuBLAS rounds its fp32 accumulator.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = tl = None

GEMV_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _jit(kernel: Callable) -> Callable:
    return triton.jit(kernel)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row on a CUDA device, half-precision weights, a contiguous K dimension."""
    return (
        triton is not None
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in GEMV_DTYPES
        and weight.dtype == x.dtype
        and weight.stride(1) == 1
        and x.stride(1) == 1
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, through the GEMV where it applies."""
    if gemv_applies(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def gemv(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [N, K], rows contiguous
    bias: Optional[torch.Tensor] = None,  # [N]
    *,
    block_n: int = 2,
    block_k: int = 2048,
    num_warps: int = 8,
    num_stages: int = 1,
) -> torch.Tensor:
    """[1, N] = x W^T (+ bias), in x's dtype.

    The default tile was the fastest of a sweep (block_n 1-16, block_k 256-4096, 4/8 warps,
    1-4 stages) on an H100 for every Llama-3-8B projection and its LM head: 2.6-3.2 TB/s
    against cuBLAS's 2.1-2.9 (`python -m bench.gemv --sweep`, bench/results/gemv-*).
    """
    N, K = weight.shape
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    _jit(_gemv_kernel)[(triton.cdiv(N, block_n),)](
        x,
        weight,
        bias if bias is not None else out,
        out,
        N,
        K,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_wn, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + cols
        k_mask = k < K
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)
