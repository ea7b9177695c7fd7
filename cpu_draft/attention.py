"""The reference paged attention with its per-forward set-up done once per forward, not per layer.

`gpu_target.attention.reference_attention` rebuilds the visibility mask, the gather
indices and the padding of ragged queries in every layer, from the same metadata. For a
small draft model those dozens of tiny ops per layer cost as much as the matmuls. This
callable computes them on the first layer of a forward and reuses them in the others;
what reaches scaled_dot_product_attention is the same tensors, so results are identical.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from gpu_target.attention import AttentionMetadata, visibility_mask


@dataclass
class _Prepared:
    slots: torch.Tensor  # int64 [B, S]: cache slot of each storage index
    mask: torch.Tensor  # bool [B, 1, group*Q, S]
    rows: torch.Tensor  # int64 [T]: each new token's row in the padded [B*Q] layout


class PerForwardAttention:
    def __init__(self) -> None:
        self._meta: Optional[AttentionMetadata] = None
        self._prepared: Optional[_Prepared] = None

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        T, H, D = query.shape
        KVH = k_cache.shape[2]
        group = H // KVH
        if meta is not self._meta:
            self._meta, self._prepared = meta, _prepare(meta, k_cache.shape[1], group, query.device)
        prep = self._prepared
        B, Q = meta.num_seqs, meta.max_query_len
        k = k_cache.view(-1, KVH, D)[prep.slots].to(query.dtype).permute(0, 2, 1, 3)  # [B, KVH, S, D]
        v = v_cache.view(-1, KVH, D)[prep.slots].to(query.dtype).permute(0, 2, 1, 3)
        padded = query.new_zeros(B * Q, H, D)
        padded[prep.rows] = query
        q = padded.view(B, Q, KVH, group, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, group * Q, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=prep.mask, scale=scale)
        out = out.view(B, KVH, group, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H, D)
        return out[prep.rows]


def _prepare(meta: AttentionMetadata, block_size: int, group: int, device: torch.device) -> _Prepared:
    B, Q, S = meta.num_seqs, meta.max_query_len, meta.max_seq_len
    pos = torch.arange(S, device=device)
    tables = meta.block_tables.to(device).long()
    slots = tables[:, pos // block_size].clamp(min=0) * block_size + pos % block_size
    mask = visibility_mask(meta, device)
    mask = mask.unsqueeze(1).unsqueeze(1).expand(B, 1, group, Q, S).reshape(B, 1, group * Q, S)
    rows = torch.tensor([b * Q + i for b, q_len in enumerate(meta.query_lens_host) for i in range(q_len)], dtype=torch.long, device=device)
    return _Prepared(slots, mask, rows)
