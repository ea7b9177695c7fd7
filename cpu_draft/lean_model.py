"""The draft model's forward on the CPU in as few torch ops as the maths allows.

`CausalLM`'s forward runs ~60 torch ops per layer (HF-exact rounding casts each norm to
float32 and back, rotary gathers cos/sin and rotates halves in every layer, SDPA gets a
broadcast mask), and on the CPU each op's host cost, not the weights' bytes, sets a small
draft's forward time (bench/results/cpu_draft-*). A draft only proposes: the
target decides what is kept, so the draft's rounding need not match HF's, only its
function. Built once from a loaded `CausalLM`, this forward:

* folds each RMSNorm weight into the columns of the projection after it (and the final
  norm's into a private copy of the logits head), so a norm is x * rsqrt(mean x²);
* folds the attention scale into the Q rows, so scores are a bare matmul;
* reorders the Q and K rows of each head so each rotary pair (i, i + D/2) is adjacent:
  rotary becomes one complex multiply of q and k together, by factors gathered once per
  forward rather than once per layer. Attention is unchanged (q and k share the order);
  `LeanDraftModel.standard_k_order` undoes it for anyone reading K;
* keeps the residual stream in float32 and adds each projection into it in the same op
  (``addmm``) where the weights are plain float32;
* reads K/V head-major (`cpu_draft.slot_kv`), so attention is two batched matmuls over
  views of the cache, with the mask built once per forward (none when nothing is hidden).
  Q, K, V and attention compute in float32 whatever the weights (BF16 batched matmuls and
  softmax measured several times slower on the CPU). The cache stores
  K/V in float32 or bfloat16 (its dtype; a bf16 cache is widened to float32 as it is read).

Projections are plain float32 (MKL), oneDNN-packed BF16 (`PackedLinear`) or INT8
(`Int8Linear`), quantised after folding. `tests/cpu_draft/test_cpu_draft.py` checks logits and K/V
against `CausalLM`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from cpu_draft.packed_linear import PackedLinear, can_pack
from cpu_draft.quantize import Int8Linear
from cpu_draft.slot_kv import SlotMetadata, slot_attention
from gpu_target.model import CausalLM


def rotary_pair_order(head_dim: int) -> torch.Tensor:
    """Row order within a head that puts rotate-half partners side by side: 0, D/2, 1, D/2+1, ..."""
    return torch.arange(head_dim).view(2, head_dim // 2).t().reshape(-1)


def projection(weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype, int8: bool, pack: bool) -> nn.Module:
    """A linear layer over float32 ``weight`` [out, in]: INT8, oneDNN-packed, or plain, in ``dtype``."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight.to(dtype).contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    if int8:
        return Int8Linear(linear, dtype)
    if pack and dtype != torch.float32 and can_pack(dtype):
        return PackedLinear(linear.weight, linear.bias)
    return linear


def add_projection(residual: torch.Tensor, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """residual + proj(x) in one op where ``proj`` is a plain float32 layer without bias."""
    if type(proj) is nn.Linear and proj.bias is None and proj.weight.dtype == torch.float32:
        return torch.addmm(residual, x, proj.weight.t())
    return residual.add_(proj(x))


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its weight (folded into the next projection); ``x`` is float32."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True).add_(eps))


class LeanLayer(nn.Module):
    def __init__(self, layer, config, dtype: torch.dtype, int8: bool, pack: bool, order: torch.Tensor):
        super().__init__()
        c = config
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj.weight.float() * layer.input_layernorm.weight.float()[None, :]
        bias = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.float()
        qkv, bias = _reorder_and_scale_qk(qkv, bias, c, order, attn.scale)
        gate_up = mlp.gate_up_proj.weight.float() * layer.post_attention_layernorm.weight.float()[None, :]
        self.qkv = projection(qkv, bias, dtype, int8, pack)
        self.o = projection(attn.o_proj.weight.float(), None, dtype, int8, pack)
        self.gate_up = projection(gate_up, None, dtype, int8, pack)
        self.down = projection(mlp.down_proj.weight.float(), None, dtype, int8, pack)
        self.eps = layer.input_layernorm.eps
        self.post_eps = layer.post_attention_layernorm.eps
        self.dtype = dtype
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.qk_size, self.intermediate = c.q_size + c.kv_size, c.intermediate_size

    def forward(self, residual: torch.Tensor, rotary: torch.Tensor, kv_cache, meta: SlotMetadata) -> torch.Tensor:
        T, H, KVH, D = residual.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(rms(residual, self.eps).to(self.dtype))
        qk = torch.view_as_complex(qkv[:, : self.qk_size].float().view(T, H + KVH, D // 2, 2))
        qk = torch.view_as_real(qk * rotary).view(T, H + KVH, D)
        v = qkv[:, self.qk_size :].view(T, KVH, D).float()
        out = slot_attention(qk[:, :H], qk[:, H:], v, kv_cache, meta)
        residual = add_projection(residual, self.o, out.to(self.dtype))
        gate_up = self.gate_up(rms(residual, self.post_eps).to(self.dtype))
        act = F.silu(gate_up[:, : self.intermediate]).mul_(gate_up[:, self.intermediate :])
        return add_projection(residual, self.down, act)


class LeanDraftModel(nn.Module):
    def __init__(self, model: CausalLM, dtype: torch.dtype, int8_weights: bool = False, pack_linears: bool = True,
                 head_ids: Optional[torch.Tensor] = None):
        """``head_ids``: the token ids the logits head scores, in order (`cpu_draft.draft_vocab`); None: all."""
        super().__init__()
        c = self.config = model.config
        if c.head_dim % 2:
            raise ValueError(f"rotary needs an even head_dim, got {c.head_dim}")
        self.dtype = dtype
        order = rotary_pair_order(c.head_dim)
        self.standard_k_order = torch.argsort(order)
        self.embed_tokens = model.embed_tokens.weight.detach()
        self.layers = nn.ModuleList(LeanLayer(layer, c, dtype, int8_weights, pack_linears, order) for layer in model.layers)
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        if head_ids is not None:
            head = head[head_ids]
        self.lm_head = projection(head.float() * model.norm.weight.float()[None, :], None, dtype, False, pack_linears)
        self.final_eps = model.norm.eps
        self.register_buffer("rotary", torch.complex(model.rotary.cos.float(), model.rotary.sin.float()), persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: SlotMetadata, last_rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the rows ``last_rows`` [N, head ids]; K/V of every token lands in the cache."""
        residual = F.embedding(input_ids, self.embed_tokens).float()
        rotary = self.rotary[positions].unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches):
            residual = layer(residual, rotary, kv_cache, meta)
        hidden = rms(residual[last_rows], self.final_eps).to(self.dtype)
        return self.lm_head(hidden).float()


def _reorder_and_scale_qk(qkv: torch.Tensor, bias: Optional[torch.Tensor], c, order: torch.Tensor, scale: float):
    """Rows of Q (scaled by ``scale``) and K put in rotary-pair order within each head."""
    def rows(t: torch.Tensor, heads: int, start: int) -> torch.Tensor:
        block = t[start : start + heads * c.head_dim]
        return block.view(heads, c.head_dim, *t.shape[1:])[:, order].reshape(block.shape)

    out_w, out_b = qkv.clone(), None if bias is None else bias.clone()
    for t, out in ((qkv, out_w), (bias, out_b)):
        if t is None:
            continue
        out[: c.q_size] = rows(t, c.num_heads, 0) * scale
        out[c.q_size : c.q_size + c.kv_size] = rows(t, c.num_kv_heads, c.q_size)
    return out_w, out_b
