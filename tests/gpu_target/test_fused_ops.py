"""The fused small ops' Triton kernels against their plain-torch references.

On a CUDA machine the kernels run on the GPU; elsewhere through Triton's CPU interpreter
(TRITON_INTERPRET=1, set here before any kernel is first launched; fused_ops wraps its
kernels at first launch, so import order does not matter).

The interpreter rounds fp32 -> bf16 by truncation, where GPUs round to nearest even, so
under it bf16 results may be off by an ulp at each rounding point; bf16 tolerances are
loose there and tight on the GPU.
"""
from __future__ import annotations


import pytest
import torch

CUDA = torch.cuda.is_available()  # without CUDA, conftest.py runs Triton kernels in its interpreter
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_target import fused_ops  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BF16_TOLERANCE = dict(atol=1e-2, rtol=1e-2) if CUDA else dict(atol=5e-2, rtol=3e-2)  # see the module docstring
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: BF16_TOLERANCE}
TOKENS = [1, 7, 33]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within the dtype's tolerance; in fp16 also bit-equal almost everywhere.

    The kernels round at the references' rounding points, so only fp32 reduction order or
    FMA contraction may flip an fp16 result by an ulp, which is rare; a missed rounding
    point (within tolerance, but drifting from HF) flips many.
    """
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype])
    if expected.dtype == torch.float16:
        bit_equal = (actual == expected).float().mean().item()
        assert bit_equal >= 0.99, f"only {bit_equal:.1%} of fp16 results bit-equal to the reference"


def randn(*shape, dtype, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(DEVICE, dtype)


# --------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_kernel_matches_reference(dtype, hidden, tokens):
    x = randn(tokens, hidden, dtype=dtype) * 3
    weight = randn(hidden, dtype=dtype, seed=1)
    out = fused_ops.rms_norm(x, weight, 1e-5, use_triton=True)
    assert_close(out, fused_ops.rms_norm_reference(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("tokens", TOKENS)
def test_add_rms_norm_kernel_matches_reference(dtype, hidden, tokens):
    x = randn(tokens, hidden, dtype=dtype)
    residual = randn(tokens, hidden, dtype=dtype, seed=1) * 10
    weight = randn(hidden, dtype=dtype, seed=2)
    normed, new_residual = fused_ops.add_rms_norm(x, residual, weight, 1e-6, use_triton=True)
    expected_normed, expected_residual = fused_ops.add_rms_norm_reference(x, residual, weight, 1e-6)
    assert_close(normed, expected_normed)
    if dtype == torch.bfloat16 and not CUDA:
        assert_close(new_residual, expected_residual)
    else:  # one rounding of an exact fp32 sum: the same bits as torch's add
        assert torch.equal(new_residual, expected_residual)


def test_add_rms_norm_reads_strided_inputs_and_leaves_them_alone():
    hidden = 576
    x = randn(hidden * 2, 7, dtype=torch.float16).t()[:, ::2]  # column stride 14
    residual = randn(7, hidden + 64, dtype=torch.float16, seed=1)[:, :hidden]  # row stride 640
    weight = randn(hidden, dtype=torch.float16, seed=2)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = fused_ops.add_rms_norm(x, residual, weight, 1e-6, use_triton=True)
    expected_normed, expected_residual = fused_ops.add_rms_norm_reference(x, residual, weight, 1e-6)
    assert_close(normed, expected_normed)
    assert torch.equal(new_residual, expected_residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_reference_is_hf_llama_rms_norm():
    """The CPU path must stay bit-identical to HF, or greedy outputs drift from transformers."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(576, eps=1e-6)
    for dtype in (torch.float32, torch.bfloat16):
        norm = hf.to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(576))
        x = torch.randn(5, 576).to(dtype)
        assert torch.equal(fused_ops.rms_norm(x, norm.weight.detach(), 1e-6), norm(x).detach())


# --------------------------------------------------------------------------- rotary


def rotary_tables(max_positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)


def split_qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """q, k, v as the model makes them: strided views of one fused qkv projection output."""
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)


