"""The weight-streaming GEMV (M = 1) and skinny GEMM (M = 2..64) against F.linear, and
`linear`'s dispatch between them (on the GPU, or through Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_target import gemv  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


def _inputs(n: int, k: int, dtype: torch.dtype, bias: bool, m: int = 1):
    generator = torch.Generator().manual_seed(m * 1_000_000 + n * 1000 + k)
    x = torch.randn(m, k, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(37, 300), (64, 4096), (6, 2049)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_f_linear(dtype, n, k, bias):
    """Ragged N and K exercise the masks; the bias path is Qwen2's qkv projection."""
    x, weight, b = _inputs(n, k, dtype, bias)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    got = gemv.gemv(x, weight, b)
    assert got.shape == (1, n) and got.dtype == dtype
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # one rounding of the output
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=ulp)


def test_gemv_small_tiles_cover_every_row_and_column():
    x, weight, _ = _inputs(9, 70, torch.float16, False)
    got = gemv.gemv(x, weight, block_n=4, block_k=16, num_warps=1)
    torch.testing.assert_close(got.float(), F.linear(x.float(), weight.float()), atol=1e-3, rtol=2.0**-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(2, 37, 300), (7, 64, 515), (17, 70, 256), (40, 16, 40), (64, 33, 129)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_f_linear(dtype, m, n, k, bias):
    """Rows that are not a power of two, ragged N and K, and the bias path, through the masks."""
    x, weight, b = _inputs(n, k, dtype, bias, m)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    got = gemv.skinny_gemm(x, weight, b)
    assert got.shape == (m, n) and got.dtype == dtype
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=ulp)


@pytest.mark.parametrize("w_first", [False, True])
@pytest.mark.parametrize("block_k", [16, 32])  # K = 70 with 16: a ragged last K tile; K = 64 with 32: EVEN_K
def test_skinny_gemm_small_tiles_and_strided_rows(w_first, block_k):
    """Several programs and K steps, rows of x further apart than K (a slice of a wider buffer), either operand order."""
    wide, weight, b = _inputs(50, 90, torch.bfloat16, True, m=5)
    k = 70 if block_k == 16 else 64
    x = wide[:, :k]
    weight = weight[:, :k].contiguous()
    got = gemv.skinny_gemm(x, weight, b, block_n=16, block_k=block_k, num_warps=1, num_stages=1, w_first=w_first)
    expected = F.linear(x.float(), weight.float(), b.float())
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=2.0**-7)


