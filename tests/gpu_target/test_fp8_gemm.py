"""W8A8 FP8 products (gpu_target/fp8_gemm.py) and the rule that routes FP8 rows to them.

- The per-token quantisation kernel gives the torch reference's scales and E4M3 codes bit for bit.
- The Triton FP8 GEMM, with and without split K, equals a float32 product of the same
  quantised activations and weights (tight: only the summation order differs), then
  rounds once to bf16; against the bf16 product it stays within the activations' E4M3 rounding.
- `QuantizedLinear` and the model take the W8A8 kernels where `w8a8_path` names them, the
  W8A16 kernels (fused or not) elsewhere.
Kernels run under Triton's interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_target import fp8_gemm, gemv, gemv_tiles  # noqa: E402
from gpu_target.quantization import fp8, int4  # noqa: E402
from gpu_target.quantization.linear import QuantizedLinear, w8a8_path  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
BF16_ULP = 2.0**-8  # bf16's relative rounding step (8 significant bits)
# The interpreter sums exact products in float32; an H100's FP8 MMA adds them at ~14 bits
# within each BLOCK_K columns (gpu_target/fp8_gemm.py promotes to fp32 after each).
SUM_RTOL = 2.0**-12 if CUDA else 1e-5


def _case(m: int, n: int, k: int, seed: int = 0, bias: bool = False):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 4).to(DEVICE, torch.bfloat16)
    weight = fp8.quantize_fp8((torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE))
    b = torch.randn(n, generator=generator).to(DEVICE, torch.bfloat16) if bias else None
    return x, weight, b


def _w8a8_reference(x: torch.Tensor, weight: fp8.Fp8Weight, bias) -> torch.Tensor:
    """float32 (x's E4M3 codes . W's E4M3 codes) * token scale * channel scale (+ bias)."""
    codes, scales = fp8_gemm.quantize_per_token_reference(x)
    out = (codes.float() @ weight.qweight.float().t()) * scales * weight.scales[None, :]
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize("block_k", [fp8_gemm.QUANT_BLOCK_K, 1024])  # rows loaded once; longer rows read twice
@pytest.mark.parametrize("m,k", [(1, 64), (5, 3000), (17, 4096), (64, 136)])
def test_per_token_quantisation_kernel_equals_the_torch_reference(m, k, block_k, monkeypatch):
    monkeypatch.setattr(fp8_gemm, "QUANT_BLOCK_K", block_k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k), dtype=torch.float32).to(DEVICE, torch.bfloat16)
    x[0, : k // 2] *= 100  # values that round up into the next binade (126.25 -> 128) and saturate nothing
    if m > 1:
        x[1] = 0  # an all-zero row keeps a finite scale and zero codes
    codes, scales = fp8_gemm.quantize_per_token(x)
    expected_codes, expected_scales = fp8_gemm.quantize_per_token_reference(x)
    assert codes.dtype == fp8.FP8_DTYPE and scales.dtype == torch.float32 and scales.shape == (m, 1)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    assert codes.float().abs().amax(dim=1)[0] == fp8.FP8_MAX  # each row's largest value maps to 448


def test_per_token_quantisation_of_strided_rows():
    wide = torch.randn(3, 200, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    codes, scales = fp8_gemm.quantize_per_token(wide[:, :136])
    expected_codes, expected_scales = fp8_gemm.quantize_per_token_reference(wide[:, :136])
    assert torch.equal(scales, expected_scales) and torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("m,n,k,bias", [(2, 96, 256, False), (17, 70, 384, True), (64, 33, 200, False)])
def test_w8a8_gemm_equals_a_float32_product_of_the_same_codes(m, n, k, bias, split_k):
    x, weight, b = _case(m, n, k, seed=m + n + k, bias=bias)
    codes, scales = fp8_gemm.quantize_per_token(x)
    tile = dict(block_n=64, block_k=64, split_k=split_k, num_warps=4, num_stages=2)
    got = fp8_gemm.w8a8_gemm_quantized(codes, scales, weight, b, torch.float32, **tile)
    expected = _w8a8_reference(x, weight, b)
    torch.testing.assert_close(got, expected, rtol=SUM_RTOL, atol=SUM_RTOL * expected.abs().max().item())
    again = fp8_gemm.w8a8_gemm_quantized(codes, scales, weight, b, torch.float32, **tile)
    assert torch.equal(got, again)  # the split counters reset: a second call (a graph replay) sums alike
    assert not fp8_gemm.split_counters(codes.device).any()


@pytest.mark.parametrize("m", [2, 17, 64])
def test_w8a8_gemm_rounds_once_to_bf16_and_stays_within_e4m3_activations_of_bf16(m):
    x, weight, b = _case(m, 96, 512, seed=m, bias=True)
    got = fp8_gemm.w8a8_gemm(x, weight, b)  # gemv_tiles' heuristic tile
    assert got.shape == (m, 96) and got.dtype == torch.bfloat16
    expected = _w8a8_reference(x, weight, b)
    # One rounding to bf16 (the interpreter truncates, the GPU rounds to nearest: at most one step)
    assert ((got.float() - expected).abs() <= 2 * BF16_ULP * expected.abs() + SUM_RTOL * expected.abs().max()).all()
    # Against W8A16 (x unquantised, the same weight): each activation rounded to E4M3 (2^-4 relative)
    w8a16 = F.linear(x.float(), weight.dequantize(torch.float32), b.float())
    assert (got.float() - w8a16).abs().max() <= 0.06 * w8a16.abs().max()
    assert not torch.equal(got.float(), w8a16.bfloat16().float())  # it is W8A8, not W8A16


def test_scaled_mm_is_the_same_w8a8_product():
    x, weight, b = _case(80, 96, 256, bias=True)
    try:
        got = fp8_gemm.scaled_mm(x, weight, b).float()
    except (RuntimeError, NotImplementedError) as error:  # a torch build without _scaled_mm on this device
        pytest.skip(f"torch._scaled_mm unavailable: {error}")
    codes, scales = fp8_gemm.quantize_per_token_reference(x)
    product = (codes.float() @ weight.qweight.float().t()) * scales * weight.scales[None, :]
    magnitude = (codes.float().abs() @ weight.qweight.float().abs().t()) * scales * weight.scales[None, :]
    expected = product.bfloat16().float() + b.float()
    # Another summation order (the GPU's FP8 MMA may accumulate K in reduced precision) errs by a
    # share of the sum of |terms|, not of the result; then the product and its sum with the
    # bias each round to bf16.
    assert ((got - expected).abs() <= 2 * BF16_ULP * (magnitude + expected.abs()) + 1e-6).all()
    w8a16 = F.linear(x.float(), weight.dequantize(torch.float32), b.float())
    assert (got - w8a16).abs().max() <= 0.06 * w8a16.abs().max()


def test_w8a8_tiles_cover_the_sms_and_come_from_the_table():
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):  # Llama-3-8B's projections
        tile = gemv_tiles.heuristic_w8a8_tile(n, k, 64)
        assert -(-n // tile["block_n"]) * tile["split_k"] >= gemv_tiles.SMS * 3 // 4
        assert k // tile["split_k"] >= tile["block_k"]
    assert gemv_tiles.heuristic_w8a8_tile(28672, 4096, 16)["split_k"] == 1  # 448 tiles already
    measured = dict(block_n=128, block_k=256, split_k=4, num_warps=8, num_stages=3)
    table = {"w8a8": {gemv_tiles.skinny_key("fp8", 4096, 4096, 64): measured}, "fp8_paths": {
        gemv_tiles.skinny_key("fp8", 4096, 4096, 16): "w8a16"}}
    assert gemv_tiles.w8a8_tile(4096, 4096, 64, table) == measured
    assert gemv_tiles.w8a8_tile(4096, 4096, 32, table) == gemv_tiles.heuristic_w8a8_tile(4096, 4096, 32)
    assert gemv_tiles.fp8_path(4096, 4096, 16, table) == "w8a16"
    assert gemv_tiles.fp8_path(4096, 4096, 64, table) == gemv_tiles.DEFAULT_FP8_PATH


def _stream(monkeypatch):
    """Without a GPU, stream CPU tensors through the kernels under Triton's interpreter."""
    if not CUDA:
        monkeypatch.setattr(gemv, "_stream_cpu_tensors_when_interpreting", True)


