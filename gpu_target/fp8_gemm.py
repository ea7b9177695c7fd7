"""W8A8 products of an FP8 weight: x quantised per token at run time, then FP8 x FP8 on the tensor cores.

vLLM's `quantization="fp8"` runs every batch size this way (vllm/model_executor/layers/quantization/fp8.py,
`Fp8LinearMethod.apply`, through utils/w8a8_utils.py's `Fp8LinearOp`): dynamic per-token activation
scales (`ops.scaled_fp8_quant(..., use_per_token_if_dynamic=True)`), then `torch._scaled_mm` or
CUTLASS with the weight's per-channel scales.

- `quantize_per_token`: one Triton kernel, a program per row: the row's amax, its scale
  amax / 448 as float32 on the device (no host sync: graph-capturable), x / scale saturated and
  rounded to E4M3 (nearest even), as `quantize_per_token_reference` computes it in torch.
- `scaled_mm`: that, then `torch._scaled_mm` with row-wise scales (cuBLASLt).
- `w8a8_gemm`: that, then a Triton FP8 `tl.dot` GEMM for 2..64 rows whose epilogue applies the
  token and channel scales (and the bias) to the fp32 sums. Its programs each own BLOCK_N rows
  of W and a 1/SPLIT_K share of K, so a narrow W still covers the SMs and each program reads
  only its share of x (every program reads all of x's rows: with one share, x's bytes summed
  over the programs exceed W's). Split programs store fp32 partials; the last of a column
  tile to finish (an atomic counter that program resets, as Marlin's workspace locks are)
  sums them in split order, so the result does not depend on which finishes last.

Tiles come from gpu_target/gemv_tiles.py (`w8a8_tile`); which kernel a row count takes is
gpu_target/quantization/linear.py's rule.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from gpu_target import fused_ops, gemv_tiles
from gpu_target.fused_ops import device_function
from gpu_target.gemv import MAX_SPLIT_TILES, _interpreting, skinny_block_m, split_counters
from gpu_target.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Weight

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = tl = None

QUANT_BLOCK_K = 16384  # a row this long is loaded once (Llama-3-8B's widest input: 14336)


def quantize_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 [M, K], scales float32 [M, 1]) with x ~= x_fp8 * scales, in torch ops."""
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal (1 ulp off IEEE).
    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32, device=x.device)
    scales = (x.abs().amax(dim=1, keepdim=True).float() / fp8_max).clamp(min=MIN_SCALE)
    return (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token_reference` in one kernel (the same scales and codes, bit for bit)."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    codes = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block_k = min(QUANT_BLOCK_K, triton.next_power_of_2(k))
    _jit(_quantize_per_token_kernel)[(m,)](x, codes, scales, k, x.stride(0), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
                                          ROUND_IN_FP32=_interpreting(), BLOCK_K=block_k,
                                          num_warps=min(16, max(4, block_k // 512)))
    return codes, scales


@functools.lru_cache(maxsize=None)
def _jit(kernel):
    fused_ops.jit_device_functions()
    return triton.jit(kernel, do_not_specialize=("M",) if kernel is _w8a8_gemm_kernel else ())


def _quantize_per_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                               ROUND_IN_FP32: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program r quantises row r: its amax, then its codes. A row of at most BLOCK_K columns
    is loaded once and kept in registers; a longer one is read twice, BLOCK_K at a time."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
    amax = tl.abs(x)
    for start in range(BLOCK_K, K, BLOCK_K):
        more = tl.load(x_ptr + row * stride_xm + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(more))
    scale = _token_scale(tl.max(amax, axis=0), FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row, scale)
    for start in range(0, K, BLOCK_K):
        if start > 0:
            x = tl.load(x_ptr + row * stride_xm + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * K + start + cols, _e4m3_codes(x, scale, q_ptr, FP8_MAX, ROUND_IN_FP32), mask=start + cols < K)


@device_function
def _token_scale(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A row's scale from its amax: amax / 448 (IEEE division, as torch's), at least MIN_SCALE.
    Shared with the kernels that emit their output quantised (gpu_target/fp8_activations.py)."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)


@device_function
def _e4m3_codes(x, scale, q_ptr, FP8_MAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """x (fp32) / scale saturated to +-448 and rounded to q_ptr's E4M3 type, nearest even."""
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    if ROUND_IN_FP32:
        v = _round_to_e4m3(v)
    return v.to(q_ptr.dtype.element_ty)


@device_function
def _round_to_e4m3(v):
    """v (|v| <= 448) rounded to the nearest E4M3 value, ties to even, in fp32. Only under
    Triton's interpreter, whose fp32 -> E4M3 cast carries a rounded-up mantissa wrongly
    (126.25 became 64); it casts exact E4M3 values right. Normal values keep 3 mantissa
    bits (an integer add on the bits); below 2^-6 the step is 2^-9 (an fp32 add of 1.5 * 2^23)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = ((v * 512.0 + 12582912.0) - 12582912.0) / 512.0
    return tl.where(tl.abs(v) >= 0.015625, normal, subnormal)


def scaled_mm_applies(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """`torch._scaled_mm` with row-wise scales: CUDA, bf16 output, K and N multiples of 16."""
    n, k = weight.shape
    return x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and k % 16 == 0 and n % 16 == 0


def scaled_mm(x: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x W^T (+ bias) in W8A8: `quantize_per_token`, then `torch._scaled_mm`."""
    codes, scales = quantize_per_token(x)
    return scaled_mm_quantized(codes, scales, weight, bias, x.dtype)


def scaled_mm_quantized(codes: torch.Tensor, x_scales: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor],
                        out_dtype: torch.dtype) -> torch.Tensor:
    """The product of `scaled_mm` on already quantised rows (codes [M, K], x_scales float32 [M, 1])."""
    out = torch._scaled_mm(codes, weight.qweight.t(), scale_a=x_scales, scale_b=weight.scales.view(1, -1),
                           out_dtype=out_dtype)
    return out if bias is None else out + bias  # added apart: not every build takes a bias with row-wise scales


def w8a8_gemm(x: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor] = None, **tile) -> torch.Tensor:
    """x W^T (+ bias) in W8A8 for 2..64 rows: `quantize_per_token`, then the Triton FP8 GEMM;
    ``tile`` (block_n, block_k, split_k, num_warps, num_stages) overrides gemv_tiles.py's."""
    codes, scales = quantize_per_token(x)
    return w8a8_gemm_quantized(codes, scales, weight, bias, x.dtype, **tile)


def w8a8_gemm_quantized(codes: torch.Tensor, x_scales: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor],
                        out_dtype: torch.dtype, **tile) -> torch.Tensor:
    """The GEMM of `w8a8_gemm` on already quantised rows (codes [M, K], x_scales float32 [M, 1])."""
    m, k = codes.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"w8a8_gemm: x {tuple(codes.shape)} and weight {tuple(weight.shape)} differ in K")
    block_m = skinny_block_m(m)
    tile = {**gemv_tiles.w8a8_tile(n, k, block_m), **tile}
    split_k, block_n, block_k = tile["split_k"], tile["block_n"], tile["block_k"]
    tiles_n = triton.cdiv(n, block_n)
    if split_k > 1 and tiles_n > MAX_SPLIT_TILES:
        raise ValueError(f"w8a8_gemm: {tiles_n} column tiles exceed the {MAX_SPLIT_TILES} split-K counters")
    k_share = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k  # each split's K, whole tiles
    out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    partials = torch.empty((split_k, m, n), dtype=torch.float32, device=codes.device) if split_k > 1 else out
    counters = split_counters(codes.device) if split_k > 1 else x_scales
    _jit(_w8a8_gemm_kernel)[(tiles_n, split_k)](
        codes, weight.qweight, x_scales, weight.scales, bias if bias is not None else out, out, partials, counters,
        m, n, k, k_share, codes.stride(0), weight.qweight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"],
    )
    return out


def _w8a8_gemm_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SHARE, stride_xm,
                      stride_wn, stride_om, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out^T = W x^T, so W's BLOCK_N rows fill the MMA's large dimension and the tokens its
    small one; both operands are read K-major, as FP8 MMAs need them."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = split * K_SHARE
    k_end = tl.minimum(k_start + K_SHARE, K)
    for start in range(k_start, k_end, BLOCK_K):
        k_mask = (start + ks) < k_end
        x = tl.load(x_tile + start, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_tile + start, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        # Hopper's FP8 MMA adds products at reduced precision (~14 bits, DeepSeek-V3 report,
        # section 3.3.2), and Triton lets it run over all of K by default on sm_90; the partial
        # sum of each BLOCK_K columns is added in fp32 instead, as DeepSeek and cuBLAS without
        # fast accumulation do.
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K)
    acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    mask = row_mask[:, None] & col_mask[None, :]
    tile_offsets = rows[:, None] * N + cols[None, :]
    if SPLIT_K > 1:
        tl.store(part_ptr + split * M * N + tile_offsets, acc, mask=mask)
        # Every thread's partials, then one release at GPU scope (cumulative, as CUTLASS's
        # semaphore: __syncthreads, then the atomic); the last program acquires them all.
        tl.debug_barrier()
        finished = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if finished == SPLIT_K - 1:  # the last split of this column tile: sum the partials in split order
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, SPLIT_K):
                acc += tl.load(part_ptr + s * M * N + tile_offsets, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid_n, 0)
            _w8a8_epilogue(acc, xs_ptr, ws_ptr, bias_ptr, out_ptr, rows, cols, row_mask, col_mask, stride_om, HAS_BIAS)
    else:
        _w8a8_epilogue(acc, xs_ptr, ws_ptr, bias_ptr, out_ptr, rows, cols, row_mask, col_mask, stride_om, HAS_BIAS)


@device_function
def _w8a8_epilogue(acc, xs_ptr, ws_ptr, bias_ptr, out_ptr, rows, cols, row_mask, col_mask, stride_om,
                   HAS_BIAS: tl.constexpr):
    """The fp32 sums times each token's and each channel's scale (+ bias), rounded to out's dtype."""
    acc *= tl.load(xs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    acc *= tl.load(ws_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])
