"""Contiguous per-sequence KV for the draft on the CPU: one slot per sequence, no gathers.

The storage is ``[layers, 2, slots, kv_heads, capacity, head_dim]``, head-major: sequence
i's K/V for storage index p sits at ``[layer, k_or_v, slot_i, head, p]``. A batch whose
slots are consecutive attends over a plain slice of the storage (a view, nothing copied),
and head-major rows make that slice ``[batch * kv_heads, seq, head_dim]`` without a copy,
which is the shape a batched matmul wants; any other batch takes its slots with one
``index_select`` of whole contiguous rows. Compared with the paged cache this drops, per
layer, the token-by-token gather of every cached K/V and the rebuild of gather indices,
which dominated a small draft model's step on the CPU.

K/V are stored in float32 or bfloat16 (the cache's ``dtype``; `cpu_draft.draft_kv` picks it):
bf16 halves the bytes a forward's attention streams and lets one byte budget hold twice the
tokens. Attention computes in float32 either way: `slot_attention` stores the new K/V rounded
(``.to(dtype)``: nearest even, as the native forward rounds them) and widens what it reads.

Rollback stays O(1): the drafter truncates a length and stale K/V past it is never read
(the mask hides it) and is overwritten by the next write. Slots are handed out lowest
first, and when the storage grows (more slots, or a longer capacity) the live sequences
are packed into the first slots, so a steady batch keeps consecutive slots.

`cpu_draft.lean_model` writes and reads this cache through `slot_attention`, with one
`SlotMetadata` per forward shared by all layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from gpu_target.model_config import ModelConfig

MIN_CAPACITY = 256


@dataclass
class SlotMetadata:
    write_slots: torch.Tensor  # int64 [T]: slot of each new token
    write_positions: torch.Tensor  # int64 [T]: its storage index in the slot
    slots: Union[slice, torch.Tensor]  # the batch's slots, in batch order: a slice when consecutive
    max_seq_len: int
    max_query_len: int
    rows: Optional[torch.Tensor]  # int64 [T]: row of each new token in the padded [B * Q] layout; None if no padding
    mask: Optional[torch.Tensor]  # additive [B * kv_heads, group * Q, S]: 0 where visible, -inf elsewhere; None: all visible


def slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, meta: SlotMetadata) -> torch.Tensor:
    """Write the new tokens' K/V [T, KVH, D], then causal attention of their queries [T, H, D] (pre-scaled): [T, H * D].

    q, k, v and the result are float32; K/V are stored in the cache's dtype and read back widened to
    float32 (BF16 batched matmuls measured several times slower than float32 ones on the CPU).
    """
    k_store, v_store = kv_cache
    k_store[meta.write_slots, :, meta.write_positions] = k.to(k_store.dtype)
    v_store[meta.write_slots, :, meta.write_positions] = v.to(v_store.dtype)
    _, H, D = q.shape
    KVH = k_store.shape[1]
    group = H // KVH
    S, Q = meta.max_seq_len, meta.max_query_len
    keys, values = k_store[:, :, :S], v_store[:, :, :S]
    if isinstance(meta.slots, slice):
        keys, values = keys[meta.slots], values[meta.slots]
    else:
        keys, values = keys.index_select(0, meta.slots), values.index_select(0, meta.slots)
    keys, values = keys.float(), values.float()
    B = keys.shape[0]
    if meta.rows is not None:
        padded = q.new_zeros(B * Q, H, D)
        padded[meta.rows] = q
        q = padded
    # The query heads of one KV head side by side: [B * KVH, group * Q, D].
    q = q.reshape(B, Q, KVH, group, D).permute(0, 2, 3, 1, 4).reshape(B * KVH, group * Q, D)
    keys_t = keys.reshape(B * KVH, S, D).transpose(1, 2)
    scores = torch.bmm(q, keys_t) if meta.mask is None else torch.baddbmm(meta.mask, q, keys_t)
    out = torch.bmm(scores.softmax(-1), values.reshape(B * KVH, S, D))
    out = out.view(B, KVH, group, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H * D)
    return out if meta.rows is None else out[meta.rows]


def causal_slot_mask(query_lens: Sequence[int], seq_lens: Sequence[int], num_kv_heads: int, group: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Additive mask [B * KVH, group * Q, S]: new token i of sequence b sees storage indices <= ctx_b + i.

    None when every query sees every key (one new token per sequence, all equally long).
    Padding rows (i >= q_len_b) see index 0 only, so their softmax stays finite.
    """
    B, Q, S = len(seq_lens), max(query_lens), max(seq_lens)
    if Q == 1 and min(seq_lens) == S:
        return None
    q_lens = torch.tensor(query_lens).view(B, 1, 1)
    ctx = torch.tensor(seq_lens).view(B, 1, 1) - q_lens
    qi = torch.arange(Q).view(1, Q, 1)
    kp = torch.arange(S).view(1, 1, S)
    visible = torch.where(qi < q_lens, kp <= ctx + qi, kp == 0)
    mask = torch.zeros(B, Q, S, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return mask.view(B, 1, 1, Q, S).expand(B, num_kv_heads, group, Q, S).reshape(B * num_kv_heads, group * Q, S)


class SlotHandle:
    """A sequence's slot in a `SlotKVCache` (None while it holds no K/V)."""

    __slots__ = ("slot",)

    def __init__(self) -> None:
        self.slot: Optional[int] = None


class SlotKVCache:
    """Slots of contiguous K/V in ``dtype`` (float32 or bfloat16), grown on demand within a byte budget."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, budget_bytes: int, max_positions: int):
        self.config = config
        self.dtype = dtype
        self.budget_bytes = budget_bytes
        self.max_positions = max_positions
        self.bytes_per_token = config.num_layers * 2 * config.kv_size * torch.empty((), dtype=dtype).element_size()
        self.storage = torch.zeros((config.num_layers, 2, 0, config.num_kv_heads, 0, config.head_dim), dtype=dtype)
        self._holders: list[Optional[SlotHandle]] = []

    @property
    def capacity(self) -> int:
        return self.storage.shape[4]

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer[0], layer[1]) for layer in self.storage]

    def reserve(self, handle: SlotHandle, num_tokens: int) -> bool:
        """A slot with room for ``num_tokens``; False (nothing changed) if that would exceed the budget."""
        if handle.slot is not None and num_tokens <= self.capacity:
            return True
        if handle.slot is None and num_tokens <= self.capacity and None in self._holders:
            handle.slot = self._holders.index(None)
            self._holders[handle.slot] = handle
            return True
        live = [h for h in self._holders if h is not None and h is not handle] + [handle]
        capacity = min(max(MIN_CAPACITY, 1 << (max(num_tokens, self.capacity) - 1).bit_length()), self.max_positions)
        capacity = max(capacity, num_tokens)
        for slots in (max(2 * len(self._holders), len(live)), len(live)):
            if slots * capacity * self.bytes_per_token <= self.budget_bytes:
                self._regrow(live, slots, capacity)
                return True
        return False

    def release(self, handle: SlotHandle) -> None:
        if handle.slot is not None:
            self._holders[handle.slot] = None
            handle.slot = None

    def snapshot(self, handle: SlotHandle, length: int) -> torch.Tensor:
        """[layers, 2, length, kv_heads, head_dim] (a copy), token-major like the paged pool."""
        if handle.slot is None:
            return self.storage[:, :, 0, :, :0].transpose(2, 3).clone()
        return self.storage[:, :, handle.slot, :, :length].transpose(2, 3).clone()

    def metadata(self, handles: Sequence[SlotHandle], cached_lens: Sequence[int], query_lens: Sequence[int]) -> SlotMetadata:
        """Metadata of one forward: sequence b appends ``query_lens[b]`` tokens after ``cached_lens[b]``."""
        slots = [h.slot for h in handles]
        write_slots = [s for s, n in zip(slots, query_lens) for _ in range(n)]
        write_positions = [p for start, n in zip(cached_lens, query_lens) for p in range(start, start + n)]
        seq_lens = [start + n for start, n in zip(cached_lens, query_lens)]
        Q = max(query_lens)
        rows = None
        if any(n != Q for n in query_lens):
            rows = torch.tensor([b * Q + i for b, n in enumerate(query_lens) for i in range(n)], dtype=torch.long)
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        kv_heads = self.config.num_kv_heads
        return SlotMetadata(
            write_slots=torch.tensor(write_slots, dtype=torch.long),
            write_positions=torch.tensor(write_positions, dtype=torch.long),
            slots=slice(slots[0], slots[0] + len(slots)) if consecutive else torch.tensor(slots, dtype=torch.long),
            max_seq_len=max(seq_lens),
            max_query_len=Q,
            rows=rows,
            mask=causal_slot_mask(query_lens, seq_lens, kv_heads, self.config.num_heads // kv_heads, torch.float32),
        )

    def clear(self) -> None:
        """Give the storage back (no sequence may hold a slot): it grows again on demand."""
        if any(holder is not None for holder in self._holders):
            raise RuntimeError("clearing a slot KV cache that sequences still hold")
        L, _, _, kv_heads, _, head_dim = self.storage.shape
        self.storage = torch.zeros((L, 2, 0, kv_heads, 0, head_dim), dtype=self.dtype)
        self._holders = []

    def _regrow(self, live: list[SlotHandle], slots: int, capacity: int) -> None:
        """New storage of ``slots`` x ``capacity``; the live sequences move, in slot order, to the first slots."""
        old, old_capacity = self.storage, self.capacity
        live = sorted(live, key=lambda h: (h.slot is None, h.slot if h.slot is not None else 0))
        L, _, _, kv_heads, _, head_dim = old.shape
        self.storage = torch.zeros((L, 2, slots, kv_heads, capacity, head_dim), dtype=self.dtype)
        for new_slot, handle in enumerate(live):
            if handle.slot is not None:
                self.storage[:, :, new_slot, :, :old_capacity] = old[:, :, handle.slot]
            handle.slot = new_slot
        self._holders = live + [None] * (slots - len(live))
