"""The model's small elementwise ops, each one kernel on the GPU: RMSNorm (alone and fused
with the residual add), rotary embedding of q and k fused with the KV-cache write, and
SiLU-and-multiply.

At batch-1 decode these ops move few bytes but, written in plain torch, cost ~25 kernel
launches per layer (RMSNorm alone is float/pow/mean/rsqrt/mul/to/mul), each a few µs of
GPU time even inside a CUDA graph. Each op here has:

* a plain-torch reference that reproduces HF transformers' rounding exactly; it is the
  CPU path (so CPU greedy outputs stay identical to HF) and the tests' oracle;
* a Triton kernel, used for CUDA tensors, that rounds at the same points as the
  reference (only fp32 reduction order and FMA contraction may differ).

At batch-1 decode and batch-1 tree verification the rotary + KV write and SiLU-and-mul
kernels do not run: gemv.py's fused GEMVs and skinny GEMMs apply the same math in the qkv
and gate_up projections' epilogues, two fewer kernels per layer. They share it through
device functions (`_rotate_half`, `_silu_mul`), so both paths round and contract to FMAs
alike and stay bit-identical; the kernels here serve the other multi-row steps (prefill,
batched decode, and whatever rows the skinny GEMM does not take).

Every op takes ``use_triton``: ``None`` picks Triton for CUDA tensors when Triton is
installed, ``True`` forces the kernel (on CPU tensors it then needs Triton's interpreter,
``TRITON_INTERPRET=1``, which is how the tests run the kernels without a GPU).

The kernels are plain functions JIT-wrapped on first launch rather than at import, so
whether they run compiled or interpreted follows ``TRITON_INTERPRET`` at that moment,
whatever imported this module first; the device functions they call (`device_function`,
also gemv.py's) are wrapped along with the first kernel. They allocate fresh outputs, take
strided inputs, and size their grids from shapes only: no host syncs, so they are
CUDA-graph safe.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from gpu_target.attention import write_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch references serve every tensor
    triton = tl = None


# --------------------------------------------------------------------------- dispatch


def _wants_triton(x: torch.Tensor, use_triton: Optional[bool]) -> bool:
    if use_triton is None:
        return x.is_cuda and triton is not None
    if use_triton and triton is None:
        raise ImportError("use_triton=True needs Triton (pip install triton)")
    return use_triton


_PENDING_DEVICE_FUNCTIONS: list[Callable] = []


def device_function(fn: Callable) -> Callable:
    """Mark a plain function as a Triton device function that kernels call by its name.

    Like the kernels it is JIT-wrapped at the first kernel launch, not at import (its
    module-global name is then rebound to the wrapper), so it runs compiled or interpreted
    as its callers do. Device functions are inlined into their callers.
    """
    _PENDING_DEVICE_FUNCTIONS.append(fn)
    return fn


def jit_device_functions() -> None:
    """Wrap the device functions defined so far; every kernel JIT wrapper calls this first."""
    while _PENDING_DEVICE_FUNCTIONS:
        fn = _PENDING_DEVICE_FUNCTIONS.pop()
        fn.__globals__[fn.__name__] = triton.jit(fn)


@functools.lru_cache(maxsize=None)
def _jit(kernel: Callable) -> Callable:
    jit_device_functions()
    return triton.jit(kernel)


def _num_warps(block: int) -> int:
    """About 512 elements per warp, between 1 and 8 warps."""
    return min(8, max(1, block // 512))


# --------------------------------------------------------------------------- RMSNorm


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, round to x's dtype, then scale by the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``residual + h`` in the model dtype, then RMSNorm of that rounded sum."""
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: Optional[bool] = None) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` [..., hidden]."""
    if not _wants_triton(x, use_triton):
        return rms_norm_reference(x, weight, eps)
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: Optional[bool] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused_add_rms_norm, without writing into its inputs.

    Returns ``(rms_norm(x + residual) * weight, x + residual)``; the sum is rounded to the
    model dtype before it is normalised, as HF's residual stream is.
    """
    if not _wants_triton(x, use_triton):
        return add_rms_norm_reference(x, residual, weight, eps)
    return _launch_rms_norm(x, residual, weight, eps)


def residual_buffers(x: torch.Tensor, residual: Optional[torch.Tensor],
                     rows: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """An add-RMSNorm kernel's residual rows, its new residual (None without one) and that
    tensor's rows; without a residual both row arguments are `rows`, never read or written."""
    if residual is None:
        return rows, None, rows
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return residual.reshape(rows.shape), new_residual, new_residual.view(rows.shape)


def _launch_rms_norm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    normed = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out_rows = normed.view(-1, hidden)
    has_residual = residual is not None
    residual_rows, new_residual, new_residual_rows = residual_buffers(x, residual, rows)
    if rows.shape[0] == 0:
        return normed, new_residual
    block = triton.next_power_of_2(hidden)
    _jit(_rms_norm_kernel)[(rows.shape[0],)](
        rows,
        residual_rows,
        weight,
        out_rows,
        new_residual_rows,
        hidden,
        eps,
        rows.stride(0),
        rows.stride(1),
        residual_rows.stride(0),
        residual_rows.stride(1),
        weight.stride(0),
        HAS_RESIDUAL=has_residual,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return normed, new_residual


def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    hidden,
    eps,
    stride_x_row,
    stride_x_col,
    stride_res_row,
    stride_res_col,
    stride_w,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row; outputs are contiguous rows of ``hidden`` elements."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    out = _add_rms_norm_row(x_ptr, residual_ptr, weight_ptr, new_residual_ptr, row, cols, hidden, eps, stride_x_row,
                            stride_x_col, stride_res_row, stride_res_col, stride_w, HAS_RESIDUAL)
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=cols < hidden)


@device_function
def _add_rms_norm_row(x_ptr, residual_ptr, weight_ptr, new_residual_ptr, row, cols, hidden, eps, stride_x_row,
                      stride_x_col, stride_res_row, stride_res_col, stride_w, HAS_RESIDUAL: tl.constexpr):
    """weight * RMSNorm(x (+ residual)) of one row in fp32, before its rounding to the output
    dtype (zero past ``hidden``); with a residual the rounded sum is stored as the new residual.
    Shared with gpu_target/fp8_activations.py's kernel, which quantises the row instead of
    storing it: launched with the same BLOCK and warps, both sum the squares alike."""
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x_row + cols * stride_x_col, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_res_row + cols * stride_res_col, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * hidden + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.div_rn(tl.sum(x32 * x32, axis=0), hidden.to(tl.float32))
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
    normed = (x32 * inv_rms).to(x.dtype)
    weight = tl.load(weight_ptr + cols * stride_w, mask=mask, other=0.0)
    return weight.to(tl.float32) * normed.to(tl.float32)


# --------------------------------------------------------------------------- rotary


def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama's rotate-half rotary embedding of x [T, heads, D], computed in fp32.

    ``cos`` / ``sin`` are [T, 1, D/2], already gathered at the tokens' positions.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos_t = cos[positions].unsqueeze(1)
    sin_t = sin[positions].unsqueeze(1)
    return rotate_half_reference(q, cos_t, sin_t), rotate_half_reference(k, cos_t, sin_t)


def rotary_and_store_kv(
    q: torch.Tensor,  # [T, H, D], any strides (views of a fused qkv projection)
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    cos: torch.Tensor,  # fp32 [max_positions, D/2], rows contiguous
    sin: torch.Tensor,
    positions: torch.Tensor,  # int [T], any order
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]
    *,
    use_triton: Optional[bool] = None,
) -> torch.Tensor:
    """Rotate q and k by their tokens' positions and write k and v into the paged cache.

    Returns the rotated q (a new contiguous tensor). One kernel on the GPU: the rotated k
    goes straight to its cache slot instead of through a temporary and two index copies.
    """
    if not _wants_triton(q, use_triton):
        q_out, k_out = apply_rotary_reference(q, k, cos, sin, positions)
        write_kv(k_out, v, k_cache, v_cache, slot_mapping)
        return q_out
    T, H, D = q.shape
    KVH = k.shape[1]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rotary_and_store_kv needs contiguous KV caches")
    q_out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    half = D // 2
    block_half = triton.next_power_of_2(half)
    _jit(_rotary_kv_kernel)[(T,)](
        q,
        k,
        v,
        q_out,
        k_cache,
        v_cache,
        cos,
        sin,
        positions,
        slot_mapping,
        H,
        KVH,
        half,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        cos.stride(0),
        sin.stride(0),
        BLOCK_H=triton.next_power_of_2(H),
        BLOCK_KVH=triton.next_power_of_2(KVH),
        BLOCK_HALF=block_half,
        num_warps=_num_warps(triton.next_power_of_2(H) * block_half),
    )
    return q_out


@device_function
def _rotate_half(x1, x2, cos, sin):
    """(x1 cos - x2 sin, x2 cos + x1 sin) in fp32 from model-dtype halves, rounded back to
    their dtype: the reference's rounding. Shared with gemv's fused qkv kernel, so the two
    paths contract the same multiplies into FMAs."""
    first = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
    second = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
    return first.to(x1.dtype), second.to(x1.dtype)


def _rotary_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    slots_ptr,
    num_heads,
    num_kv_heads,
    half,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_k_tok,
    stride_k_head,
    stride_k_dim,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    stride_cos,
    stride_sin,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program per token: rotates its query heads into q_out and its key heads into
    the token's cache slot (rounded to the model dtype first, as the reference does), and
    copies its value heads to the same slot; one cos/sin load serves every head."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half
    cos = tl.load(cos_ptr + position * stride_cos + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + position * stride_sin + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    head_dim = 2 * half

    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < num_heads) & dim_mask[None, :]
    src = q_ptr + token * stride_q_tok + heads * stride_q_head + dims[None, :] * stride_q_dim
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half * stride_q_dim, mask=mask, other=0.0)
    dst = q_out_ptr + (token * num_heads + heads) * head_dim + dims[None, :]
    first, second = _rotate_half(x1, x2, cos, sin)
    tl.store(dst, first, mask=mask)
    tl.store(dst + half, second, mask=mask)

    kv_heads = tl.arange(0, BLOCK_KVH)[:, None]
    kv_mask = (kv_heads < num_kv_heads) & dim_mask[None, :]
    src = k_ptr + token * stride_k_tok + kv_heads * stride_k_head + dims[None, :] * stride_k_dim
    x1 = tl.load(src, mask=kv_mask, other=0.0)
    x2 = tl.load(src + half * stride_k_dim, mask=kv_mask, other=0.0)
    cache_row = (slot * num_kv_heads + kv_heads) * head_dim + dims[None, :]
    first, second = _rotate_half(x1, x2, cos, sin)
    cache_dtype = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + cache_row, first.to(cache_dtype), mask=kv_mask)
    tl.store(k_cache_ptr + cache_row + half, second.to(cache_dtype), mask=kv_mask)

    src = v_ptr + token * stride_v_tok + kv_heads * stride_v_head + dims[None, :] * stride_v_dim
    value_dtype = v_cache_ptr.dtype.element_ty
    tl.store(v_cache_ptr + cache_row, tl.load(src, mask=kv_mask, other=0.0).to(value_dtype), mask=kv_mask)
    tl.store(v_cache_ptr + cache_row + half, tl.load(src + half * stride_v_dim, mask=kv_mask, other=0.0).to(value_dtype), mask=kv_mask)


# --------------------------------------------------------------------------- SiLU * mul

SILU_BLOCK = 1024


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up in the model dtype, for x = [gate | up] along the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor, *, use_triton: Optional[bool] = None) -> torch.Tensor:
    """[T, 2I] -> [T, I]: SiLU of the first half times the second half.

    The kernel rounds SiLU's result to the model dtype before the multiply, as the
    reference's two torch ops do.
    """
    if not _wants_triton(x, use_triton):
        return silu_and_mul_reference(x)
    rows = x.reshape(-1, x.shape[-1])
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    _jit(_silu_and_mul_kernel)[(rows.shape[0], triton.cdiv(inter, block))](
        rows,
        out,
        inter,
        rows.stride(0),
        rows.stride(1),
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return out


@device_function
def _silu_mul(gate, up):
    """SiLU(gate) * up from model-dtype inputs: SiLU in fp32 rounded to the dtype, then the
    product in fp32 rounded again, as the reference's two torch ops round. Shared with
    gemv's fused gate_up kernel."""
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_row, stride_col, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_ptrs = x_ptr + row * stride_row + cols * stride_col
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + inter * stride_col, mask=mask, other=0.0)
    tl.store(out_ptr + row * inter + cols, _silu_mul(gate, up), mask=mask)