class _ClaimsCuda(torch.Tensor):
    """A CPU tensor that says it is on the GPU, so the dispatch runs without one."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.parametrize("m,n,path", [(1, 8, "gemv"), (2, 4096, "skinny"), (17, 4096, "skinny"), (32, 4096, "skinny"),
                                      (33, 4096, "cublas"), (64, 16384, "skinny"), (65, 16384, "cublas"), (17, 1536, "cublas")])
def test_linear_dispatches_on_rows_and_width(monkeypatch, m, n, path):
    calls = []
    monkeypatch.setattr(gemv, "gemv", lambda x, w, b=None: calls.append("gemv"))
    monkeypatch.setattr(gemv, "skinny_gemm", lambda x, w, b=None: calls.append("skinny"))
    monkeypatch.setattr(gemv.F, "linear", lambda x, w, b=None: calls.append("cublas"))
    weight = torch.randn(n, 16, dtype=torch.bfloat16)
    gemv.linear(torch.randn(m, 16, dtype=torch.bfloat16).as_subclass(_ClaimsCuda), weight)
    assert calls == [path]


def test_linear_streams_only_half_precision_rows_on_the_gpu():
    weight = torch.randn(8, 16, dtype=torch.bfloat16)
    for m in (1, 17):
        rows = torch.randn(m, 16, dtype=torch.bfloat16)
        assert not gemv.streaming_applies(rows, weight)  # CPU tensors: F.linear
        assert torch.equal(gemv.linear(rows, weight), F.linear(rows, weight))
    if CUDA:
        weight = weight.cuda()
        for m in (1, 2, 64):
            assert gemv.streaming_applies(torch.randn(m, 16, dtype=torch.bfloat16, device="cuda"), weight)
        assert not gemv.streaming_applies(torch.randn(65, 16, dtype=torch.bfloat16, device="cuda"), weight)
        assert not gemv.streaming_applies(torch.randn(4, 16, device="cuda"), weight.float())
        assert not gemv.streaming_applies(torch.randn(16, 4, dtype=torch.bfloat16, device="cuda").t(), weight)
        x = torch.randn(17, 16, dtype=torch.bfloat16, device="cuda")
        torch.testing.assert_close(gemv.linear(x, weight).float(), F.linear(x.float(), weight.float()),
                                   atol=1e-3, rtol=2.0**-7)


# --------------------------------------------------------------------------- GEMVs with a fused epilogue
# Each fused kernel must equal, bit for bit, the kernels it replaces run one after the other
# (on the GPU as under the interpreter): the same tile sums each row in the same order.

from gpu_target import fused_ops  # noqa: E402

SMALL_TILE = dict(block_k=16, num_warps=1)  # several K steps and a ragged last one at K = 70


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter,k,tile", [(37, 300, {}), (64, 2049, {}), (5, 4096, {}), (9, 70, SMALL_TILE),
                                         (9, 70, dict(SMALL_TILE, block_n=8))])  # 4 pairs a program, the last part-filled
def test_gemv_silu_and_mul_equals_gemv_then_silu_and_mul(dtype, inter, k, tile):
    x, weight, _ = _inputs(2 * inter, k, dtype, False)
    x = x * 4  # gates well into SiLU's curved part
    expected = fused_ops.silu_and_mul(gemv.gemv(x, weight, **tile), use_triton=True)
    got = gemv.gemv_silu_and_mul(x, weight, **tile)
    assert got.shape == (1, inter) and got.dtype == dtype
    assert torch.equal(got, expected)


def _rotary_tables(max_positions: int, head_dim: int):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,k,tile", [
    (4, 2, 64, 300, {}),  # GQA
    (3, 3, 32, 2049, {}),  # MHA, one full K tile and a ragged one
    (6, 1, 16, 70, SMALL_TILE),  # MQA, small tiles
    (6, 1, 16, 70, dict(SMALL_TILE, block_n=8)),  # 4 rotary pairs a program
])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_rotary_and_store_kv_equals_gemv_then_rotary(dtype, heads, kv_heads, head_dim, k, tile, bias):
    """q, the K/V caches (the written slot and every other one) and the inputs, against `gemv`
    then `rotary_and_store_kv`'s kernel, at a random position and slot."""
    n = (heads + 2 * kv_heads) * head_dim
    x, weight, b = _inputs(n, k, dtype, bias)
    cos, sin = _rotary_tables(300, head_dim)
    generator = torch.Generator().manual_seed(n + k + bias)
    positions = torch.randint(1, 300, (1,), generator=generator).to(DEVICE)
    num_blocks, block_size = 5, 16
    slot_mapping = torch.randint(0, num_blocks * block_size, (1,), generator=generator).to(DEVICE)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    inputs_before = [t.clone() for t in (x, weight, positions, slot_mapping)]

    expected_caches = k_cache.clone(), v_cache.clone()
    q, key, value = gemv.gemv(x, weight, b, **tile).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    expected_q = fused_ops.rotary_and_store_kv(q.view(1, heads, head_dim), key.view(1, kv_heads, head_dim),
                                               value.view(1, kv_heads, head_dim), cos, sin, positions,
                                               *expected_caches, slot_mapping, use_triton=True)
    caches = k_cache.clone(), v_cache.clone()
    got_q = gemv.gemv_rotary_and_store_kv(x, weight, b, cos, sin, positions, *caches, slot_mapping, heads, **tile)

    assert got_q.shape == (1, heads, head_dim) and got_q.dtype == dtype and got_q.is_contiguous()
    assert torch.equal(got_q, expected_q)
    slot = slot_mapping.item()
    for got, expected, before in zip(caches, expected_caches, (k_cache, v_cache)):
        got, expected, before = (c.view(-1, kv_heads, head_dim) for c in (got, expected, before))
        assert torch.equal(got[slot], expected[slot])
        assert not torch.equal(got[slot], before[slot])
        others = torch.arange(got.shape[0], device=DEVICE) != slot
        assert torch.equal(got[others], before[others])  # nothing written anywhere else
    assert all(torch.equal(now, then) for now, then in zip((x, weight, positions, slot_mapping), inputs_before))