def tree_positions(tokens: int) -> torch.Tensor:
    """Shuffled positions with repeats, as token-tree nodes at the same depth share them."""
    generator = torch.Generator().manual_seed(tokens)
    positions = 100 + torch.randint(0, max(1, tokens // 3), (tokens,), generator=generator)
    return positions.to(DEVICE)


def empty_caches(tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16):
    """Paged K/V caches filled with a marker, and distinct scattered slots for `tokens` tokens."""
    num_blocks = 2 * (tokens // block_size + 1)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(tokens))[:tokens]
    return k_cache, k_cache.clone(), slots.to(DEVICE)


def rotate_both_ways(q, k, v, cos, sin, positions, k_cache, v_cache, slots):
    """(kernel, reference) results: each the rotated q and the K/V caches after the write."""
    results = []
    for use_triton in (True, False):
        caches = k_cache.clone(), v_cache.clone()
        q_out = fused_ops.rotary_and_store_kv(q, k, v, cos, sin, positions, *caches, slots, use_triton=use_triton)
        results.append((q_out, *caches))
    return results


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (4, 4, 128)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_kernel_matches_reference_on_qkv_views(dtype, heads, kv_heads, head_dim, tokens):
    q, k, v = split_qkv(tokens, heads, kv_heads, head_dim, dtype)
    assert tokens == 1 or not (q.is_contiguous() or k.is_contiguous())  # one row is contiguous whatever its stride
    cos, sin = rotary_tables(512, head_dim)
    positions = tree_positions(tokens)
    k_cache, v_cache, slots = empty_caches(tokens, kv_heads, head_dim, dtype)
    inputs_before = [t.clone() for t in (q, k, v)]
    (q_out, k_out, v_out), (q_ref, k_ref, v_ref) = rotate_both_ways(q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    assert_close(q_out, q_ref)
    assert_close(k_out, k_ref)
    assert torch.equal(v_out, v_ref)  # a copy, and the untouched slots keep their marker
    assert all(torch.equal(now, before) for now, before in zip((q, k, v), inputs_before))


def test_rotary_kernel_reads_any_strides():
    q = randn(7, 64, 4, dtype=torch.float16).transpose(1, 2)  # head_dim stride 4
    k = randn(7, 64, 2, dtype=torch.float16, seed=1).transpose(1, 2)  # head_dim stride 2
    v = randn(7, 64, 2, dtype=torch.float16, seed=2).transpose(1, 2)
    cos, sin = rotary_tables(512, 64)
    k_cache, v_cache, slots = empty_caches(7, 2, 64, torch.float16)
    kernel, reference = rotate_both_ways(q, k, v, cos, sin, tree_positions(7), k_cache, v_cache, slots)
    for out, ref in zip(kernel, reference):
        assert_close(out, ref)


def test_rotary_kernel_uses_each_tokens_own_position():
    """Tokens of equal content at different positions must come out rotated differently,
    and equal positions identically, whatever order the positions come in."""
    heads, kv_heads, head_dim = 4, 2, 64
    row = randn(1, heads + 2 * kv_heads, head_dim, dtype=torch.float32)
    q = row[:, :heads].expand(4, heads, head_dim)
    k = row[:, heads : heads + kv_heads].expand(4, kv_heads, head_dim)
    v = row[:, heads + kv_heads :].expand(4, kv_heads, head_dim)
    cos, sin = rotary_tables(64, head_dim)
    positions = torch.tensor([9, 3, 9, 0], device=DEVICE)
    k_cache, v_cache, slots = empty_caches(4, kv_heads, head_dim, torch.float32)
    q_out = fused_ops.rotary_and_store_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slots, use_triton=True)
    k_out = k_cache.view(-1, kv_heads, head_dim)[slots]
    assert torch.equal(q_out[0], q_out[2]) and torch.equal(k_out[0], k_out[2])
    assert not torch.allclose(q_out[0], q_out[1]) and not torch.allclose(k_out[1], k_out[3])
    torch.testing.assert_close(q_out[3], q[3])  # position 0: no rotation
    torch.testing.assert_close(k_out[3], k[3])


def test_rotary_reference_is_hf_apply_rotary_pos_emb_in_fp32():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, _ = split_qkv(7, 4, 2, 64, torch.float32)
    q, k = q.cpu(), k.cpu()
    cos, sin = (t.cpu() for t in rotary_tables(64, 64))
    positions = torch.tensor([5, 1, 1, 2, 30, 2, 0])
    hf_cos = torch.cat([cos[positions]] * 2, dim=-1)
    hf_sin = torch.cat([sin[positions]] * 2, dim=-1)
    as_hf = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  [T, H, D] -> [1, H, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(as_hf(q), as_hf(k), hf_cos[None], hf_sin[None])
    ours_q, ours_k = fused_ops.apply_rotary_reference(q, k, cos, sin, positions)
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1))
    assert torch.equal(ours_k, hf_k[0].transpose(0, 1))


# --------------------------------------------------------------------------- SiLU * mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [1536, 1000, 14336])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_kernel_matches_reference(dtype, intermediate, tokens):
    x = randn(tokens, 2 * intermediate, dtype=dtype) * 4
    assert_close(fused_ops.silu_and_mul(x, use_triton=True), fused_ops.silu_and_mul_reference(x))


def test_silu_and_mul_reads_a_strided_view():
    x = randn(7, 2 * 1000 + 24, dtype=torch.float16)[:, 24:]
    assert_close(fused_ops.silu_and_mul(x, use_triton=True), fused_ops.silu_and_mul_reference(x))


# --------------------------------------------------------------------------- dispatch and the model


def test_cpu_tensors_take_the_reference_path_by_default(monkeypatch):
    def no_kernels(kernel):
        raise AssertionError(f"{kernel.__name__} launched for CPU tensors")

    monkeypatch.setattr(fused_ops, "_jit", no_kernels)
    x = torch.randn(3, 64)
    weight = torch.randn(64)
    assert torch.equal(fused_ops.rms_norm(x, weight, 1e-6), fused_ops.rms_norm_reference(x, weight, 1e-6))
    fused_ops.add_rms_norm(x, x, weight, 1e-6)
    fused_ops.silu_and_mul(x)
    cos, sin = torch.randn(8, 8), torch.randn(8, 8)
    cache = torch.zeros(1, 16, 4, 16)
    heads = x.view(3, 4, 16)
    fused_ops.rotary_and_store_kv(heads, heads, heads, cos, sin, torch.tensor([0, 1, 2]), cache, cache.clone(), torch.tensor([0, 5, 9]))


def test_model_forward_through_kernels_matches_references(tiny_llama_dir, monkeypatch):
    """The whole residual-stream wiring with every op on its kernel: a prefill chunk and a
    token tree whose nodes share positions, batched in one step."""
    from gpu_target.kv_cache import KVCachePool
    from gpu_target.loader import load_config, load_state_dict
    from gpu_target.model import build_model
    from gpu_target.runner import ModelRunner, SequenceChunk

    config = load_config(tiny_llama_dir)
    model = build_model(config, load_state_dict(tiny_llama_dir, config, torch.float32, DEVICE), torch.float32, DEVICE)
    runner = ModelRunner(model, KVCachePool(config, 8, 16, torch.float32, DEVICE), DEVICE)
    prefill = SequenceChunk(
        token_ids=[5, 17, 42, 8, 99, 3, 61], positions=list(range(7)), block_table=[2], num_cached=0, logits_indices=range(7)
    )
    tree = SequenceChunk(
        token_ids=[7, 12, 13, 40, 41],
        positions=[0, 1, 1, 2, 2],
        block_table=[4],
        num_cached=0,
        logits_indices=range(5),
        tree_mask=[0b1, 0b11, 0b101, 0b1011, 0b10101],
    )

    def forward(use_kernels: bool) -> torch.Tensor:
        monkeypatch.setattr(fused_ops, "_wants_triton", lambda x, use_triton: use_kernels)
        return runner.forward([prefill, tree])

    torch.testing.assert_close(forward(True), forward(False), atol=1e-4, rtol=1e-4)
