"""Weight-only Triton kernels for quantised weights: GEMV (1 row) and skinny GEMM (2..64 rows).

They are gpu_target/gemv.py's `gemv` and `skinny_gemm` (same programs, tiles and K loops;
see that module for why these shapes stream W well) with the weight tile dequantised in
registers by `_dequantized_tile`: FP8 E4M3 codes converted to the compute dtype (the
per-channel scale multiplies each output once, after the K loop), or 4-bit codes unpacked
from their byte and mapped to (q - z) * s of their group. The bytes streamed are the
quantised ones, which is the point: at these row counts the time is reading W.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from gpu_target import gemv
from gpu_target.fused_ops import device_function
from gpu_target.quantization.fp8 import Fp8Weight
from gpu_target.quantization.int4 import Int4Weight

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = tl = None

QuantizedWeight = Union[Fp8Weight, Int4Weight]


def streaming_applies(x: torch.Tensor) -> bool:
    """1..64 rows of half-precision activations with contiguous K, on CUDA (or interpreted; see gemv)."""
    return (
        triton is not None
        and (x.is_cuda or (gemv._stream_cpu_tensors_when_interpreting and gemv._interpreting()))
        and x.dim() == 2
        and 1 <= x.shape[0] <= gemv.MAX_STREAMING_ROWS
        and x.dtype in gemv.STREAMING_DTYPES
        and x.stride(1) == 1
    )


def _format_arguments(weight: QuantizedWeight) -> tuple:
    """(codes, scales, zeros, codes' row stride, scales' row stride) and the format constexprs."""
    if isinstance(weight, Fp8Weight):
        return (weight.qweight, weight.scales, weight.scales, weight.qweight.stride(0), 0), dict(
            INT4=False, HAS_ZEROS=False, GROUP=1
        )
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    return (weight.qweight, weight.scales, zeros, weight.qweight.stride(0), weight.scales.stride(0)), dict(
        INT4=True, HAS_ZEROS=weight.zeros is not None, GROUP=weight.group_size
    )


def quantized_gemv(
    x: torch.Tensor,  # [1, K]
    weight: QuantizedWeight,  # [N, K]
    bias: Optional[torch.Tensor] = None,
    *,
    block_n: int = 2,
    block_k: int = gemv.GEMV_BLOCK_K,
    num_warps: int = gemv.GEMV_NUM_WARPS,
    num_stages: int = gemv.GEMV_NUM_STAGES,
) -> torch.Tensor:
    """[1, N] = x W^T (+ bias) in x's dtype, W dequantised in registers (gemv.gemv's tile)."""
    n, k = weight.shape
    tensors, formats = _format_arguments(weight)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    gemv._jit(_quantized_gemv_kernel)[(triton.cdiv(n, block_n),)](
        x, *tensors[:3], bias if bias is not None else out, out, n, k, *tensors[3:],
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        **formats,
    )
    return out


def _quantized_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, N, K, stride_qn, stride_sn,
                           INT4: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + cols
        k_mask = k < K
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        w = _dequantized_tile(x_ptr, q_ptr, s_ptr, z_ptr, rows, row_mask, start, K, stride_qn, stride_sn, INT4, HAS_ZEROS,
                              GROUP, BLOCK_K)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if not INT4:
        y *= tl.load(s_ptr + rows, mask=row_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@device_function
def _dequantized_tile(x_ptr, q_ptr, s_ptr, z_ptr, rows, row_mask, start, K, stride_qn, stride_sn, INT4: tl.constexpr,
                      HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[rows, start:start + BLOCK_K] in x's dtype (0 where masked): FP8 codes as they are (their
    row scale applies after the K loop), or 4-bit codes as (q - z) * s of their group, rounded
    once from float32 as `Int4Weight.dequantize` rounds them. A 4-bit tile reads each byte
    once: its low and high nibbles (columns 2j and 2j + 1) are dequantised apart, then interleaved."""
    w_rows = rows.to(tl.int64)[:, None] * stride_qn
    if INT4:
        pairs = start // 2 + tl.arange(0, BLOCK_K // 2)  # K is even: a pair is in or out whole
        mask = row_mask[:, None] & (pairs < K // 2)[None, :]
        packed = tl.load(q_ptr + w_rows + pairs[None, :], mask=mask, other=0)
        groups = rows.to(tl.int64)[:, None] * stride_sn + (2 * pairs // GROUP)[None, :]  # G is even: one group per pair
        scale = tl.load(s_ptr + groups, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(z_ptr + groups, mask=mask, other=0).to(tl.float32)
        else:
            zero = 8.0  # int4.SYMMETRIC_ZERO (a kernel reads no module globals)
        low = (((packed & 15).to(tl.float32) - zero) * scale).to(x_ptr.dtype.element_ty)
        high = (((packed >> 4).to(tl.float32) - zero) * scale).to(x_ptr.dtype.element_ty)
        w = tl.interleave(low, high)
    else:
        k = start + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (k < K)[None, :]
        w = tl.load(q_ptr + w_rows + k[None, :], mask=mask, other=0.0).to(x_ptr.dtype.element_ty)
    return w


def quantized_skinny_gemm(
    x: torch.Tensor,  # [M, K], 2 <= M <= 64, K contiguous
    weight: QuantizedWeight,  # [N, K]
    bias: Optional[torch.Tensor] = None,
    **tile,
) -> torch.Tensor:
    """[M, N] = x W^T (+ bias) in x's dtype, streaming W once (gemv.skinny_gemm's programs and
    tile, `gemv.skinny_tile`, which ``tile`` overrides), W dequantised in registers."""
    m, k = x.shape
    n = weight.shape[0]
    options = gemv._skinny_launch_options(m, k, n, tile)
    options.pop("EVEN_K")  # the dequantised tile is always masked
    tensors, formats = _format_arguments(weight)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    gemv._jit(_quantized_skinny_kernel, ("M",))[(triton.cdiv(n, options["BLOCK_N"]),)](
        x, *tensors[:3], bias if bias is not None else out, out, m, n, k, x.stride(0), *tensors[3:], out.stride(0),
        HAS_BIAS=bias is not None, **formats, **options,
    )
    return out


def _quantized_skinny_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_sn,
                             stride_om, INT4: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr,
                             HAS_BIAS: tl.constexpr, DOT_IN_FP32: tl.constexpr, W_FIRST: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)  # rows of x (tokens)
    row_mask = rows < M
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = rows of W
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M] if W_FIRST else [BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + ks
        k_mask = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = _dequantized_tile(x_ptr, q_ptr, s_ptr, z_ptr, cols, col_mask, start, K, stride_qn, stride_sn, INT4, HAS_ZEROS,
                              GROUP, BLOCK_K)
        if DOT_IN_FP32:  # Triton's interpreter (see gemv._interpreting): exact products, summed per element
            x, w = x.to(tl.float32), w.to(tl.float32)
            if W_FIRST:
                acc += tl.sum(w[:, None, :] * x[None, :, :], axis=2)
            else:
                acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        elif W_FIRST:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if W_FIRST:
        acc = tl.trans(acc)
    if not INT4:
        acc *= tl.load(s_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