def test_gemv_rotary_and_store_kv_converts_to_the_cache_dtype():
    """A cache of another dtype gets the model-dtype results converted, as the rotary kernel does."""
    heads, kv_heads, head_dim = 2, 1, 32
    x, weight, _ = _inputs((heads + 2 * kv_heads) * head_dim, 96, torch.bfloat16, False)
    cos, sin = _rotary_tables(64, head_dim)
    positions, slot_mapping = torch.tensor([37], device=DEVICE), torch.tensor([5], device=DEVICE)
    caches = [torch.zeros(1, 16, kv_heads, head_dim, device=DEVICE) for _ in range(4)]
    got_q = gemv.gemv_rotary_and_store_kv(x, weight, None, cos, sin, positions, *caches[:2], slot_mapping, heads)
    q, key, value = gemv.gemv(x, weight).view(1, -1, head_dim).split([heads, kv_heads, kv_heads], 1)
    expected_q = fused_ops.rotary_and_store_kv(q, key, value, cos, sin, positions, *caches[2:], slot_mapping, use_triton=True)
    assert torch.equal(got_q, expected_q)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].dtype == torch.float32 and caches[0].abs().sum() > 0


def test_fused_gemvs_reject_shapes_they_cannot_split():
    x, weight, _ = _inputs(6, 32, torch.bfloat16, False)
    with pytest.raises(ValueError):
        gemv.gemv_silu_and_mul(x, weight[:5])
    cache = torch.zeros(1, 16, 1, 2, dtype=torch.bfloat16, device=DEVICE)  # 1 kv head of 2: 6 rows are 1 q head
    cos, sin = _rotary_tables(4, 2)
    slot = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError):
        gemv.gemv_rotary_and_store_kv(x, weight, None, cos, sin, slot, cache, cache.clone(), slot, num_heads=2)


def test_the_model_fuses_only_one_streamed_row(monkeypatch):
    from gpu_target import model as model_module
    from cpu_draft.quantize import Int8Linear

    projection = model_module.Linear(16, 8, bias=False).to(torch.bfloat16)
    one, two = torch.randn(1, 16, dtype=torch.bfloat16), torch.randn(2, 16, dtype=torch.bfloat16)
    assert not model_module._fuses_epilogue(one, projection)  # CPU tensors: the plain-torch path
    monkeypatch.setattr(gemv, "_stream_cpu_tensors_when_interpreting", True)
    assert model_module._fuses_epilogue(one, projection) == gemv._interpreting()
    assert not model_module._fuses_epilogue(two, projection)
    assert not model_module._fuses_epilogue(one.float(), model_module.Linear(16, 8, bias=False))  # fp32: F.linear
    assert not model_module._fuses_epilogue(one, Int8Linear(projection, torch.bfloat16))


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # qwen2: the qkv bias
def test_one_token_forward_through_the_fused_gemvs_equals_the_unfused_kernels(architecture, request, monkeypatch):
    """A decode step of a tiny model in bf16 with every op on its kernel, fused and unfused:
    the same logits and the same KV cache, bit for bit."""
    from gpu_target import model as model_module
    from gpu_target.kv_cache import KVCachePool
    from gpu_target.loader import load_config, load_state_dict
    from gpu_target.model import build_model
    from gpu_target.runner import ModelRunner, SequenceChunk

    model_dir = request.getfixturevalue(f"tiny_{architecture}_dir")
    config = load_config(model_dir)
    dtype = torch.bfloat16
    model = build_model(config, load_state_dict(model_dir, config, dtype, DEVICE), dtype, DEVICE)
    runner = ModelRunner(model, KVCachePool(config, 6, 16, dtype, DEVICE), DEVICE)
    if not CUDA:  # stream the CPU tensors through the kernels, as a GPU's would be
        monkeypatch.setattr(gemv, "_stream_cpu_tensors_when_interpreting", True)
    monkeypatch.setattr(fused_ops, "_wants_triton", lambda x, use_triton: True)
    prompt = [5, 17, 42, 8, 99, 3, 61, 7, 12, 13, 40, 41, 2, 9, 77, 30, 31, 33, 28]
    runner.forward([SequenceChunk(prompt, range(len(prompt)), [4, 1], 0, [len(prompt) - 1])])
    decode = SequenceChunk([23], [len(prompt)], [4, 1], len(prompt), [0])  # slot 1 * 16 + 3
    kv_before = runner.kv_pool.storage.clone()

    calls = []
    for name in ("gemv_silu_and_mul", "gemv_rotary_and_store_kv"):
        original = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda *args, _f=original, _n=name, **kw: calls.append(_n) or _f(*args, **kw))
    fused = runner.forward([decode])
    fused_kv = runner.kv_pool.storage.clone()
    assert sorted(calls) == sorted(["gemv_rotary_and_store_kv", "gemv_silu_and_mul"] * config.num_layers)

    runner.kv_pool.storage.copy_(kv_before)
    monkeypatch.setattr(model_module, "_fuses_epilogue", lambda x, projection: False)
    unfused = runner.forward([decode])
    assert len(calls) == 2 * config.num_layers
    assert torch.equal(fused, unfused)
    assert torch.equal(fused_kv, runner.kv_pool.storage)
    assert not torch.equal(fused_kv, kv_before)


