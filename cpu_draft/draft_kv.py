"""The draft's two KV layouts behind one small interface the `Drafter` drives.

* `SlotDraftKV` (the CPU default): contiguous per-sequence slots (`cpu_draft.slot_kv`)
  read by the native forward (`cpu_draft.native_model`: one C++/OpenMP call per forward)
  where it builds, else by the lean torch forward (`cpu_draft.lean_model`): attention over
  slices of them, norms folded into projections packed for oneDNN (BF16) or quantised (INT8).
* `PagedDraftKV`: the target's paged pool and `ModelRunner`, with the Triton paged kernel
  on CUDA (the in-process GPU draft) or `PerForwardAttention` on the CPU.

The slots layout stores K/V in float32 (the default) or bfloat16 (`slot_kv_dtype`: half the
memory a token holds). The paged layout keeps the model's dtype: its pool is the target's, written by
`CausalLM` (and read by the Triton kernel on CUDA) in the compute dtype.

Both take, per forward, each sequence's handle, its cached length and the tokens to append
(their K/V land right after the cached ones; positions are storage indices), and return
the float32 logits of every feed's last token over the head's ids (the whole vocabulary, or
the reduced one of `cpu_draft.draft_vocab`), or with `forward_top` those logits' k best columns
and probabilities (`cpu_draft.top_probs`; the native forward reads them in its own call).
Rollback is `truncate`, a length change.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from cpu_draft.attention import PerForwardAttention
from cpu_draft.lean_model import LeanDraftModel
from cpu_draft.native_model import NativeDraftModel, NativeSlotMetadata
from cpu_draft.slot_kv import SlotHandle, SlotKVCache
from cpu_draft.top_probs import TOP_K_MAX, top_probabilities
from gpu_target.kv_cache import BlockAllocator, KVCachePool, OutOfBlocks
from gpu_target.model import CausalLM
from gpu_target.runner import ModelRunner, SequenceChunk


KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DRAFT_GRAPH_TOKENS = 256  # catch-up feeds up to this many tokens replay a graph; longer ones (prompts) run eagerly


def slot_kv_dtype(requested: Optional[str]) -> torch.dtype:
    """The slots layout's K/V dtype: ``requested`` ("float32" | "bfloat16"), float32 for None.

    Float32 by default because it measured faster where the CPU draft is used most: on the GPU
    host (`bench/results/cpu_draft-h100host-bf16kv.csv`, side by side) bf16 K/V made a 135M
    draft's forward 18-21 % slower at batch 1 (2.04 -> 2.41 ms INT8), mixed at batch 8 (INT8
    7.2 -> 7.8 ms, BF16 8.8 -> 7.5 ms) and 6-9 % faster only at batch 32; attention there is
    not limited by the bytes it streams. bf16 holds twice the tokens in a memory budget, and
    cost INT8 drafts 1 % of greedy agreement on SmolLM2-135M.
    """
    if requested is None:
        return torch.float32
    if requested not in KV_DTYPES:
        raise ValueError(f"draft K/V dtype must be one of {', '.join(KV_DTYPES)}, got {requested!r}")
    return KV_DTYPES[requested]


class SlotDraftKV:
    def __init__(self, model: CausalLM, dtype: torch.dtype, budget_bytes: int, max_positions: int,
                 pack_linears: bool = True, int8_weights: bool = False, native_kernels: bool = True,
                 kv_dtype: Optional[str] = None, head_ids: Optional[torch.Tensor] = None):
        native = NativeDraftModel.build(model, dtype, int8_weights, head_ids=head_ids) if native_kernels else None
        self.native = native is not None
        self.model = native if native is not None else LeanDraftModel(model, dtype, int8_weights, pack_linears, head_ids)
        self.cache = SlotKVCache(model.config, slot_kv_dtype(kv_dtype), budget_bytes, max_positions)

    new_handle = SlotHandle

    def reserve(self, handle: SlotHandle, num_tokens: int) -> bool:
        return self.cache.reserve(handle, num_tokens)

    def truncate(self, handle: SlotHandle, length: int) -> None:
        """Only a length change; an emptied sequence gives its slot back."""
        if length == 0:
            self.cache.release(handle)

    def release(self, handle: SlotHandle) -> None:
        self.cache.release(handle)

    def holds_kv(self, handle: SlotHandle) -> bool:
        return handle.slot is not None

    def reset(self) -> None:
        """Give the storage back once no sequence holds a slot (after `Drafter.warm_up`): grown
        for its batches, it would be copied whole each time a real sequence needs more room."""
        self.cache.clear()

    def snapshot(self, handle: SlotHandle, length: int) -> torch.Tensor:
        """K with its head dims in the model's standard order, as `CausalLM` would have written it."""
        snapshot = self.cache.snapshot(handle, length)
        snapshot[:, 0] = snapshot[:, 0][..., self.model.standard_k_order]
        return snapshot

    @torch.inference_mode()
    def forward(self, handles: Sequence[SlotHandle], cached_lens: Sequence[int], feeds: Sequence[Sequence[int]]) -> torch.Tensor:
        """Runs the batch in slot order (so consecutive slots attend over a slice) and answers in the caller's."""
        return self._run(handles, cached_lens, feeds, 0)[0]

    @torch.inference_mode()
    def forward_top(self, handles: Sequence[SlotHandle], cached_lens: Sequence[int], feeds: Sequence[Sequence[int]],
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits read by `top_probabilities`: in the native forward's own call where it runs."""
        if not self.native or k > min(TOP_K_MAX, self.model.head_size):
            return top_probabilities(self.forward(handles, cached_lens, feeds), k)
        return self._run(handles, cached_lens, feeds, k)

    def _run(self, handles, cached_lens, feeds, k: int) -> tuple[torch.Tensor, ...]:
        order = sorted(range(len(handles)), key=lambda i: handles[i].slot)
        handles, cached, feeds_sorted = [handles[i] for i in order], [cached_lens[i] for i in order], [feeds[i] for i in order]
        query_lens = [len(f) for f in feeds_sorted]
        T, N = sum(query_lens), len(query_lens)
        # Token ids, positions, slots and last rows in one tensor (one copy from Python), read as views.
        packed = torch.tensor([t for f in feeds_sorted for t in f]
                              + [p for start, n in zip(cached, query_lens) for p in range(start, start + n)]
                              + [h.slot for h, n in zip(handles, query_lens) for _ in range(n)] + _last_rows(query_lens), dtype=torch.long)
        input_ids, positions, slots, last_rows = packed[:T], packed[T : 2 * T], packed[2 * T : 3 * T], packed[3 * T : 3 * T + N]
        if self.native:  # positions are storage indices; no mask or padding to build
            meta = NativeSlotMetadata(slots, positions)
            if k:
                outputs = self.model.forward_top(input_ids, positions, self.cache.storage, meta, last_rows, k)
            else:
                outputs = (self.model(input_ids, positions, self.cache.storage, meta, last_rows),)
        else:
            meta = self.cache.metadata(handles, cached, query_lens)
            outputs = (self.model(input_ids, positions, self.cache.layers, meta, last_rows),)
        if order != sorted(order):
            inverse = torch.tensor(_inverse(order), dtype=torch.long)
            outputs = tuple(t[inverse] for t in outputs)
        return outputs


class PagedDraftKV:
    """The target's paged pool and runner; on CUDA, with CUDA graphs for the one-token
    drafting forwards (vLLM's draft-model runner) unless ``cuda_graphs`` is off."""

    def __init__(self, model: CausalLM, dtype: torch.dtype, device: torch.device, budget_bytes: int, max_num_seqs: int, block_size: int,
                 max_positions: int, kv_dtype: Optional[str] = None, cuda_graphs: bool = True):
        if kv_dtype is not None and KV_DTYPES.get(kv_dtype) != dtype:
            raise ValueError(f"the paged draft KV layout stores K/V in the model's dtype ({dtype}), not {kv_dtype!r}: "
                             "its pool is the target's, written by CausalLM in the compute dtype")
        config = model.config
        per_block = KVCachePool.bytes_per_block(config, block_size, dtype)
        blocks_per_seq = -(-max_positions // block_size)
        num_blocks = max(blocks_per_seq, min(budget_bytes // per_block, max_num_seqs * blocks_per_seq))
        graphed = cuda_graphs and torch.device(device).type == "cuda"
        reserved = 1 if graphed else 0  # the graphs' padding writes into block 0
        self.block_size = block_size
        self.pool = KVCachePool(config, num_blocks + reserved, block_size, dtype, device)
        self.allocator = BlockAllocator(num_blocks, block_size, first_block=reserved)
        graph_runner = None
        if graphed:
            from gpu_target.cuda_graphs import CudaGraphRunner

            graph_runner = CudaGraphRunner(model, self.pool, max_num_seqs, 1, max_positions, max_step_tokens=DRAFT_GRAPH_TOKENS)
            graph_runner.capture_all()
        self.runner = ModelRunner(model, self.pool, device, _paged_attention_for(device), graph_runner)

    def new_handle(self) -> list[int]:
        return []

    def reserve(self, blocks: list[int], num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size) - len(blocks)
        if needed > self.allocator.num_free:
            return False
        try:
            for _ in range(needed):
                blocks.append(self.allocator.allocate())
        except OutOfBlocks:
            return False
        return True

    def truncate(self, blocks: list[int], length: int) -> None:
        """Frees the blocks past ``length``."""
        keep = -(-length // self.block_size)
        if len(blocks) > keep:
            self.allocator.free_all(blocks[keep:])
            del blocks[keep:]

    def release(self, blocks: list[int]) -> None:
        self.truncate(blocks, 0)

    def reset(self) -> None:
        """Nothing to give back: released sequences' blocks are free again."""

    def holds_kv(self, blocks: list[int]) -> bool:
        return bool(blocks)

    def snapshot(self, blocks: list[int], length: int) -> torch.Tensor:
        storage = self.pool.storage
        gathered = storage[:, :, torch.tensor(blocks, dtype=torch.long, device=storage.device)].flatten(2, 3)
        return gathered[:, :, :length].clone()

    def forward(self, handles: Sequence[list[int]], cached_lens: Sequence[int], feeds: Sequence[Sequence[int]]) -> torch.Tensor:
        chunks = [
            SequenceChunk(feed, range(start, start + len(feed)), blocks, start, [len(feed) - 1])
            for blocks, start, feed in zip(handles, cached_lens, feeds)
        ]
        return self.runner.forward(chunks)

    def forward_top(self, handles: Sequence[list[int]], cached_lens: Sequence[int], feeds: Sequence[Sequence[int]],
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return top_probabilities(self.forward(handles, cached_lens, feeds), k)


def _last_rows(query_lens: Sequence[int]) -> list[int]:
    rows, end = [], 0
    for n in query_lens:
        end += n
        rows.append(end - 1)
    return rows


def _inverse(order: Sequence[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, index in enumerate(order):
        inverse[index] = position
    return inverse


def _paged_attention_for(device: torch.device):
    if device.type == "cuda":
        from gpu_target.triton_attention import paged_attention

        return paged_attention
    return PerForwardAttention()


def default_layout(device: torch.device, requested: Optional[str]) -> str:
    """``requested`` if given, else slots on the CPU and paged elsewhere (the Triton kernel reads pages)."""
    if requested is not None:
        if requested not in ("slots", "paged"):
            raise ValueError(f"draft KV layout must be 'slots' or 'paged', got {requested!r}")
        if requested == "slots" and device.type != "cpu":
            raise ValueError(f"the slots KV layout is for the CPU draft, not {device.type}")
        return requested
    return "slots" if device.type == "cpu" else "paged"
