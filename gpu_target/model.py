"""One decoder-only transformer definition for the Llama family and Qwen2, CPU and GPU alike.

The model reads flattened tokens of many sequences at once (prefill chunks, decode tokens
and token-tree nodes mixed), with explicit rotary positions, and attends over the paged
KV cache through a pluggable attention function (the torch reference or a GPU kernel).
Q/K/V and gate/up projections are stored fused so a decode step launches few matmuls.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from gpu_target import fp8_activations, fused_ops, gemv
from gpu_target.attention import AttentionMetadata, reference_attention
from gpu_target.fp8_activations import Fp8Rows
from gpu_target.gguf_checkpoint import ROPE_FREQ_FACTORS_NAME
from gpu_target.model_config import ModelConfig
from gpu_target.quantization import contains_quantized
from gpu_target.quantization.linear import QuantizedLinear, fuse_weights, replace_projections, w8a8_path
from gpu_target.tensor_parallel import SINGLE, TensorParallel, local_config, local_vocab_size

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


def rope_inverse_frequencies(config: ModelConfig, freq_factors: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotary inverse frequencies with the config's scaling applied (float64 for exactness)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if freq_factors is not None:
        return inv_freq / freq_factors.to(torch.float64)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, blended, out)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, freq_factors: Optional[torch.Tensor] = None):
        super().__init__()
        inv_freq = rope_inverse_frequencies(config, freq_factors)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def rotate_and_store_kv(self, positions, q, k, v, kv_cache, slot_mapping) -> torch.Tensor:
        """The rotated q; the rotated k and v go into the paged cache at `slot_mapping`."""
        k_cache, v_cache = kv_cache
        return fused_ops.rotary_and_store_kv(q, k, v, self.cos, self.sin, positions, k_cache, v_cache, slot_mapping)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add fused into the norm."""
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)

    def forward_fp8(self, x: torch.Tensor) -> Fp8Rows:
        """`forward`'s rows quantised per token to E4M3, in one kernel, for a W8A8 projection."""
        return fp8_activations.rms_norm_fp8(x, self.weight, self.eps)

    def add_and_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[Fp8Rows, torch.Tensor]:
        """`add_and_norm` with the normed rows quantised per token to E4M3, in one kernel."""
        return fp8_activations.add_rms_norm_fp8(x, residual, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear whose products of 1..64 rows on the GPU stream W through Triton kernels
    (batch-1 decode and tree verification; see gpu_target/gemv.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemv.linear(x, self.weight, self.bias)


def _streamed_weight(projection: nn.Module):
    """The weight gpu_target/gemv.py's kernels stream for `projection`: a `Linear`'s, a
    `QuantizedLinear`'s quantised one, or None (swapped projections: the draft's Int8Linear)."""
    if isinstance(projection, Linear):
        return projection.weight
    return projection.quantized if isinstance(projection, QuantizedLinear) else None


def _fuses_epilogue(x: torch.Tensor, projection: nn.Module) -> bool:
    """Where the projection streams W itself (see gpu_target/gemv.py): at one row (batch-1
    decode) through its GEMV, at 2..32 rows (batch-1 tree verification) where the plain path
    would take the skinny GEMM (a quantised W does, unless FP8 rows take a W8A8 kernel:
    `w8a8_path`), its kernel applies the op after it (rotary and the KV write after qkv,
    SiLU-and-mul after gate_up) in its epilogue, bit for bit as the separate kernels would.
    Swapped projections keep their own forward."""
    weight = _streamed_weight(projection)
    if weight is None or not gemv.streaming_applies(x, weight) or w8a8_path(x, weight) is not None:
        return False
    return x.shape[0] == 1 or not isinstance(weight, torch.Tensor) or gemv.skinny_wins(x.shape[0], weight.shape[0])


def _fp8_input_path(x: torch.Tensor, projection: nn.Module) -> Optional[str]:
    """The W8A8 kernel (`w8a8_path`) `projection` takes for rows like x (their count, dtype
    and device), or None: where it names one, the op before the projection emits its rows
    quantised per token (gpu_target/fp8_activations.py) and the projection's `forward_fp8` takes them."""
    weight = _streamed_weight(projection)
    return None if weight is None else w8a8_path(x, weight)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5

    def forward(self, x, positions, rotary, kv_cache, meta, attention_fn: AttentionFn, fp8_path: Optional[str] = None):
        """x: the normed rows, or with `fp8_path` (`_fp8_input_path` of qkv_proj) those rows quantised (`Fp8Rows`)."""
        c = self.config
        if fp8_path is not None:
            return self._attend(self.qkv_proj.forward_fp8(x, fp8_path), positions, rotary, kv_cache, meta, attention_fn)
        fused = _fuses_epilogue(x, self.qkv_proj)
        weight = _streamed_weight(self.qkv_proj)
        rotary_fused = fused and gemv.rotary_fits(x.shape[0], weight, c.head_dim)
        if rotary_fused and x.shape[0] == 1:
            q = gemv.gemv_rotary_and_store_kv(x, weight, self.qkv_proj.bias, rotary.cos, rotary.sin,
                                              positions, *kv_cache, meta.slot_mapping, c.num_heads)
        elif rotary_fused and x.dtype == torch.bfloat16:
            # bf16 only: on the GPU the fp16 kernel differed from skinny_gemm + the rotary
            # kernel in a few elements by a rounding step (tests/gpu_target/test_gemv.py), bf16 bit for bit.
            q = gemv.skinny_gemm_rotary_and_store_kv(x, weight, self.qkv_proj.bias, rotary.cos,
                                                     rotary.sin, positions, *kv_cache, meta.slot_mapping, c.num_heads)
        else:
            return self._attend(self.qkv_proj(x), positions, rotary, kv_cache, meta, attention_fn)
        return self.o_proj(attention_fn(q, *kv_cache, meta, self.scale).reshape(-1, c.q_size))

    def _attend(self, qkv, positions, rotary, kv_cache, meta, attention_fn: AttentionFn) -> torch.Tensor:
        """o_proj of attention over qkv's rotated q and the cache, once rotated k and v are written."""
        c = self.config
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        q = rotary.rotate_and_store_kv(positions, q, k, v, kv_cache, meta.slot_mapping)
        return self.o_proj(attention_fn(q, *kv_cache, meta, self.scale).reshape(-1, c.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x, fp8_path: Optional[str] = None, fuse_fp8_quantization: bool = False) -> torch.Tensor:
        """x: the normed rows, or with `fp8_path` (`_fp8_input_path` of gate_up_proj) those rows
        quantised (`Fp8Rows`). With `fuse_fp8_quantization`, SiLU-and-mul emits its rows
        quantised where down_proj takes a W8A8 kernel."""
        if fp8_path is not None:
            gate_up = self.gate_up_proj.forward_fp8(x, fp8_path)
        elif _fuses_epilogue(x, self.gate_up_proj):
            fused = gemv.gemv_silu_and_mul if x.shape[0] == 1 else gemv.skinny_gemm_silu_and_mul
            return self.down_proj(fused(x, _streamed_weight(self.gate_up_proj)))
        else:
            gate_up = self.gate_up_proj(x)
        down_path = _fp8_input_path(gate_up, self.down_proj) if fuse_fp8_quantization else None
        if down_path is not None:
            return self.down_proj.forward_fp8(fp8_activations.silu_and_mul_fp8(gate_up), down_path)
        return self.down_proj(fused_ops.silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp  # o_proj and down_proj are row-parallel: their partial sums are all-reduced
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        # Where a projection takes a W8A8 kernel, the norm or SiLU-and-mul before it emits its
        # rows quantised (gpu_target/fp8_activations.py); False quantises them apart (bench.quant_gemv
        # compares; batch_invariant.py runs the MLP row by row on the model dtype's rows).
        self.fuse_fp8_quantization = True

    def forward(self, x, residual, positions, rotary, kv_cache, meta, attention_fn):
        """(this layer's MLP output, the residual stream before it is added).

        Each residual add is fused into the norm after it, vLLM style: the first layer gets
        ``residual=None`` and the embeddings as ``x``; the model's final norm adds the last
        layer's output.
        """
        qkv_path = _fp8_input_path(x, self.self_attn.qkv_proj) if self.fuse_fp8_quantization else None
        norm = self.input_layernorm
        if residual is None:
            residual, x = x, norm(x) if qkv_path is None else norm.forward_fp8(x)
        else:
            x, residual = norm.add_and_norm(x, residual) if qkv_path is None else norm.add_and_norm_fp8(x, residual)
        x = self.tp.all_reduce(self.self_attn(x, positions, rotary, kv_cache, meta, attention_fn, qkv_path))
        gate_up_path = _fp8_input_path(x, self.mlp.gate_up_proj) if self.fuse_fp8_quantization else None
        norm = self.post_attention_layernorm
        x, residual = norm.add_and_norm(x, residual) if gate_up_path is None else norm.add_and_norm_fp8(x, residual)
        out = self.mlp(x, gate_up_path, fuse_fp8_quantization=True) if self.fuse_fp8_quantization else self.mlp(x)
        return self.tp.all_reduce(out), residual


class CausalLM(nn.Module):
    """Llama / Mistral / Qwen2 decoder over a paged KV cache; with `tp`, one rank's shard of it
    (gpu_target/tensor_parallel.py): its heads and MLP slice, and its rows of the vocabulary."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        layer_config = local_config(config, tp.world_size)
        vocab_rows = local_vocab_size(config.vocab_size, tp.world_size)
        self.vocab_start, self.vocab_stop = tp.vocab_range(config.vocab_size)
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(layer_config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, vocab_rows, bias=False)
        self.rotary = RotaryEmbedding(config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; across ranks, each looks up its own vocabulary rows and the all-reduce adds them up."""
        if self.tp.world_size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_stop - self.vocab_start)
        x = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        attention_fn: AttentionFn = reference_attention,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] (normalised); logits come from `compute_logits`."""
        x, residual = self.embed(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta, attention_fn)
        return self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.tp.all_gather_last(gemv.linear(hidden, weight))
        return logits[..., : self.config.vocab_size].float()

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors (as the loaders return them) into the fused parameters."""
        state = dict(state)
        state.pop(ROPE_FREQ_FACTORS_NAME, None)
        own = dict(self.named_parameters())
        take = lambda name: _pop_required(state, name)  # noqa: E731
        _load_vocab_rows(own["embed_tokens.weight"], take("model.embed_tokens.weight"))
        own["norm.weight"].copy_(take("model.norm.weight"))
        if self.lm_head is not None:
            _load_vocab_rows(own["lm_head.weight"], take("lm_head.weight"))
        else:
            state.pop("lm_head.weight", None)
        for i in range(self.config.num_layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            own[ours + "input_layernorm.weight"].copy_(take(hf + "input_layernorm.weight"))
            own[ours + "post_attention_layernorm.weight"].copy_(take(hf + "post_attention_layernorm.weight"))
            layer = self.layers[i]
            _load_projection(layer.self_attn.qkv_proj, [take(f"{hf}self_attn.{p}_proj.weight") for p in "qkv"])
            if self.config.attention_bias:
                bias = [take(f"{hf}self_attn.{p}_proj.bias") for p in "qkv"]
                own[ours + "self_attn.qkv_proj.bias"].copy_(torch.cat(bias, 0))
            _load_projection(layer.self_attn.o_proj, [take(hf + "self_attn.o_proj.weight")])
            _load_projection(layer.mlp.gate_up_proj, [take(f"{hf}mlp.{p}_proj.weight") for p in ("gate", "up")])
            _load_projection(layer.mlp.down_proj, [take(hf + "mlp.down_proj.weight")])
        if state:
            raise ValueError(f"unexpected weights in checkpoint: {sorted(state)[:5]}")


def _load_vocab_rows(param: torch.Tensor, rows: torch.Tensor) -> None:
    """This rank's vocabulary rows; the padding past the vocabulary (last rank) is zeros."""
    param[: rows.shape[0]].copy_(rows)
    param[rows.shape[0]:].zero_()


def _load_projection(module: nn.Module, parts: list) -> None:
    """The HF projections `parts` (fused along N when several) into `module`: copied into a
    `Linear`'s weight, or moved into a `QuantizedLinear` (see `fuse_weights`)."""
    quantized = [not isinstance(part, torch.Tensor) for part in parts]
    if isinstance(module, QuantizedLinear) and all(quantized):
        module.load_weight(fuse_weights(parts))
    elif not any(quantized) and not isinstance(module, QuantizedLinear):
        module.weight.copy_(torch.cat(parts, 0))
    else:
        raise ValueError("checkpoint mixes quantised and full-precision decoder projections")


def _pop_required(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"checkpoint is missing weight {name!r}")
    return state.pop(name)


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """Allocate the model on `device` in `dtype` (no CPU or float32 copy), then copy the weights in.

    The rotary tables are built on the CPU in float64 from the config (and a Llama 3.1
    GGUF's frequency factors, wherever they were loaded), then moved once. Quantised
    projection weights (gpu_target/quantization, from the loader) make the decoder layers'
    projections `QuantizedLinear`s, which take the weights over (`fuse_weights`).
    With `tp`, `state` holds this rank's slices (`Shard.slice_of`) and the model is its shard.
    """
    freq_factors = state.get(ROPE_FREQ_FACTORS_NAME)
    with torch.device("meta"):
        model = CausalLM(config, tp).to(dtype)
        if contains_quantized(state):
            replace_projections(model)
    model = model.to_empty(device=device)  # leaves buffers uninitialised: the rotary tables are rebuilt
    model.rotary = RotaryEmbedding(config, None if freq_factors is None else freq_factors.to("cpu")).to(device)
    model.load_hf_state_dict(state)
    return model.eval().requires_grad_(False)