# --------------------------------------------------------------------------- skinny GEMMs with a fused epilogue
# The same bit-for-bit contract at 2..32 rows (tree verification): the fused skinny kernels
# against `skinny_gemm` then the op's own kernel, on the same tile.

SKINNY_SMALL_TILE = dict(block_n=16, block_k=16, num_warps=1, num_stages=1)  # several programs and K steps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 5, 17, 32, 40])  # 40: BLOCK_M 64, as a wide gate_up takes up to 64 rows
@pytest.mark.parametrize("inter,k,tile", [
    (96, 300, {}),  # the model's tile (block_n 64: 32 gate + 32 up rows), ragged K
    (64, 512, {}),  # EVEN_K
    (37, 70, SKINNY_SMALL_TILE),  # ragged I: the last program's pairs are partly masked
    (24, 64, SKINNY_SMALL_TILE),
])
def test_skinny_gemm_silu_and_mul_equals_skinny_gemm_then_silu_and_mul(dtype, m, inter, k, tile):
    x, weight, _ = _inputs(2 * inter, k, dtype, False, m)
    x = x * 4  # gates well into SiLU's curved part
    expected = fused_ops.silu_and_mul(gemv.skinny_gemm(x, weight, **tile), use_triton=True)
    got = gemv.skinny_gemm_silu_and_mul(x, weight, **tile)
    assert got.shape == (m, inter) and got.dtype == dtype
    assert torch.equal(got, expected)


