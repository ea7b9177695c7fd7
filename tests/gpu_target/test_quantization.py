"""Quantised targets (gpu_target/quantization): formats, checkpoint layouts, kernels, engine.

- FP8 / int4 quantise-dequantise round trips stay within each format's error bound.
- GPTQ, AWQ and FP8 checkpoints written here in their published layouts load to the weights
  their tensors encode (dequantised reference computed here, independently of the loader).
- The Triton weight-only GEMV / skinny GEMM (Triton's interpreter without a GPU) match a
  dequantise-then-matmul reference; `QuantizedLinear` dispatches by rows (FP8's W8A8
  kernels: tests/gpu_target/test_fp8_gemm.py).
- An engine generates with each method; speculative greedy equals plain greedy (float32)
  on a quantised target; bad combinations fail naming `quantization`.
"""
from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from gpu_target import gemv, int4_dequant
from gpu_target.loader import load_config, load_state_dict, random_state_dict
from gpu_target.model import build_model
from gpu_target.quantization import fp8, int4
from gpu_target.quantization.checkpoint import AWQ_PACK_ORDER
from gpu_target.quantization.linear import QuantizedLinear
from hetero import LLM, SamplingParams
from hetero.core.config import EngineConfig

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of France is", "def add(a, b):", "Once upon a time"]


# --------------------------------------------------------------------------- formats


def test_fp8_round_trip_within_e4m3_rounding():
    weight = torch.randn(48, 200) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different scales
    weight[5] = 0.0
    quantized = fp8.quantize_fp8(weight)
    assert quantized.qweight.dtype == torch.float8_e4m3fn and quantized.scales.shape == (48,)
    scale = quantized.scales[:, None]
    # E4M3: 3 mantissa bits (half a step = 2^-4 relative); subnormals step 2^-9 (half: 2^-10) times the scale.
    bound = torch.maximum(weight.abs() * 2.0**-4, scale * 2.0**-10) * 1.0001
    assert ((quantized.dequantize(torch.float32) - weight).abs() <= bound).all()
    assert quantized.dequantize(torch.float32)[5].eq(0).all()
    assert torch.allclose((weight.abs().amax(1) / 448).clamp(min=1e-12), quantized.scales)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k,group", [(256, 128), (576, 128), (64, 32)])  # 576: a last group of 64
