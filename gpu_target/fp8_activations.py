"""RMSNorm and SiLU-and-mul that emit their output quantised per token to E4M3, for W8A8 projections.

On the W8A8 path (gpu_target/quantization/linear.py's `w8a8_path`) a projection's input is
quantised per token before the FP8 GEMM. Where that input is RMSNorm's output (qkv_proj,
gate_up_proj) or SiLU-and-mul's (down_proj), the op's kernel quantises its row itself and
stores the E4M3 codes and the row's float32 scale instead of the model-dtype row: one kernel
instead of two, as vLLM's `rms_norm_dynamic_per_token_quant` (csrc/quantization/fused_kernels/
fused_layernorm_dynamic_per_token_quant.cu) and its SiLU-and-mul + FP8 quant fusion do.

Codes and scales equal `fp8_gemm.quantize_per_token` of the unfused op's output bit for bit:
the row is computed by the unfused kernel's device function (`fused_ops._add_rms_norm_row`,
launched with the same block and warps so the squares sum alike; `fused_ops._silu_mul`),
rounded to the model dtype, then scaled and rounded by fp8_gemm's device functions
(`_token_scale`, `_e4m3_codes`). The kernels size their grids from shapes only and allocate
fresh outputs: CUDA-graph safe.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from gpu_target import fp8_gemm, fused_ops
from gpu_target.gemv import _interpreting
from gpu_target.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = tl = None


class Fp8Rows(NamedTuple):
    """Rows quantised per token: x ~= codes * scales, for a W8A8 projection whose output has x's dtype."""

    codes: torch.Tensor  # E4M3 [M, K]
    scales: torch.Tensor  # float32 [M, 1]
    dtype: torch.dtype  # the model dtype the rows had


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """`quantize_per_token(fused_ops.rms_norm(x, weight, eps))` in one kernel."""
    return _launch_rms_norm_fp8(x, None, weight, eps)[0]


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[Fp8Rows, torch.Tensor]:
    """(`quantize_per_token` of the normed rows, x + residual) of `fused_ops.add_rms_norm`, in one kernel."""
    return _launch_rms_norm_fp8(x, residual, weight, eps)


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Rows:
    """`quantize_per_token(fused_ops.silu_and_mul(x))` in one kernel, for x = [gate | up] [M, 2I]."""
    rows = x.reshape(-1, x.shape[-1])
    inter = rows.shape[1] // 2
    codes = torch.empty((rows.shape[0], inter), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((rows.shape[0], 1), dtype=torch.float32, device=x.device)
    if rows.shape[0] > 0:
        block = min(fp8_gemm.QUANT_BLOCK_K, triton.next_power_of_2(inter))
        fused_ops._jit(_silu_and_mul_fp8_kernel)[(rows.shape[0],)](
            rows, codes, scales, inter, rows.stride(0), rows.stride(1), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
            ROUND_IN_FP32=_interpreting(), BLOCK=block, num_warps=min(16, max(4, block // 512)))
    return Fp8Rows(codes, scales, x.dtype)


def _launch_rms_norm_fp8(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                         eps: float) -> tuple[Fp8Rows, Optional[torch.Tensor]]:
    hidden = x.shape[-1]
    if torch.promote_types(weight.dtype, x.dtype) != x.dtype:
        raise ValueError(f"rms_norm_fp8: a {weight.dtype} weight would norm {x.dtype} rows into {weight.dtype}")
    rows = x.reshape(-1, hidden)
    codes = torch.empty((rows.shape[0], hidden), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((rows.shape[0], 1), dtype=torch.float32, device=x.device)
    residual_rows, new_residual, new_residual_rows = fused_ops.residual_buffers(x, residual, rows)
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        fused_ops._jit(_rms_norm_fp8_kernel)[(rows.shape[0],)](
            rows, residual_rows, weight, codes, scales, new_residual_rows, hidden, eps, rows.stride(0), rows.stride(1),
            residual_rows.stride(0), residual_rows.stride(1), weight.stride(0), HAS_RESIDUAL=residual is not None,
            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, ROUND_IN_FP32=_interpreting(), BLOCK=block,
            num_warps=fused_ops._num_warps(block))  # fused_ops.rms_norm's warps: the same sum of squares
    return Fp8Rows(codes, scales, x.dtype), new_residual


def _rms_norm_fp8_kernel(x_ptr, residual_ptr, weight_ptr, q_ptr, s_ptr, new_residual_ptr, hidden, eps, stride_x_row,
                         stride_x_col, stride_res_row, stride_res_col, stride_w, HAS_RESIDUAL: tl.constexpr,
                         FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Program r norms row r as fused_ops' kernel does, rounds it to the model dtype, and
    stores its scale and codes."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    out = fused_ops._add_rms_norm_row(x_ptr, residual_ptr, weight_ptr, new_residual_ptr, row, cols, hidden, eps,
                                      stride_x_row, stride_x_col, stride_res_row, stride_res_col, stride_w, HAS_RESIDUAL)
    out = out.to(x_ptr.dtype.element_ty).to(tl.float32)
    scale = fp8_gemm._token_scale(tl.max(tl.abs(out), axis=0), FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row, scale)
    tl.store(q_ptr + row * hidden + cols, fp8_gemm._e4m3_codes(out, scale, q_ptr, FP8_MAX, ROUND_IN_FP32),
             mask=cols < hidden)


def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, inter, stride_row, stride_col, FP8_MAX: tl.constexpr,
                             MIN_SCALE: tl.constexpr, ROUND_IN_FP32: tl.constexpr, BLOCK: tl.constexpr):
    """Program r quantises SiLU(gate) * up of row r, as fp8_gemm's quantisation kernel does a
    row: at most BLOCK columns computed once and kept in registers, a longer row computed
    twice (for its amax, then for its codes), BLOCK at a time."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    gate_ptrs = x_ptr + row * stride_row + cols * stride_col
    up_ptrs = gate_ptrs + inter * stride_col
    mask = cols < inter
    v = fused_ops._silu_mul(tl.load(gate_ptrs, mask=mask, other=0.0), tl.load(up_ptrs, mask=mask, other=0.0))
    v = v.to(tl.float32)
    amax = tl.abs(v)
    for start in range(BLOCK, inter, BLOCK):
        mask = start + cols < inter
        more = fused_ops._silu_mul(tl.load(gate_ptrs + start * stride_col, mask=mask, other=0.0),
                                   tl.load(up_ptrs + start * stride_col, mask=mask, other=0.0))
        amax = tl.maximum(amax, tl.abs(more.to(tl.float32)))
    scale = fp8_gemm._token_scale(tl.max(amax, axis=0), FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row, scale)
    for start in range(0, inter, BLOCK):
        mask = start + cols < inter
        if start > 0:
            v = fused_ops._silu_mul(tl.load(gate_ptrs + start * stride_col, mask=mask, other=0.0),
                                    tl.load(up_ptrs + start * stride_col, mask=mask, other=0.0)).to(tl.float32)
        tl.store(q_ptr + row * inter + start + cols, fp8_gemm._e4m3_codes(v, scale, q_ptr, FP8_MAX, ROUND_IN_FP32),
                 mask=mask)