def _skinny_rotary_case(m, heads, kv_heads, head_dim, k, dtype, bias, cache_dtype=None, seed=0):
    n = (heads + 2 * kv_heads) * head_dim
    x, weight, b = _inputs(n, k, dtype, bias, m)
    cos, sin = _rotary_tables(300, head_dim)
    generator = torch.Generator().manual_seed(seed + m * 100 + n + k + bias)
    # tree nodes: positions repeat and skip, in any order
    positions = torch.randint(1, 300, (m,), generator=generator).to(DEVICE)
    if m > 2:
        positions[1] = positions[2]
    num_blocks, block_size = 5, 16
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator)[:m].to(DEVICE)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(DEVICE, cache_dtype or dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(DEVICE, cache_dtype or dtype)
    return x, weight, b, cos, sin, positions, k_cache, v_cache, slot_mapping


def _check_skinny_rotary(m, heads, kv_heads, head_dim, case, tile):
    x, weight, b, cos, sin, positions, k_cache, v_cache, slot_mapping = case
    inputs_before = [t.clone() for t in (x, weight, positions, slot_mapping)]
    expected_caches = k_cache.clone(), v_cache.clone()
    q, key, value = gemv.skinny_gemm(x, weight, b, **tile).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    expected_q = fused_ops.rotary_and_store_kv(q.view(m, heads, head_dim), key.view(m, kv_heads, head_dim),
                                               value.view(m, kv_heads, head_dim), cos, sin, positions,
                                               *expected_caches, slot_mapping, use_triton=True)
    caches = k_cache.clone(), v_cache.clone()
    got_q = gemv.skinny_gemm_rotary_and_store_kv(x, weight, b, cos, sin, positions, *caches, slot_mapping, heads, **tile)

    assert got_q.shape == (m, heads, head_dim) and got_q.dtype == x.dtype and got_q.is_contiguous()
    # On the H100 the fp16 kernel differs from the unfused path by a rounding step in a few
    # elements (4 of 32 fp16 cases), so the model fuses only bf16 there; bf16, and everything
    # under the interpreter, is bit for bit.
    same = (lambda a, b: torch.allclose(a.float(), b.float(), rtol=2**-10, atol=0)) if x.is_cuda and x.dtype == torch.float16 else torch.equal
    assert same(got_q, expected_q)
    slots = slot_mapping.cpu()
    written = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    written[slots] = True
    for got, expected, before in zip(caches, expected_caches, (k_cache, v_cache)):
        got, expected, before = (c.view(-1, kv_heads, head_dim).cpu() for c in (got, expected, before))
        assert got.dtype == before.dtype
        assert same(got[written], expected[written])
        assert not torch.equal(got[written], before[written])
        assert torch.equal(got[~written], before[~written])  # nothing written anywhere else
    assert all(torch.equal(now, then) for now, then in zip((x, weight, positions, slot_mapping), inputs_before))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 5, 17, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim,k,tile", [
    (4, 2, 64, 300, {}),  # GQA, the model's tile: 32 dims of a head + their partners per program
    (2, 1, 128, 256, {}),  # head_dim 128 as Llama's, EVEN_K
    (3, 3, 16, 70, SKINNY_SMALL_TILE),  # MHA, 8 pairs per program = a whole head
    (4, 1, 32, 48, SKINNY_SMALL_TILE),  # MQA, two programs per head
])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_rotary_and_store_kv_equals_skinny_gemm_then_rotary(dtype, m, heads, kv_heads, head_dim, k, tile, bias):
    """q, the K/V caches (the written slots and every other one) and the inputs, against
    `skinny_gemm` then `rotary_and_store_kv`'s kernel, at random positions (one repeated)
    and slots per row."""
    case = _skinny_rotary_case(m, heads, kv_heads, head_dim, k, dtype, bias)
    _check_skinny_rotary(m, heads, kv_heads, head_dim, case, tile)


@pytest.mark.parametrize("tile", [{}, SKINNY_SMALL_TILE])
def test_skinny_gemm_rotary_and_store_kv_converts_to_the_cache_dtype(tile):
    """An fp32 cache gets the bf16 results converted, as the rotary kernel does."""
    case = _skinny_rotary_case(5, 2, 1, 64, 96, torch.bfloat16, True, cache_dtype=torch.float32)
    _check_skinny_rotary(5, 2, 1, 64, case, tile)


def test_fused_skinny_gemms_reject_shapes_they_cannot_split():
    x, weight, _ = _inputs(6, 32, torch.bfloat16, False, m=3)
    with pytest.raises(ValueError):
        gemv.skinny_gemm_silu_and_mul(x, weight[:5])
    cos, sin = _rotary_tables(4, 8)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    cache = torch.zeros(1, 16, 1, 8, dtype=torch.bfloat16, device=DEVICE)  # 1 kv head of 8: 48 rows are 4 q heads
    x, weight, _ = _inputs(48, 32, torch.bfloat16, False, m=3)
    with pytest.raises(ValueError):
        gemv.skinny_gemm_rotary_and_store_kv(x, weight, None, cos, sin, slots, cache, cache.clone(), slots, num_heads=3)
    with pytest.raises(ValueError):  # 16 pairs per program do not divide 4 dims
        gemv.skinny_gemm_rotary_and_store_kv(x, weight, None, cos, sin, slots, cache, cache.clone(), slots, num_heads=4,
                                             block_n=32, block_k=16)
    qkv, wide = torch.empty(6144, 16, device="meta"), torch.empty(16384, 16, device="meta")
    assert gemv.rotary_fits(17, qkv, 128) and not gemv.rotary_fits(17, qkv, 32)
    assert gemv.rotary_fits(17, wide, 128) and not gemv.rotary_fits(17, wide, 64)


