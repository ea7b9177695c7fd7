"""Paged attention: the metadata every backend reads and the plain-torch reference.

One step's batch is B sequences whose *new* tokens are flattened into T rows. Sequence b
owns rows ``query_start_loc[b]:query_start_loc[b+1]`` and, after this step's K/V are
written, ``seq_lens[b]`` tokens of KV in the paged cache, addressed through its row of
``block_tables``: token at storage index p lives in slot
``block_tables[b, p // block_size] * block_size + p % block_size``.
The new tokens occupy the last ``q_len`` storage indices, so ``ctx = seq_len - q_len``
tokens were cached before the step. Every new token sees all ``ctx`` cached tokens, and
among the new tokens:

* ``tree_mask[t] == 0``: causal (new token i sees new tokens 0..i) — prefill and decode;
* otherwise bit j of ``tree_mask[t]`` says whether it sees new token j — tree
  verification, where new token 0 is the root and the rest are the draft nodes.

Storage order and rotary position differ for tree nodes (siblings share a position),
which is why positions are a separate input of the model, not derived here.

The reference implementation below is the oracle for the fast GPU kernels and the
attention used on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [T]: where each new token's K/V is written
    tree_mask: Optional[torch.Tensor]  # int64 [T] or None when every sequence is causal
    max_query_len: int
    max_seq_len: int
    # Host copies, so the reference path and the scheduler never sync on the device.
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def write_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]
) -> None:
    """Scatter this step's K/V into the paged cache."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def visibility_mask(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """bool [B, max_q, max_seq]: which cached/new tokens each new token attends to.

    Padding rows (beyond a sequence's query length) see storage index 0 only, so softmax
    stays finite; their outputs are discarded.
    """
    B, max_q, max_s = meta.num_seqs, meta.max_query_len, meta.max_seq_len
    q_lens = torch.tensor(meta.query_lens_host, device=device)
    s_lens = torch.tensor(meta.seq_lens_host, device=device)
    ctx = (s_lens - q_lens).view(B, 1, 1)
    qi = torch.arange(max_q, device=device).view(1, max_q, 1)
    kp = torch.arange(max_s, device=device).view(1, 1, max_s)
    new_j = kp - ctx  # index among the new tokens, negative for cached ones
    visible = (kp < ctx) | ((new_j >= 0) & (new_j <= qi))  # causal rule
    if meta.tree_mask is not None:
        bits = _padded_rows(meta.tree_mask.to(device), meta).view(B, max_q, 1)
        shift = new_j.clamp(0, 63)
        tree_visible = (kp < ctx) | ((new_j >= 0) & (((bits >> shift) & 1) == 1))
        visible = torch.where(bits != 0, tree_visible, visible)
    visible &= kp < s_lens.view(B, 1, 1)
    valid_row = qi < q_lens.view(B, 1, 1)
    return torch.where(valid_row, visible, kp == 0)


def _padded_rows(flat: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[T, ...] -> [B, max_q, ...] with zero padding."""
    out = flat.new_zeros((meta.num_seqs, meta.max_query_len, *flat.shape[1:]))
    start = 0
    for b, q_len in enumerate(meta.query_lens_host):
        out[b, :q_len] = flat[start : start + q_len]
        start += q_len
    return out


def gather_kv(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[num_blocks, block_size, KVH, D] -> [B, max_seq, KVH, D] in storage order."""
    block_size = cache.shape[1]
    pos = torch.arange(meta.max_seq_len, device=cache.device)
    tables = meta.block_tables.to(cache.device).long()
    blocks = tables[:, pos // block_size].clamp(min=0)
    slots = blocks * block_size + pos % block_size
    return cache.view(-1, *cache.shape[2:])[slots]


def reference_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of the new tokens over the paged cache (K/V already written). [T, H, D]."""
    T, H, D = query.shape
    KVH = k_cache.shape[2]
    group = H // KVH
    B, max_q, max_s = meta.num_seqs, meta.max_query_len, meta.max_seq_len
    k = gather_kv(k_cache, meta).to(query.dtype)  # [B, S, KVH, D]
    v = gather_kv(v_cache, meta).to(query.dtype)
    q = _padded_rows(query, meta)  # [B, Q, H, D]
    # Fold the query heads of one KV head together: [B, KVH, group*Q, D].
    q = q.view(B, max_q, KVH, group, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, group * max_q, D)
    k = k.permute(0, 2, 1, 3)
    v = v.permute(0, 2, 1, 3)
    mask = visibility_mask(meta, query.device)  # [B, Q, S]
    mask = mask.unsqueeze(1).unsqueeze(1).expand(B, 1, group, max_q, max_s).reshape(B, 1, group * max_q, max_s)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = out.view(B, KVH, group, max_q, D).permute(0, 3, 1, 2, 4).reshape(B, max_q, H, D)
    rows = [out[b, :q_len] for b, q_len in enumerate(meta.query_lens_host)]
    return torch.cat(rows, dim=0)