def test_w8a8_path_rule(monkeypatch):
    weight = fp8.quantize_fp8(torch.randn(64, 256))
    rows = {m: torch.randn(m, 256, dtype=torch.bfloat16) for m in (1, 17, 65)}
    assert [w8a8_path(rows[m], weight) for m in rows] == [None, None, None]  # CPU tensors: dequantise
    _stream(monkeypatch)
    weight = fp8.quantize_fp8(torch.randn(64, 256, device=DEVICE))
    rows = {m: x.to(DEVICE) for m, x in rows.items()}
    paths = {}
    monkeypatch.setattr(gemv_tiles, "fp8_path", lambda n, k, block_m: paths.get(block_m, "w8a8"))
    above = "scaled_mm" if CUDA else None  # more rows than the skinny kernels take: torch._scaled_mm on CUDA
    assert [w8a8_path(rows[m], weight) for m in rows] == [None, "w8a8", above]  # 1 row: the W8A16 GEMV
    paths[32] = "w8a16"
    assert w8a8_path(rows[17], weight) is None
    paths[32] = "scaled_mm"  # torch._scaled_mm takes CUDA tensors only: the Triton GEMM elsewhere
    assert w8a8_path(rows[17], weight) == ("scaled_mm" if CUDA else "w8a8")
    assert w8a8_path(rows[17], int4.quantize_int4(torch.randn(64, 256, device=DEVICE), 128)) is None