def test_the_model_fuses_the_skinny_gemm_where_the_plain_path_takes_it(monkeypatch):
    from gpu_target import model as model_module

    wide = model_module.Linear(16, 4096, bias=False).to(torch.bfloat16)
    rows = {m: torch.randn(m, 16, dtype=torch.bfloat16) for m in (1, 2, 17, 32, 33)}
    assert not any(model_module._fuses_epilogue(x, wide) for x in rows.values())  # CPU tensors
    monkeypatch.setattr(gemv, "_stream_cpu_tensors_when_interpreting", True)
    for m, x in rows.items():
        assert model_module._fuses_epilogue(x, wide) == (gemv._interpreting() and m <= 32)
    narrow = model_module.Linear(16, 8, bias=False).to(torch.bfloat16)
    assert not model_module._fuses_epilogue(rows[2], narrow)  # skinny_wins: cuBLAS, unfused


def _tiny_runner(architecture, request):
    from gpu_target.kv_cache import KVCachePool
    from gpu_target.loader import load_config, load_state_dict
    from gpu_target.model import build_model
    from gpu_target.runner import ModelRunner

    model_dir = request.getfixturevalue(f"tiny_{architecture}_dir")
    config = load_config(model_dir)
    dtype = torch.bfloat16
    model = build_model(config, load_state_dict(model_dir, config, dtype, DEVICE), dtype, DEVICE)
    return config, ModelRunner(model, KVCachePool(config, 6, 16, dtype, DEVICE), DEVICE)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # qwen2: the qkv bias
def test_tree_verification_through_the_fused_skinny_gemms_equals_the_unfused_kernels(architecture, request, monkeypatch):
    """A 5-row step of a tiny model in bf16 (tree nodes sharing positions) with every op on
    its kernel, fused and unfused: the same logits and the same KV cache, bit for bit. The
    tiny matrices are narrower than `skinny_wins` takes, so the test lets every one stream,
    on a tile whose 8 rotary pairs fit the 16-dim heads."""
    from gpu_target import model as model_module
    from gpu_target.runner import SequenceChunk

    config, runner = _tiny_runner(architecture, request)
    if not CUDA:
        monkeypatch.setattr(gemv, "_stream_cpu_tensors_when_interpreting", True)
    monkeypatch.setattr(fused_ops, "_wants_triton", lambda x, use_triton: True)
    monkeypatch.setattr(gemv, "skinny_wins", lambda m, n: m <= 32)
    tile = dict(block_n=16, block_k=32, num_warps=1, num_stages=1, w_first=True)
    monkeypatch.setattr(gemv, "skinny_tile", lambda n, block_m: tile)
    prompt = [5, 17, 42, 8, 99, 3, 61, 7, 12, 13, 40, 41, 2, 9, 77, 30, 31, 33, 28]
    runner.forward([SequenceChunk(prompt, range(len(prompt)), [4, 1], 0, [len(prompt) - 1])])
    n = len(prompt)
    ancestors = [0b1, 0b11, 0b101, 0b1011, 0b10101]  # a root, two children, a grandchild under each
    tree = SequenceChunk([23, 50, 51, 60, 61], [n, n + 1, n + 1, n + 2, n + 2], [4, 1], n, list(range(5)), ancestors)
    kv_before = runner.kv_pool.storage.clone()

    calls = []
    for name in ("skinny_gemm_silu_and_mul", "skinny_gemm_rotary_and_store_kv", "skinny_gemm"):
        original = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda *args, _f=original, _n=name, **kw: calls.append(_n) or _f(*args, **kw))
    fused = runner.forward([tree])
    fused_kv = runner.kv_pool.storage.clone()
    expected_calls = ["skinny_gemm_rotary_and_store_kv", "skinny_gemm_silu_and_mul", "skinny_gemm", "skinny_gemm"]
    assert sorted(calls) == sorted(expected_calls * config.num_layers + ["skinny_gemm"])  # + the LM head

    runner.kv_pool.storage.copy_(kv_before)
    calls.clear()
    monkeypatch.setattr(model_module, "_fuses_epilogue", lambda x, projection: False)
    unfused = runner.forward([tree])
    assert calls == ["skinny_gemm"] * (4 * config.num_layers + 1)
    assert torch.equal(fused, unfused)
    assert torch.equal(fused_kv, runner.kv_pool.storage)
    assert not torch.equal(fused_kv, kv_before)
