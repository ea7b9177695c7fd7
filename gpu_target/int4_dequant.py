"""A 4-bit weight dequantised whole, in one Triton pass, for the rows the streaming kernels do not take.

Above gemv.MAX_STREAMING_ROWS rows (prefill, large batches) W is reused enough that cuBLAS's
tiled GEMM on a dequantised copy is the fast path, as vLLM's AWQ method runs its large
batches (`awq_dequantize`, then a matmul: vllm/model_executor/layers/quantization/awq.py).
The copy's cost is then one pass over W: the packed codes, group scales and zero points in,
W in x's dtype out. `dequantize` gives each element as `Int4Weight.dequantize_stored`
computes it ((code - zero) * scale in float32, rounded once), so both paths give the same
weights; each program's K tile lies in one group (`gemv.int4_block_k`), so its scales and
zero points are one load per row.
"""
from __future__ import annotations

import functools

import torch

from gpu_target.gemv import _interpreting, int4_block_k
from gpu_target.quantization.int4 import SYMMETRIC_ZERO, Int4Weight

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = tl = None

BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4

# Tests set this (monkeypatch) to run CPU tensors through the kernel under Triton's interpreter.
_run_cpu_tensors_when_interpreting = False


def kernel_applies(weight: Int4Weight) -> bool:
    """Whether `dequantize` runs the Triton kernel for this weight (CUDA), not torch."""
    return triton is not None and (weight.qweight.is_cuda or (_run_cpu_tensors_when_interpreting and _interpreting()))


def dequantize(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """W_stored [N, K] in ``dtype`` (columns in stored order): the Triton kernel on CUDA,
    `Int4Weight.dequantize_stored` elsewhere."""
    if not kernel_applies(weight):
        return weight.dequantize_stored(dtype)
    n, k = weight.shape
    block_k = int4_block_k(BLOCK_K, weight.group_size, whole_groups=False)
    out = torch.empty((n, k), dtype=dtype, device=weight.qweight.device)
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    _jit()[(triton.cdiv(n, BLOCK_N), triton.cdiv(k, block_k))](
        weight.qweight, weight.scales, zeros, out, n, k, weight.qweight.stride(0), weight.scales.stride(0),
        zeros.stride(0), out.stride(0), HAS_ZEROS=weight.zeros is not None, IMPLICIT_ZERO=SYMMETRIC_ZERO,
        GROUP=weight.group_size, BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=NUM_WARPS)
    return out


@functools.lru_cache(maxsize=None)
def _jit():
    return triton.jit(_dequantize_kernel)


def _dequantize_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_qn, stride_sn, stride_zn, stride_on,
                       HAS_ZEROS: tl.constexpr, IMPLICIT_ZERO: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    start = tl.program_id(1) * BLOCK_K
    pairs = start // 2 + tl.arange(0, BLOCK_K // 2)  # byte j holds columns 2j (low nibble) and 2j + 1
    row_mask = rows < N
    mask = row_mask[:, None] & (pairs < K // 2)[None, :]
    packed = tl.load(q_ptr + rows[:, None] * stride_qn + pairs[None, :], mask=mask, other=0)
    codes = tl.interleave(packed & 15, packed >> 4).to(tl.float32)
    group = start // GROUP  # the tile lies in one group
    scale = tl.load(s_ptr + rows * stride_sn + group, mask=row_mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + rows * stride_zn + group, mask=row_mask, other=0).to(tl.float32)
    else:
        zero = tl.full([BLOCK_N], IMPLICIT_ZERO, tl.float32)
    weight = (codes - zero[:, None]) * scale[:, None]
    columns = start + tl.arange(0, BLOCK_K)
    out = out_ptr + rows[:, None] * stride_on + columns[None, :]
    tl.store(out, weight.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (columns < K)[None, :])
