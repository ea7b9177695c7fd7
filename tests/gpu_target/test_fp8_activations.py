"""RMSNorm and SiLU-and-mul that emit FP8 rows (gpu_target/fp8_activations.py), and the model's use of them.

- Each fused kernel gives `quantize_per_token` of the unfused kernel's output bit for bit
  (scales and E4M3 codes), and the residual stream the unfused add-and-norm gives.
- A tiny FP8 model whose projections all take the W8A8 GEMM feeds qkv, gate_up and down
  from the fused kernels, and its logits and KV cache equal the unfused sequence's.
- bench.quant_gemv --layer's fused and unfused sequences agree; on a GPU the fused one
  replays in a CUDA graph.
Kernels run under Triton's interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_target import fp8_activations, fp8_gemm, fused_ops  # noqa: E402
from gpu_target.quantization import fp8  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 4).to(DEVICE, torch.bfloat16)
    x[0, : k // 3] *= 60  # a row whose largest values dominate its scale
    return x


def _assert_same_quantisation(got: fp8_activations.Fp8Rows, expected: torch.Tensor) -> None:
    codes, scales = fp8_gemm.quantize_per_token(expected)
    assert got.dtype == expected.dtype and got.codes.dtype == fp8.FP8_DTYPE and got.scales.shape == scales.shape
    assert torch.equal(got.scales, scales)
    assert torch.equal(got.codes.view(torch.uint8), codes.view(torch.uint8))


@pytest.mark.parametrize("m,hidden", [(1, 64), (5, 320), (16, 4096), (64, 200)])
def test_rms_norm_fp8_quantises_the_normed_rows_bit_for_bit(m, hidden):
    x = _rows(m, hidden, hidden)
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(3)) + 0.5).to(DEVICE, torch.bfloat16)
    got = fp8_activations.rms_norm_fp8(x, weight, 1e-5)
    _assert_same_quantisation(got, fused_ops.rms_norm(x, weight, 1e-5, use_triton=True))


@pytest.mark.parametrize("m,hidden", [(3, 256), (17, 4096)])
def test_add_rms_norm_fp8_quantises_the_normed_rows_and_returns_the_residual_sum(m, hidden):
    x, residual = _rows(m, hidden, 1), _rows(m, hidden, 2)[:, :]
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(4)) + 0.5).to(DEVICE, torch.bfloat16)
    wide = torch.zeros(m, hidden + 8, dtype=torch.bfloat16, device=DEVICE)
    wide[:, :hidden] = residual  # a strided residual
    got, new_residual = fp8_activations.add_rms_norm_fp8(x, wide[:, :hidden], weight, 1e-5)
    normed, expected_residual = fused_ops.add_rms_norm(x, residual, weight, 1e-5, use_triton=True)
    _assert_same_quantisation(got, normed)
    assert torch.equal(new_residual, expected_residual)


def test_rms_norm_fp8_refuses_a_weight_that_widens_the_rows():
    x = _rows(2, 64, 0)
    with pytest.raises(ValueError, match="float32 weight"):
        fp8_activations.rms_norm_fp8(x, torch.ones(64, device=DEVICE), 1e-5)


@pytest.mark.parametrize("block", [fp8_gemm.QUANT_BLOCK_K, 256])  # rows computed once; longer rows computed twice
@pytest.mark.parametrize("m,inter", [(1, 96), (6, 1000), (64, 300)])
def test_silu_and_mul_fp8_quantises_the_product_bit_for_bit(m, inter, block, monkeypatch):
    monkeypatch.setattr(fp8_gemm, "QUANT_BLOCK_K", block)
    x = _rows(m, 2 * inter, inter)
    if m > 1:
        x[1] = 0  # an all-zero row keeps a finite scale and zero codes
    got = fp8_activations.silu_and_mul_fp8(x)
    _assert_same_quantisation(got, fused_ops.silu_and_mul(x, use_triton=True))


def test_an_fp8_model_quantises_in_its_norms_and_silu_and_gives_the_unfused_logits(tiny_llama_dir, monkeypatch):
    """A bf16 verification step (5 tree nodes) of a tiny FP8 model whose projections all take
    the W8A8 GEMM: qkv and gate_up read their norm's FP8 rows, down_proj SiLU-and-mul's, and
    only o_proj's rows are quantised apart; logits and KV cache equal the step with every
    projection quantising its own rows."""
    from gpu_target import gemv, gemv_tiles
    from gpu_target.kv_cache import KVCachePool
    from gpu_target.loader import load_config, load_state_dict
    from gpu_target.model import build_model
    from gpu_target.runner import ModelRunner, SequenceChunk

    config = load_config(tiny_llama_dir)
    state = load_state_dict(tiny_llama_dir, config, torch.bfloat16, DEVICE, quantization="fp8")
    model = build_model(config, state, torch.bfloat16, DEVICE)
    runner = ModelRunner(model, KVCachePool(config, 6, 16, torch.bfloat16, DEVICE), DEVICE)
    if not CUDA:  # stream CPU tensors through the kernels, and norm and SiLU them in Triton as CUDA tensors are
        monkeypatch.setattr(gemv, "_stream_cpu_tensors_when_interpreting", True)
        monkeypatch.setattr(fused_ops, "_wants_triton", lambda x, use_triton: use_triton is not False)
    monkeypatch.setattr(gemv_tiles, "fp8_path", lambda n, k, block_m: "w8a8")
    calls = []
    for module, name in ((fp8_gemm, "quantize_per_token"), (fp8_activations, "rms_norm_fp8"),
                         (fp8_activations, "add_rms_norm_fp8"), (fp8_activations, "silu_and_mul_fp8")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    prompt = [5, 17, 42, 8, 99, 3, 61, 7, 12, 13, 40, 41]
    n = len(prompt)
    runner.forward([SequenceChunk(prompt, range(n), [4, 1], 0, [n - 1])])
    kv_before = runner.kv_pool.storage.clone()
    tree = SequenceChunk([23, 50, 51, 60, 61], [n, n + 1, n + 1, n + 2, n + 2], [4, 1], n, list(range(5)),
                         [0b1, 0b11, 0b101, 0b1011, 0b10101])
    calls.clear()
    fused = runner.forward([tree])
    fused_kv = runner.kv_pool.storage.clone()
    layers = config.num_layers
    per_layer = ["add_rms_norm_fp8", "quantize_per_token", "add_rms_norm_fp8", "silu_and_mul_fp8"]
    assert calls == ["rms_norm_fp8"] + (per_layer * layers)[1:]  # the first layer's norm adds no residual
    runner.kv_pool.storage.copy_(kv_before)
    for layer in model.layers:
        layer.fuse_fp8_quantization = False
    calls.clear()
    unfused = runner.forward([tree])
    assert calls == ["quantize_per_token"] * (4 * layers)
    assert torch.equal(fused, unfused)
    assert torch.equal(runner.kv_pool.storage, fused_kv) and not torch.equal(fused_kv, kv_before)


def test_bench_layer_sequence_gives_the_same_output_fused_and_unfused():
    """bench.quant_gemv --layer times two sequences of one decoder layer's W8A8 kernels; they
    compute the same thing (the fused one through the norms' and SiLU's FP8 rows)."""
    from bench import quant_gemv

    torch.manual_seed(0)
    layer = quant_gemv.fp8_layer(dict(qkv_proj=(96, 64), o_proj=(64, 64), gate_up_proj=(256, 64), down_proj=(64, 128)),
                                 DEVICE)
    x, residual = _rows(5, 64, 7), _rows(5, 64, 8)
    fused = quant_gemv.w8a8_layer_sequence(layer, x, residual, fused=True)
    unfused = quant_gemv.w8a8_layer_sequence(layer, x, residual, fused=False)
    assert fused.shape == (5, 64) and torch.isfinite(fused.float()).all()
    assert torch.equal(fused, unfused)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
def test_the_fused_layer_sequence_replays_in_a_cuda_graph():
    """The fused kernels size their grids from shapes and sync nothing: captured once, a graph
    replays new rows to the eager result."""
    from bench import quant_gemv

    layer = quant_gemv.fp8_layer(dict(qkv_proj=(384, 256), o_proj=(256, 256), gate_up_proj=(1024, 256),
                                      down_proj=(256, 512)), DEVICE)
    x, residual = _rows(16, 256, 1), _rows(16, 256, 2)
    quant_gemv.w8a8_layer_sequence(layer, x, residual, fused=True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = quant_gemv.w8a8_layer_sequence(layer, x, residual, fused=True)
    x.copy_(_rows(16, 256, 3))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, quant_gemv.w8a8_layer_sequence(layer, x, residual, fused=True))


def test_bench_prices_the_w8a8_paths_with_the_quantisation_the_model_pays():
    from bench.quant_gemv import fastest_as_paid

    times = dict(w8a16=29.1, w8a8=29.8, scaled_mm=50.0)  # W8A8 times with a 4.9 us quantisation in them
    assert fastest_as_paid(times, 4.9, None) == "w8a16"  # o_proj: its rows quantised apart
    assert fastest_as_paid(times, 4.9, 1.0) == "w8a8"  # down_proj: SiLU-and-mul emits them for 1 us more
    assert fastest_as_paid(times, 4.9, 5.0) == "w8a16"