def test_quantized_linear_takes_the_path_the_rule_names(monkeypatch):
    linear = QuantizedLinear(256, 64, bias=True)
    linear.load_weight(fp8.quantize_fp8(torch.randn(64, 256, device=DEVICE) / 16))
    linear.bias.data = torch.randn(64)
    linear = linear.to(DEVICE, torch.bfloat16)
    calls = []
    for module, name in ((gemv, "gemv"), (gemv, "skinny_gemm"), (fp8_gemm, "w8a8_gemm")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    _stream(monkeypatch)
    path = ["w8a8"]
    monkeypatch.setattr(gemv_tiles, "fp8_path", lambda n, k, block_m: path[0])
    x = torch.randn(17, 256, dtype=torch.bfloat16, device=DEVICE)
    w8a8 = linear(x).float()
    expected = _w8a8_reference(x, linear.quantized, linear.bias)
    torch.testing.assert_close(w8a8, expected, rtol=2 * BF16_ULP, atol=SUM_RTOL * expected.abs().max().item())
    path[0] = "w8a16"
    w8a16 = linear(x).float()
    torch.testing.assert_close(w8a16, F.linear(x.float(), linear.quantized.dequantize(torch.bfloat16).float(),
                                               linear.bias.float()), rtol=2.0**-5, atol=2e-2)
    linear(x[:1])
    assert calls == ["w8a8_gemm", "skinny_gemm", "gemv"]


def test_the_model_fuses_fp8_epilogues_only_on_the_w8a16_path(monkeypatch):
    from gpu_target import model as model_module

    projection = QuantizedLinear(256, 64, bias=False)
    projection.load_weight(fp8.quantize_fp8(torch.randn(64, 256, device=DEVICE)))
    _stream(monkeypatch)
    path = ["w8a8"]
    monkeypatch.setattr(gemv_tiles, "fp8_path", lambda n, k, block_m: path[0])
    x = torch.randn(5, 256, dtype=torch.bfloat16, device=DEVICE)
    assert not model_module._fuses_epilogue(x, projection)  # W8A8: the unfused projection, then the op
    assert model_module._fuses_epilogue(x[:1], projection)  # one row: the fused W8A16 GEMVs
    path[0] = "w8a16"
    assert model_module._fuses_epilogue(x, projection)


def test_the_bench_records_the_fastest_fp8_kernel_per_shape_and_block_m():
    from bench.quant_gemv import fp8_choices

    tile = dict(block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=4)
    rows = [dict(format="fp8", n=4096, k=4096, m=1, us=9.0),  # one row: the GEMV, no choice
            dict(format="fp8", n=4096, k=4096, m=16, fastest="w8a16", w8a8_tile_dict=tile),
            dict(format="fp8", n=4096, k=4096, m=64, fastest="scaled_mm", w8a8_tile_dict=dict(tile, split_k=4)),
            dict(format="fp8", n=6144, k=4096, m=17, fastest="w8a8", w8a8_tile_dict=tile)]
    table = fp8_choices(rows)
    assert gemv_tiles.fp8_path(4096, 4096, 16, table) == "w8a16"
    assert gemv_tiles.fp8_path(4096, 4096, 64, table) == "scaled_mm"
    assert gemv_tiles.fp8_path(6144, 4096, 32, table) == "w8a8"
    assert gemv_tiles.fp8_path(4096, 4096, 32, table) == gemv_tiles.DEFAULT_FP8_PATH  # not timed
    assert gemv_tiles.w8a8_tile(4096, 4096, 64, table)["split_k"] == 4


def test_tree_verification_of_an_fp8_model_runs_every_projection_w8a8(tiny_llama_dir, monkeypatch):
    """A bf16 verification step (5 tree nodes) of a tiny FP8 model: every projection goes
    through the W8A8 GEMM (rotary, KV write and SiLU-and-mul then run apart), and its logits
    stay within E4M3 activation rounding of the same step through the W8A16 skinny kernels."""
    from gpu_target.kv_cache import KVCachePool
    from gpu_target.loader import load_config, load_state_dict
    from gpu_target.model import build_model
    from gpu_target.runner import ModelRunner, SequenceChunk

    config = load_config(tiny_llama_dir)
    state = load_state_dict(tiny_llama_dir, config, torch.bfloat16, DEVICE, quantization="fp8")
    runner = ModelRunner(build_model(config, state, torch.bfloat16, DEVICE), KVCachePool(config, 6, 16, torch.bfloat16, DEVICE),
                         DEVICE)
    _stream(monkeypatch)
    path = ["w8a8"]
    monkeypatch.setattr(gemv_tiles, "fp8_path", lambda n, k, block_m: path[0])
    calls = []
    original = fp8_gemm.w8a8_gemm_quantized  # o_proj's rows quantised apart, the others' by the op before
    monkeypatch.setattr(fp8_gemm, "w8a8_gemm_quantized", lambda *a, **kw: calls.append(a[0].shape) or original(*a, **kw))
    prompt = [5, 17, 42, 8, 99, 3, 61, 7, 12, 13, 40, 41]
    n = len(prompt)
    runner.forward([SequenceChunk(prompt, range(n), [4, 1], 0, [n - 1])])
    kv_before = runner.kv_pool.storage.clone()
    calls.clear()  # the 12-token prefill took the W8A8 GEMM too
    tree = SequenceChunk([23, 50, 51, 60, 61], [n, n + 1, n + 1, n + 2, n + 2], [4, 1], n, list(range(5)),
                         [0b1, 0b11, 0b101, 0b1011, 0b10101])
    w8a8 = runner.forward([tree]).float()
    assert [shape[0] for shape in calls] == [5] * (4 * config.num_layers)  # qkv, o, gate_up, down in every layer
    assert not torch.equal(runner.kv_pool.storage, kv_before)
    runner.kv_pool.storage.copy_(kv_before)
    path[0] = "w8a16"
    w8a16 = runner.forward([tree]).float()
    assert not torch.equal(w8a8, w8a16)
    assert (w8a8 - w8a16).abs().max() <= 0.1 * w8a16.abs().max()