def test_int4_round_trip_within_half_a_step(symmetric, k, group):
    weight = torch.randn(40, k) * 0.05 + (0.0 if symmetric else 0.01)
    quantized = int4.quantize_int4(weight, group, symmetric=symmetric)
    groups = -(-k // group)
    assert quantized.qweight.shape == (40, k // 2) and quantized.scales.shape == (40, groups)
    assert (quantized.zeros is None) == symmetric
    step = quantized.scales.float()[:, torch.arange(k) // group]
    error = (quantized.dequantize(torch.float32) - weight).abs()
    # Half a step, plus the fp16 rounding of the scale at the grid's ends (15 steps x 2^-11, relative).
    assert (error <= step * (0.5 + 15 * 2.0**-11) + 1e-7).all()
    assert quantized.codes().max() <= 15


def test_nibble_packing_round_trips_with_even_k_low():
    codes = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = int4.pack_nibbles(codes)
    assert packed.shape == (5, 6) and torch.equal(packed[:, 0] & 15, codes[:, 0]) and torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(int4.unpack_nibbles(packed), codes)


def test_fused_int4_weights_need_one_grouping():
    a, b = int4.quantize_int4(torch.randn(8, 64), 32), int4.quantize_int4(torch.randn(8, 64), 16)
    with pytest.raises(ValueError, match="group size"):
        int4.Int4Weight.cat([a, b])
    with pytest.raises(ValueError, match="even number of columns"):
        int4.quantize_int4(torch.randn(8, 64), 33)
    mixed = int4.Int4Weight.cat([a, int4.quantize_int4(torch.randn(8, 64), 32, symmetric=True)])
    assert torch.equal(mixed.zeros[8:], torch.full((8, 2), 8, dtype=torch.uint8))


# --------------------------------------------------------------------------- checkpoints in the published layouts

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _pack_rows_of_8(values: np.ndarray) -> np.ndarray:
    """AutoGPTQ's qweight packing: int [K, N] -> int32 [K/8, N], code 8i + j in bits 4j of word i."""
    packed = np.zeros((values.shape[0] // 8, values.shape[1]), dtype=np.uint32)
    for j in range(8):
        packed |= values[j::8].astype(np.uint32) << (4 * j)
    return packed.view(np.int32)


def _pack_columns_of_8(values: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """int [R, N] -> int32 [R, N/8], nibble i of word c holding column 8c + order[i] (GPTQ's qzeros;
    AWQ's qweight and qzeros with its interleaved order)."""
    packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        packed |= values[:, order[i]::8].astype(np.uint32) << (4 * i)
    return packed.view(np.int32)


def _quantized_copy(source: pathlib.Path, target: pathlib.Path, quantization_config: dict, write_projection) -> dict:
    """A copy of the tiny checkpoint whose projections `write_projection(name, weight) -> (tensors,
    reference dequantised weight)` rewrites; returns the references by HF weight name."""
    target.mkdir(parents=True)
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, target / file.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config))
    tensors, references = {}, {}
    for file in source.glob("*.safetensors"):
        for name, tensor in load_file(file).items():
            if any(f".{p}.weight" in name for p in PROJECTIONS):
                written, references[name] = write_projection(name, tensor)
                tensors.update({name.removesuffix("weight") + key: value for key, value in written.items()})
            else:
                tensors[name] = tensor
    save_file(tensors, target / "model.safetensors")
    return references


def _input_of(name: str) -> str:
    """Projections that read the same input share GPTQ's act-order (its Hessian is the input's): q/k/v, gate/up."""
    layer = name.split(".")[2]
    return layer + ("qkv" if any(f"{p}_proj" in name for p in "qkv") else "gate_up" if "gate" in name or "up_" in name else name)


def _random_int4_tensors(name: str, weight: torch.Tensor, group: int, generator: torch.Generator, g_idx_by_input: dict):
    """Random codes, fp16 scales, zero points 1..15 and a group index for an [N, K] weight:
    (codes [K, N], scales [G, N], zeros [G, N], g_idx [K], the dequantised [N, K] weight).
    With `g_idx_by_input` (act-order) each input's columns are assigned to groups at random."""
    n, k = weight.shape
    codes = torch.randint(0, 16, (k, n), generator=generator)
    scales = (torch.rand(k // group, n, generator=generator) * 0.02 + 0.001).half()
    zeros = torch.randint(1, 16, (k // group, n), generator=generator)
    g_idx = torch.arange(k) // group
    if g_idx_by_input is not None:
        g_idx = g_idx_by_input.setdefault(_input_of(name), g_idx[torch.randperm(k, generator=generator)])
    reference = (codes - zeros[g_idx]).float() * scales[g_idx].float()  # [K, N]
    return codes, scales, zeros, g_idx, reference.t().contiguous()


def _assert_loads_to(directory: pathlib.Path, references: dict, **kwargs):
    config = load_config(directory)
    state = load_state_dict(directory, config, torch.float32, "cpu", **kwargs)
    model = build_model(config, state, torch.float32, "cpu")
    for i, layer in enumerate(model.layers):
        hf = f"model.layers.{i}."
        fused = {
            layer.self_attn.qkv_proj: [hf + f"self_attn.{p}_proj.weight" for p in "qkv"],
            layer.self_attn.o_proj: [hf + "self_attn.o_proj.weight"],
            layer.mlp.gate_up_proj: [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
            layer.mlp.down_proj: [hf + "mlp.down_proj.weight"],
        }
        for module, names in fused.items():
            assert isinstance(module, QuantizedLinear)
            expected = torch.cat([references[name] for name in names])
            torch.testing.assert_close(module.quantized.dequantize(torch.float32), expected, rtol=0, atol=0)
    return model


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_checkpoint_loads_its_weights(tiny_llama_dir, tmp_path, act_order, checkpoint_format):
    generator = torch.Generator().manual_seed(1)
    g_idx_by_input = {} if act_order else None

    def write(name, weight):
        codes, scales, zeros, g_idx, reference = _random_int4_tensors(name, weight, 32, generator, g_idx_by_input)
        stored_zeros = (zeros - 1) if checkpoint_format == "gptq" else zeros  # v1 stores zero points minus one
        tensors = {
            "qweight": torch.from_numpy(_pack_rows_of_8(codes.numpy())),
            "qzeros": torch.from_numpy(_pack_columns_of_8(stored_zeros.numpy())),
            "scales": scales,
            "g_idx": g_idx.to(torch.int32),
        }
        return tensors, reference

    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": act_order, "sym": False,
              "checkpoint_format": checkpoint_format}
    references = _quantized_copy(tiny_llama_dir, tmp_path / "gptq", config, write)
    model = _assert_loads_to(tmp_path / "gptq", references)
    assert (model.layers[0].self_attn.qkv_proj.quantized.perm is not None) == act_order
    # An act-order layer runs on its permuted columns: the output is x @ W^T all the same.
    x = torch.randn(3, 64)
    expected = F.linear(x, torch.cat([references[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]))
    torch.testing.assert_close(model.layers[0].self_attn.qkv_proj(x), expected)


def test_awq_checkpoint_loads_its_weights(tiny_qwen2_dir, tmp_path):
    generator = torch.Generator().manual_seed(2)

    def write(name, weight):
        codes, scales, zeros, _, reference = _random_int4_tensors(name, weight, 32, generator, None)
        tensors = {
            "qweight": torch.from_numpy(_pack_columns_of_8(codes.numpy(), AWQ_PACK_ORDER)),
            "qzeros": torch.from_numpy(_pack_columns_of_8(zeros.numpy(), AWQ_PACK_ORDER)),
            "scales": scales,
        }
        return tensors, reference

    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    references = _quantized_copy(tiny_qwen2_dir, tmp_path / "awq", config, write)
    model = _assert_loads_to(tmp_path / "awq", references, quantization="awq")
    assert model.layers[0].self_attn.qkv_proj.bias is not None  # Qwen2's q/k/v bias, full precision


def test_awq_pack_order_is_autoawqs():
    """AutoAWQ packs column order_map[i] of each 8 into nibble i with order_map = [0, 2, 4, 6, 1, 3, 5, 7]."""
    row = np.arange(8)[None, :]
    word = int(_pack_columns_of_8(row, AWQ_PACK_ORDER).view(np.uint32)[0, 0])
    assert [(word >> (4 * i)) & 15 for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("scheme", ["fp8-per-tensor", "compressed-tensors-channel", "fp8-block"])
def test_fp8_checkpoint_loads_its_weights(tiny_llama_dir, tmp_path, scheme):
    def write(name, weight):
        if scheme == "fp8-per-tensor":  # vLLM's serialised FP8: one scale per tensor, a static input scale
            scale = weight.abs().max() / 448
            codes = (weight / scale).to(torch.float8_e4m3fn)
            return {"weight": codes, "weight_scale": scale.reshape(()), "input_scale": torch.tensor(0.1)}, codes.float() * scale
        if scheme == "compressed-tensors-channel":
            scale = weight.abs().amax(1, keepdim=True) / 448
            codes = (weight / scale).to(torch.float8_e4m3fn)
            return {"weight": codes, "weight_scale": scale}, codes.float() * scale
        scale_inv = torch.rand(-(-weight.shape[0] // 16), -(-weight.shape[1] // 16)) * 0.01 + 0.001  # 16 x 16 blocks
        codes = torch.randn(weight.shape).clamp(-400, 400).to(torch.float8_e4m3fn)
        expanded = scale_inv.repeat_interleave(16, 0)[: weight.shape[0]].repeat_interleave(16, 1)[:, : weight.shape[1]]
        return {"weight": codes, "weight_scale_inv": scale_inv}, codes.float() * expanded

    config = {
        "fp8-per-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
        "compressed-tensors-channel": {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                          "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}},
        },
        "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]},
    }[scheme]
    references = _quantized_copy(tiny_llama_dir, tmp_path / scheme, config, write)
    if scheme != "fp8-block":
        _assert_loads_to(tmp_path / scheme, references, quantization="fp8")
        return
    # Blocks are re-quantised per channel: within E4M3's rounding of the block-dequantised weight.
    config_ = load_config(tmp_path / scheme)
    model = build_model(config_, load_state_dict(tmp_path / scheme, config_, torch.float32, "cpu"), torch.float32, "cpu")
    got = model.layers[1].mlp.down_proj.quantized.dequantize(torch.float32)
    expected = references["model.layers.1.mlp.down_proj.weight"]
    assert ((got - expected).abs() <= expected.abs() * 2.0**-4 + 1e-6).all()


def test_mismatched_and_unknown_methods_fail_naming_quantization(tiny_llama_dir, tmp_path):
    config = load_config(tiny_llama_dir)
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        EngineConfig(model=str(tiny_llama_dir), quantization="nf4")
    with pytest.raises(ValueError, match="quantization='gptq' needs a checkpoint"):
        load_state_dict(tiny_llama_dir, config, torch.float32, "cpu", quantization="gptq")
    references = _quantized_copy(tiny_llama_dir, tmp_path / "ckpt", {"quant_method": "fp8"},
                                 lambda name, w: ({"weight": w.to(torch.float8_e4m3fn), "weight_scale": torch.tensor(1.0)}, w))
    assert references
    with pytest.raises(ValueError, match="quantization='int4' does not match .*'fp8'"):
        load_state_dict(tmp_path / "ckpt", config, torch.float32, "cpu", quantization="int4")
    (tmp_path / "bad").mkdir()
    for file in (tmp_path / "ckpt").iterdir():
        shutil.copy(file, tmp_path / "bad" / file.name)
    bad = json.loads((tmp_path / "bad" / "config.json").read_text())
    bad["quantization_config"] = {"quant_method": "gptq", "bits": 3}
    (tmp_path / "bad" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="3 bits are not supported"):
        load_state_dict(tmp_path / "bad", config, torch.float32, "cpu")


def test_cli_takes_quantization():
    from hetero.cli import build_parser

    args = build_parser().parse_args(["serve", "some-model", "--quantization", "fp8"])
    assert args.quantization == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "some-model", "--quantization", "nf4"])


# --------------------------------------------------------------------------- kernels

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

FORMATS = {
    "fp8": fp8.quantize_fp8,
    "int4-asym": lambda w: int4.quantize_int4(w, 128),
    "int4-sym": lambda w: int4.quantize_int4(w, 128, symmetric=True),
    "int4-g32": lambda w: int4.quantize_int4(w, 32),
    "int4-g64": lambda w: int4.quantize_int4(w, 64),
}


def _kernel_case(fmt: str, m: int, n: int, k: int, dtype: torch.dtype, bias: bool):
    generator = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=generator).to(DEVICE, dtype)
    weight = FORMATS[fmt]((torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE))
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    # The reference: W dequantised exactly (codes times scales, in float32), then a float64 matmul;
    # the kernels never round W to x's dtype (scales apply to fp32 sums), so only the output's rounding remains.
    expected = F.linear(x.double(), weight.dequantize(torch.float32).double(), None if b is None else b.double())
    return x, weight, b, expected


def _tolerance(dtype: torch.dtype, fmt: str) -> dict:
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    return dict(rtol=ulp, atol=2e-2 if dtype == torch.bfloat16 else 4e-3)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,bias", [(37, 296, False), (64, 256, True), (6, 2056, False)])
def test_quantized_gemv_matches_dequantised_matmul(fmt, dtype, n, k, bias):
    x, weight, b, expected = _kernel_case(fmt, 1, n, k, dtype, bias)
    got = gemv.gemv(x, weight, b)
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, **_tolerance(dtype, fmt))


def test_quantized_gemv_small_tiles_cover_every_row_and_column():
    x, weight, _, expected = _kernel_case("int4-g32", 1, 9, 72, torch.float16, False)
    got = gemv.gemv(x, weight, block_n=4, block_k=16, num_warps=1)
    torch.testing.assert_close(got.double(), expected, **_tolerance(torch.float16, "int4"))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,bias", [(2, 37, 296, False), (17, 70, 256, True), (33, 130, 520, True), (64, 33, 136, False)])
def test_quantized_skinny_gemm_matches_dequantised_matmul(fmt, dtype, m, n, k, bias):
    x, weight, b, expected = _kernel_case(fmt, m, n, k, dtype, bias)
    got = gemv.skinny_gemm(x, weight, b)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, **_tolerance(dtype, fmt))


@pytest.mark.parametrize("w_first", [False, True])
def test_quantized_skinny_gemm_small_tiles_and_strided_rows(w_first):
    x, weight, _, _ = _kernel_case("int4-g32", 5, 40, 96, torch.bfloat16, False)
    wide = torch.zeros(5, 128, dtype=torch.bfloat16, device=DEVICE)
    wide[:, :96] = x
    view = wide[:, :96]  # rows 128 apart
    got = gemv.skinny_gemm(view, weight, block_n=16, block_k=32, num_warps=1, num_stages=1, w_first=w_first)
    expected = F.linear(x.double(), weight.dequantize(torch.float32).double())
    torch.testing.assert_close(got.double(), expected, **_tolerance(torch.bfloat16, "int4"))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4-asym", "int4-g64"])
@pytest.mark.parametrize("m,n,k,tile", [(5, 37, 296, dict(block_n=16, block_k=32, split_k=3)),
                                        (19, 70, 520, dict(block_n=64, block_k=128, split_k=2, num_warps=4)),
                                        (33, 40, 256, dict(block_n=16, block_k=64, split_k=5))])
def test_split_k_skinny_gemm_matches_dequantised_matmul_and_resets_its_counters(fmt, m, n, k, tile):
    """The skinny GEMM with K in shares (the last short or empty, K and N past their last whole
    tiles): the last program of each column tile sums the shares' [M, N] partials."""
    if fmt == "bf16":
        x, quantized, b, _ = _kernel_case("fp8", m, n, k, torch.bfloat16, True)
        weight = quantized.dequantize(torch.bfloat16)
        expected = F.linear(x.double(), weight.double(), b.double())
    else:
        x, weight, b, expected = _kernel_case(fmt, m, n, k, torch.bfloat16, True)
    got = gemv.skinny_gemm(x, weight, b, **{"num_warps": 1, "num_stages": 2, "w_first": True, **tile})
    torch.testing.assert_close(got.double(), expected, **_tolerance(torch.bfloat16, fmt))
    assert not gemv.split_counters(x.device).any()


@pytest.mark.parametrize("fmt", ["fp8", "int4-g32"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_quantized_fused_skinny_gemms_equal_skinny_gemm_then_the_op(fmt, split_k):
    """The fused skinny GEMMs take the skinny GEMM's tile (K whole or in 3 shares) and give its
    result followed by the op's own kernel, bit for bit."""
    tile = dict(block_n=16, block_k=32, num_warps=1, num_stages=1, w_first=True, split_k=split_k)
    # 18 gate/up pairs: a part-filled program
    device = _assert_fused_equal_unfused(fmt, 18, [29, 30, 30, 31, 7], [5, 6, 9, 2, 11], tile, gemv.skinny_gemm,
                                         gemv.skinny_gemm_silu_and_mul, gemv.skinny_gemm_rotary_and_store_kv)
    assert not gemv.split_counters(device).any()


def _assert_fused_equal_unfused(fmt, gate_up_pairs, positions, slots, tile, unfused, silu_and_mul,
                                rotary_and_store_kv) -> torch.device:
    """The fused kernels `silu_and_mul` and `rotary_and_store_kv` (one row per position) give,
    bit for bit, the `unfused` projection followed by the op's own kernel (3 query heads, 1 KV
    head of 16). Returns the device the kernels ran on."""
    from gpu_target import fused_ops

    rows = len(positions)
    x, weight, _, _ = _kernel_case(fmt, rows, 2 * gate_up_pairs, 96, torch.bfloat16, False)
    expected = fused_ops.silu_and_mul(unfused(x * 4, weight, **tile), use_triton=True)
    assert torch.equal(silu_and_mul(x * 4, weight, **tile), expected)

    heads, kv_heads, head_dim = 3, 1, 16
    x, weight, b, _ = _kernel_case(fmt, rows, (heads + 2 * kv_heads) * head_dim, 96, torch.bfloat16, True)
    angles = torch.outer(torch.arange(40, dtype=torch.float64), 0.5 ** torch.arange(head_dim // 2, dtype=torch.float64))
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)
    positions, slots = torch.tensor(positions, device=DEVICE), torch.tensor(slots, device=DEVICE)
    caches = [torch.zeros(1, 16, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]
    q, key, value = unfused(x, weight, b, **tile).view(rows, -1, head_dim).split([heads, kv_heads, kv_heads], 1)
    expected_q = fused_ops.rotary_and_store_kv(q, key, value, cos, sin, positions, *caches[2:], slots, use_triton=True)
    got_q = rotary_and_store_kv(x, weight, b, cos, sin, positions, *caches[:2], slots, heads, **tile)
    assert torch.equal(got_q, expected_q) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0
    return x.device


@pytest.mark.parametrize("fmt", ["bf16", *FORMATS])
@pytest.mark.parametrize("n,k,tile", [(37, 296, dict(block_n=8, block_k=64, split_k=3)),
                                      (64, 256, dict(block_n=16, block_k=128, split_k=2)),
                                      (40, 256, dict(block_n=16, block_k=128, split_k=2)),
                                      (16, 1024, dict(block_n=16, block_k=128, split_k=16)),
                                      (6, 2056, dict(block_n=4, block_k=512, split_k=5))])
@pytest.mark.parametrize("prefetch", [False, True])
def test_split_k_gemv_matches_dequantised_matmul_and_resets_its_counters(fmt, n, k, tile, prefetch):
    """K split in shares (the last share short or empty, K past the last whole tile, N past the
    last whole row tile, K in whole tiles or not, half the shares empty): the last program of
    each row tile sums the shares; with ``prefetch`` each tile's loads are issued a tile ahead
    (4-bit, K in whole tiles: unmasked), and the sums are bit for bit the same."""
    tile = dict(tile, prefetch=prefetch)
    if fmt == "bf16":
        x, quantized, b, _ = _kernel_case("fp8", 1, n, k, torch.bfloat16, True)
        weight = quantized.dequantize(torch.bfloat16)
        expected = F.linear(x.double(), weight.double(), b.double())
    else:
        x, weight, b, expected = _kernel_case(fmt, 1, n, k, torch.bfloat16, True)
    got = gemv.gemv(x, weight, b, num_warps=1, **tile)
    torch.testing.assert_close(got.double(), expected, **_tolerance(torch.bfloat16, fmt))
    assert not gemv.split_counters(x.device).any()
    if prefetch:
        assert torch.equal(got, gemv.gemv(x, weight, b, num_warps=1, **dict(tile, prefetch=False)))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k,prefetch", [(1, False), (2, False), (2, True)])
def test_int4_gemv_is_exact_where_every_product_and_sum_is(symmetric, dtype, split_k, prefetch):
    """Small integer x, power-of-two scales, every code and zero point: each (q - z) s x and
    every partial sum is exact in fp32, so the GEMV's rearranged sums (`_int4_gemv_sums`:
    codes read as 1 + q/16 and 1 + q/256, the 1s taken off per word) must equal the exact
    product, rounded once, whichever nibble each code sits in. (Triton's interpreter rounds
    fp32 to bf16 toward zero, not to nearest: there bf16 results may sit one ulp below.)"""
    generator = torch.Generator().manual_seed(7)
    n, k, group = 24, 512, 128
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    codes[0] = torch.arange(k) % 16  # every code in every nibble
    scales = (2.0 ** torch.randint(-6, 0, (n, k // group), generator=generator)).half()
    zeros = None if symmetric else torch.randint(0, 16, (n, k // group), generator=generator, dtype=torch.uint8)
    weight = int4.Int4Weight(int4.pack_nibbles(codes).to(DEVICE), scales.to(DEVICE),
                             None if zeros is None else zeros.to(DEVICE), group)
    x = torch.randint(-4, 5, (1, k), generator=generator).to(DEVICE, dtype)
    exact = x.double() @ weight.dequantize(torch.float32).double().t()
    got = gemv.gemv(x, weight, block_n=8, block_k=256, num_warps=1, split_k=split_k, prefetch=prefetch)
    if dtype == torch.bfloat16 and gemv._interpreting():
        torch.testing.assert_close(got.double(), exact, rtol=2.0**-7, atol=0)
        assert torch.equal(got.double(), exact.float().to(dtype).double()) or (got.double().abs() <= exact.abs()).all()
    else:
        assert torch.equal(got, exact.to(dtype))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("m,tile", [(19, dict(block_n=16, block_k=32, num_warps=1, num_stages=1, w_first=False)),
                                    (19, dict(block_n=64, block_k=128, num_warps=4, num_stages=2, w_first=True)),
                                    (40, dict(block_n=64, block_k=128, num_warps=4, num_stages=2, w_first=True))])
def test_int4_skinny_gemm_is_exact_where_every_product_and_sum_is(symmetric, dtype, group, m, tile):
    """As the GEMV's test, for the skinny GEMM (N past the last row tile): it multiplies the
    codes less their zero points (exact in x's dtype; at up to 32 rows, K tiles of 64+ columns
    reordered alike in x and W, `_int4_k_order`) with x and scales each K tile's fp32 sums by
    the group's scale, so here it must give the exact product, rounded once."""
    generator = torch.Generator().manual_seed(11)
    n, k = 80, 384
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    codes[0] = torch.arange(k) % 16
    codes[1] = torch.arange(k) // 8 % 16  # every code in every nibble
    scales = (2.0 ** torch.randint(-6, 0, (n, k // group), generator=generator)).half()
    zeros = None if symmetric else torch.randint(0, 16, (n, k // group), generator=generator, dtype=torch.uint8)
    weight = int4.Int4Weight(int4.pack_nibbles(codes).to(DEVICE), scales.to(DEVICE),
                             None if zeros is None else zeros.to(DEVICE), group)
    x = torch.randint(-4, 5, (m, k), generator=generator).to(DEVICE, dtype)
    exact = x.double() @ weight.dequantize(torch.float32).double().t()
    got = gemv.skinny_gemm(x, weight, **tile)
    if dtype == torch.bfloat16 and gemv._interpreting():  # rounds toward zero there (see the GEMV's test)
        torch.testing.assert_close(got.double(), exact, rtol=2.0**-7, atol=0)
        assert (got.double().abs() <= exact.abs()).all()
    else:
        assert torch.equal(got, exact.to(dtype))


def test_int4_gemv_reads_x_at_any_offset():
    """The 4-bit GEMV loads x eight bytes at a time: a view that starts between them is copied."""
    x, weight, _, expected = _kernel_case("int4-asym", 1, 16, 256, torch.bfloat16, False)
    wide = torch.zeros(1, 257, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 1:] = x
    view = wide[:, 1:]
    assert view.data_ptr() % 8
    torch.testing.assert_close(gemv.gemv(view, weight).double(), expected, **_tolerance(torch.bfloat16, "int4"))


@pytest.mark.parametrize("fmt", ["fp8", "int4-g32"])
@pytest.mark.parametrize("split_k,prefetch", [(1, False), (3, False), (3, True)])
def test_quantized_fused_gemvs_with_several_pairs_a_program_equal_gemv_then_the_op(fmt, split_k, prefetch):
    """The fused GEMVs take the quantised GEMV's tile, 4 row pairs a program here (the model's
    tiny shapes get 1), K whole or split in 3 shares, loads a tile ahead or not: bit for bit
    the GEMV followed by the op's own kernel."""
    tile = dict(block_n=8, block_k=32, num_warps=1, split_k=split_k, prefetch=prefetch)
    # 9 gate/up pairs: a part-filled program
    _assert_fused_equal_unfused(fmt, 9, [29], [5], tile, gemv.gemv, gemv.gemv_silu_and_mul, gemv.gemv_rotary_and_store_kv)


def test_rotary_fusion_keeps_the_plain_kernels_tile_whether_it_splits_k_or_not(monkeypatch):
    """The fused qkv + rotary kernel keeps the plain kernel's tile, K split or whole, at one
    row and above, wherever a program's rotary pairs lie in one head."""
    weight = int4.quantize_int4(torch.randn(5 * 16, 256) / 16, 128)
    tiles = {1: dict(block_n=16, block_k=128, num_warps=1, num_stages=1, split_k=2),
             16: dict(block_n=16, block_k=128, num_warps=1, num_stages=1, w_first=True, split_k=2)}
    monkeypatch.setattr(gemv, "streaming_tile", lambda w, m, **over: dict(tiles[min(m, 16)], **over))
    assert gemv.rotary_fits(1, weight, 16) and gemv.rotary_fits(16, weight, 16)
    tiles[16]["split_k"] = 1
    assert gemv.rotary_fits(16, weight, 16)
    assert not gemv.rotary_fits(16, weight, 12)  # 8 pairs a program do not divide a head's 6


def test_quantized_linear_dispatches_by_rows(monkeypatch):
    linear = QuantizedLinear(256, 64, bias=False)
    linear.load_weight(int4.quantize_int4(torch.randn(64, 256) / 16, 128))
    calls = []
    for module, name in ((gemv, "gemv"), (gemv, "skinny_gemm"), (int4_dequant, "_jit")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    reference = linear.quantized.dequantize(torch.bfloat16)
    for m in (1, 17, 65, 129):
        x = torch.randn(m, 256, dtype=torch.bfloat16)
        torch.testing.assert_close(linear(x).float(), F.linear(x, reference).float(), rtol=2.0**-6, atol=2e-2)
    assert calls == []  # CPU tensors: dequantise with torch, then F.linear
    monkeypatch.setattr(gemv, "_stream_cpu_tensors_when_interpreting", True)
    monkeypatch.setattr(int4_dequant, "_run_cpu_tensors_when_interpreting", True)
    for m in (1, 17, 65, 129):
        x = torch.randn(m, 256, dtype=torch.bfloat16)
        torch.testing.assert_close(linear(x).float(), F.linear(x, reference).float(), rtol=2.0**-6, atol=2e-2)
    # 65 rows: the skinny GEMM on 33 and 32; 129: W dequantised by the Triton pass
    assert calls == (["gemv", "skinny_gemm", "skinny_gemm", "skinny_gemm", "_jit"] if gemv._interpreting() else [])
    with pytest.raises(ValueError, match="does not fit"):
        linear.load_weight(fp8.quantize_fp8(torch.randn(64, 128)))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,group", [(70, 296, 8), (64, 512, 128), (5, 200, 40), (9, 1000, 1000)])
def test_int4_dequantize_kernel_gives_the_weights_torch_gives(monkeypatch, symmetric, dtype, n, k, group):
    """The Triton pass (4-bit rows above the streaming kernels') gives W_stored exactly as
    `dequantize_stored` does: N past the last row tile, K past the last K tile, groups that
    no power-of-two K tile fills (40, and one group of all 1000 columns). (Triton's interpreter
    rounds fp32 to bf16 toward zero: there bf16 must equal the truncated float32 weights.)"""
    monkeypatch.setattr(int4_dequant, "_run_cpu_tensors_when_interpreting", True)
    weight = int4.quantize_int4(torch.randn(n, k).to(DEVICE), group, symmetric=symmetric)
    got = int4_dequant.dequantize(weight, dtype)
    assert got.shape == (n, k) and got.dtype == dtype
    if dtype == torch.bfloat16 and gemv._interpreting():
        bits = weight.dequantize_stored(torch.float32).view(torch.int32) & ~0xFFFF
        assert torch.equal(got, bits.view(torch.float32).to(dtype))
    else:
        assert torch.equal(got, weight.dequantize_stored(dtype))


# --------------------------------------------------------------------------- the engine


def _prompt_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """The engine's logits at every position of one prefill of `tokens`."""
    from gpu_target.runner import SequenceChunk

    return llm.llm_engine.runner.forward([SequenceChunk(tokens, range(len(tokens)), [1, 2], 0, range(len(tokens)))])


# The engines of one test live side by side (and a failed test's until it is collected), so
# each takes a fixed small KV cache instead of its share of GPU memory (gpu_memory_utilization
# counts this process's tensors, the earlier engine's cache among them).
SMALL_CACHE = dict(num_gpu_blocks_override=128)


@pytest.mark.parametrize("quantization, min_agreement", [("fp8", 0.9), ("int4", 0.6)])
def test_engine_generates_and_stays_close_to_full_precision(tiny_llama_dir, quantization, min_agreement):
    plain = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", **SMALL_CACHE)
    quantized = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", **SMALL_CACHE, quantization=quantization)
    assert isinstance(quantized.llm_engine.model.layers[0].mlp.down_proj, QuantizedLinear)
    assert not isinstance(quantized.llm_engine.model.lm_head, QuantizedLinear)  # lm_head stays full precision
    assert all(len(o.outputs[0].token_ids) == 16 for o in quantized.generate(PROMPTS, GREEDY, use_tqdm=False))
    tokens = list(torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(0)).tolist())
    expected, got = _prompt_logits(plain, tokens), _prompt_logits(quantized, tokens)
    agreement = (expected.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agreement >= min_agreement and not torch.equal(expected, got)


def test_quantized_multi_step_decoding_equals_single_step(tiny_llama_dir):
    outs = []
    for steps in (1, 4):
        llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", **SMALL_CACHE, quantization="int4", num_scheduler_steps=steps)
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_dummy_weights_are_quantised_as_drawn(tiny_llama_dir, quantization):
    config = load_config(tiny_llama_dir)
    state = random_state_dict(config, torch.float32, "cpu", quantization=quantization)
    kind = fp8.Fp8Weight if quantization == "fp8" else int4.Int4Weight
    assert isinstance(state["model.layers.0.self_attn.q_proj.weight"], kind)
    assert isinstance(state["model.embed_tokens.weight"], torch.Tensor)
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", **SMALL_CACHE, quantization=quantization, load_format="dummy")
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 16


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_speculative_greedy_equals_plain_greedy_on_a_quantised_target(tiny_llama_dir, quantization):
    from speculation_helpers import PROMPTS as SPEC_PROMPTS
    from speculation_helpers import OracleProposer, speculative_llm

    plain = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", **SMALL_CACHE, quantization=quantization)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    truth = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in plain.generate(SPEC_PROMPTS[:8], params, use_tqdm=False)}
    proposer = OracleProposer(truth, "random", 24, 0.8, vocab=320, seed=3)
    llm = speculative_llm(tiny_llama_dir, proposer, quantization=quantization, **SMALL_CACHE)
    llm.llm_engine.spec_control.always_speculate = True
    for out in llm.generate(SPEC_PROMPTS[:8], params, use_tqdm=False):
        assert out.outputs[0].token_ids == truth[tuple(out.prompt_token_ids)]
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0


def test_quant_decode_bench_counts_the_bytes_a_step_reads(tiny_llama_dir):
    from bench.quant_decode import add_speedups, weight_bytes_read

    config = load_config(tiny_llama_dir)
    model = build_model(config, random_state_dict(config, torch.float32, "cpu", quantization="fp8"), torch.float32, "cpu")
    projections = sum(m.quantized.nbytes for m in model.modules() if isinstance(m, QuantizedLinear))
    h = config.hidden_size
    rest = sum(p.nbytes for name, p in model.named_parameters() if name != "embed_tokens.weight")
    elements = config.num_parameters() - 2 * config.vocab_size * h - (2 * config.num_layers + 1) * h  # untied: embed + lm_head
    output_rows = config.num_layers * (config.q_size + 2 * config.kv_size + h + 2 * config.intermediate_size + h)
    assert projections == elements + 4 * output_rows  # one byte per weight, a float32 scale per output channel
    assert weight_bytes_read(model, batch=3) == projections + rest + 3 * h * 4
    rows = [dict(section="decode", quantization="none", batch=1, tokens_per_s=100.0),
            dict(section="decode", quantization="fp8", batch=1, tokens_per_s=180.0),
            dict(section="prefill", quantization="none", prompt_tokens=512, tokens_per_s=4000.0),
            dict(section="prefill", quantization="int4", prompt_tokens=512, tokens_per_s=1000.0),
            dict(section="prefill", quantization="int4", prompt_tokens=128, tokens_per_s=1000.0)]
    add_speedups(rows)
    assert [r.get("speedup_vs_none") for r in rows] == [1.0, 1.8, 1.0, 0.25, None]


# --------------------------------------------------------------------------- fused epilogues on quantised weights


def _quantized_runner(model_dir, quantization):
    from gpu_target.kv_cache import KVCachePool
    from gpu_target.runner import ModelRunner

    config = load_config(model_dir)
    dtype = torch.bfloat16
    model = build_model(config, load_state_dict(model_dir, config, dtype, DEVICE, quantization=quantization), dtype, DEVICE)
    return config, ModelRunner(model, KVCachePool(config, 6, 16, dtype, DEVICE), DEVICE)


PROMPT = [5, 17, 42, 8, 99, 3, 61, 7, 12, 13, 40, 41, 2, 9, 77, 30, 31, 33, 28]


def _fused_and_unfused(runner, chunk, monkeypatch, names):
    """(fused logits, fused KV, unfused logits, unfused KV, the fused run's calls of `names`)."""
    from gpu_target import model as model_module
    from gpu_target.runner import SequenceChunk

    runner.forward([SequenceChunk(PROMPT, range(len(PROMPT)), [4, 1], 0, [len(PROMPT) - 1])])
    kv_before = runner.kv_pool.storage.clone()
    calls = []
    for name in names:
        original = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda *args, _f=original, _n=name, **kw: calls.append(_n) or _f(*args, **kw))
    fused = runner.forward([chunk])
    fused_kv = runner.kv_pool.storage.clone()
    runner.kv_pool.storage.copy_(kv_before)
    monkeypatch.setattr(model_module, "_fuses_epilogue", lambda x, projection: False)
    unfused = runner.forward([chunk])
    assert not torch.equal(fused_kv, kv_before)
    return fused, fused_kv, unfused, runner.kv_pool.storage, calls


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # qwen2: the qkv bias
def test_quantized_decode_step_through_the_fused_gemvs_equals_the_unfused_kernels(architecture, quantization, request,
                                                                                 monkeypatch):
    """gemv.py's fused GEMVs stream quantised weights too: a bf16 decode step of a quantised
    tiny model gives the same logits and KV cache, bit for bit, fused and unfused."""
    from gpu_target import fused_ops
    from gpu_target.runner import SequenceChunk

    config, runner = _quantized_runner(request.getfixturevalue(f"tiny_{architecture}_dir"), quantization)
    if not CUDA:
        monkeypatch.setattr(gemv, "_stream_cpu_tensors_when_interpreting", True)
    monkeypatch.setattr(fused_ops, "_wants_triton", lambda x, use_triton: True)
    decode = SequenceChunk([23], [len(PROMPT)], [4, 1], len(PROMPT), [0])
    fused, fused_kv, unfused, unfused_kv, calls = _fused_and_unfused(
        runner, decode, monkeypatch, ("gemv_silu_and_mul", "gemv_rotary_and_store_kv"))
    if gemv._interpreting() or CUDA:
        assert sorted(calls) == sorted(["gemv_rotary_and_store_kv", "gemv_silu_and_mul"] * config.num_layers)
    assert torch.equal(fused, unfused) and torch.equal(fused_kv, unfused_kv)


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_quantized_tree_verification_through_the_fused_skinny_gemms_equals_the_unfused_kernels(architecture, quantization,
                                                                                              request, monkeypatch):
    """The same at 5 rows (tree nodes sharing positions), through the fused skinny GEMMs,
    on a tile whose 8 rotary pairs fit the 16-dim heads."""
    from gpu_target import fused_ops
    from gpu_target.runner import SequenceChunk

    config, runner = _quantized_runner(request.getfixturevalue(f"tiny_{architecture}_dir"), quantization)
    if not CUDA:
        monkeypatch.setattr(gemv, "_stream_cpu_tensors_when_interpreting", True)
    monkeypatch.setattr(fused_ops, "_wants_triton", lambda x, use_triton: True)
    tile = dict(block_n=16, block_k=32, num_warps=1, num_stages=1, w_first=True)
    monkeypatch.setattr(gemv.gemv_tiles, "skinny_tile", lambda w_format, n, k, block_m: tile)
    monkeypatch.setattr(gemv.gemv_tiles, "fp8_path", lambda n, k, block_m: "w8a16")  # FP8's fused (W8A16) path
    n = len(PROMPT)
    tree = SequenceChunk([23, 50, 51, 60, 61], [n, n + 1, n + 1, n + 2, n + 2], [4, 1], n, list(range(5)),
                         [0b1, 0b11, 0b101, 0b1011, 0b10101])
    fused, fused_kv, unfused, unfused_kv, calls = _fused_and_unfused(
        runner, tree, monkeypatch, ("skinny_gemm_silu_and_mul", "skinny_gemm_rotary_and_store_kv"))
    if gemv._interpreting() or CUDA:
        assert sorted(calls) == sorted(["skinny_gemm_rotary_and_store_kv", "skinny_gemm_silu_and_mul"] * config.num_layers)
    assert torch.equal(fused, unfused) and torch.equal(fused_kv, unfused_kv)


def test_stabilise_greedy_damps_quantised_output_projections_through_their_scales(tiny_llama_dir):
    from bench.gpu_decode import stabilise_greedy

    config = load_config(tiny_llama_dir)
    model = build_model(config, random_state_dict(config, torch.float32, "cpu", quantization="int4"), torch.float32, "cpu")
    before = [layer.mlp.down_proj.quantized.scales.clone() for layer in model.layers]
    qkv_before = model.layers[0].self_attn.qkv_proj.quantized.scales.clone()
    stabilise_greedy(model, 0.5)
    assert all(torch.equal(layer.mlp.down_proj.quantized.scales, b * 0.5) for layer, b in zip(model.layers, before))
    assert torch.equal(model.layers[0].self_attn.qkv_proj.quantized.scales, qkv_before)


def test_fp8_needs_a_gpu_with_fp8(monkeypatch):
    from gpu_target import quantization

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="quantization='fp8' needs a GPU of compute capability 8.9"):
        quantization.check_device("fp8", "cuda")
    quantization.check_device("int4", "cuda")  # 4-bit kernels need no FP8 hardware
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    quantization.check_device("fp8", "cuda")


def test_quantized_tiles_come_from_the_sweeps_table_else_the_heuristic(tmp_path):
    """bench.quant_gemv --sweep --write-tiles writes the table gemv_tiles reads, keyed by
    format and shape; shapes it lacks take the heuristic (fewer rows a program on narrow W)."""
    from bench.quant_gemv import tile_table
    from gpu_target import gemv_tiles

    gemv_tile = dict(block_n=16, block_k=512, num_warps=4, num_stages=2)
    skinny_tile = dict(block_n=32, block_k=256, num_warps=4, num_stages=4, w_first=True)
    best = [dict(format="fp8", n=6144, k=4096, m=1, us=3.0, tile_dict=gemv_tile),
            dict(format="fp8", n=6144, k=4096, m=1, us=5.0, tile_dict=dict(gemv_tile, block_n=4)),
            dict(format="int4", n=6144, k=4096, m=17, us=4.0, tile_dict=skinny_tile),
            dict(format="fp8", n=6144, k=4096, m=17, us=4.0, tile_dict=dict(skinny_tile, block_n=64, block_k=512))]
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(tile_table(best)))
    table = gemv_tiles.measured_tiles.__wrapped__(path)
    assert gemv_tiles.gemv_tile(gemv.FP8, 6144, 4096, table) == gemv_tile  # the fastest of the two
    assert gemv_tiles.skinny_tile(gemv.INT4, 6144, 4096, 32, table) == skinny_tile
    assert gemv_tiles.skinny_tile(gemv.INT4, 6144, 4096, 64, table)["num_stages"] == 3  # shallower at BLOCK_M 64
    assert gemv_tiles.skinny_tile(gemv.FP8, 6144, 4096, 16, table)["block_k"] == 512
    # (64 + 64) x 512 bf16 in each of 2 buffered stages overflow shared memory: the heuristic's tile
    assert gemv_tiles.skinny_tile(gemv.FP8, 6144, 4096, 64, table) == gemv_tiles.heuristic_skinny_tile("fp8", 6144, 4096, 64)
    # A shape also swept at 64 rows takes that sweep's tile at BLOCK_M 64, whatever its 17-row tile was
    at_64 = dict(skinny_tile, num_warps=8, num_stages=3)
    table = tile_table(best + [dict(format="int4", n=6144, k=4096, m=64, us=9.0, tile_dict=at_64)])
    assert table["skinny"][gemv_tiles.skinny_key("int4", 6144, 4096, 64)] == at_64
    assert table["skinny"][gemv_tiles.skinny_key("int4", 6144, 4096, 32)] == skinny_tile
    assert gemv_tiles.gemv_tile(gemv.FP8, 4096, 4096, table) == gemv_tiles.heuristic_gemv_tile("fp8", 4096, 4096)
    assert gemv_tiles.heuristic_gemv_tile("fp8", 6144, 4096)["block_n"] == 8
    for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)):  # Llama-3-8B: 8 rows of 4 words a thread
        tile = gemv_tiles.heuristic_gemv_tile("int4", n, k)
        assert (tile["block_n"], tile["block_k"], tile["num_warps"]) == (128, 128, 2)
        # 4 programs per SM, else as many shares as allowed: 16, or 2 K tiles each
        assert n // 128 * tile["split_k"] >= 4 * gemv_tiles.SMS or tile["split_k"] == 16 or k // tile["split_k"] < 4 * 128
        assert k // tile["split_k"] >= 2 * 128
    assert gemv_tiles.heuristic_gemv_tile("int4", 28672, 4096)["split_k"] == 4  # 224 row tiles: 896 programs
    assert gemv_tiles.heuristic_gemv_tile("int4", 96, 256) == dict(block_n=4, block_k=128, num_warps=2, num_stages=1,
                                                                  split_k=1, prefetch=True)  # a small model's: 24 programs
    assert gemv_tiles.heuristic_gemv_tile("fp8", 64, 256)["block_n"] == 2
    for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)):  # a warpgroup's 64 W rows over one group
        tile = gemv_tiles.heuristic_skinny_tile("int4", n, k, 32)
        assert (tile["block_n"], tile["block_k"], tile["num_warps"]) == (64, 128, 4)
        assert tile["split_k"] == (1 if n > 8192 else 4 if n == 4096 else 2)  # 64 or 96 column tiles: K in 4 or 2
    assert gemv_tiles.heuristic_skinny_tile("int4", 96, 256, 16)["block_n"] == 16  # a small model's qkv: 6 row tiles


def test_int4_k_tiles_fit_the_groups():
    """The GEMV's 4-bit K tile holds whole groups or lies in one; the skinny GEMM's lies in one."""
    assert gemv.int4_block_k(512, 128, whole_groups=True) == 512
    assert gemv.int4_block_k(512, 128, whole_groups=False) == 128
    assert gemv.int4_block_k(64, 128, whole_groups=False) == 64
    assert gemv.int4_block_k(512, 14336, whole_groups=True) == 512  # per-channel groups of Llama's down_proj K
    assert gemv.int4_block_k(256, 96, whole_groups=True) == 32
    weight = int4.quantize_int4(torch.randn(8, 300), 128)
    assert not gemv.streaming_applies(torch.randn(1, 300, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="multiples of 8"):
        gemv.weight_arguments(weight)
