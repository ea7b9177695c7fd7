"""CUDA graphs for decode and tree-verification steps.

A step that only decodes or verifies trees (no prefill chunk) is laid out uniformly: B
sequences of Q new tokens each, with B and Q rounded up to a ladder of buckets. Each
(B, Q) bucket is captured once into a CUDA graph over static input buffers; a step then
costs a few host-to-device copies and one graph launch instead of hundreds of kernel
launches from Python, which is what keeps batch-1 decode near the memory roofline.

Padding never touches real data: padding tokens write their K/V into the reserved null
block (block 0, which the allocator never hands out) and padding sequences read only that
block. A real sequence with n < Q tokens is given ``seq_len = cached + Q``, because the
kernel derives the cached length as ``seq_len - Q``; its padding tokens sit at storage
indices no real token's tree bits name, so no real token sees them.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
import torch

from gpu_target.attention import AttentionMetadata
from gpu_target.kv_cache import KVCachePool
from gpu_target.model import CausalLM
from gpu_target.runner import DecodeInputs, SequenceChunk

NULL_BLOCK = 0


def bucket_ladder(max_seqs: int, max_query_len: int, max_tokens: int) -> list[tuple[int, int]]:
    """(num_seqs, tokens per sequence) buckets, B*Q <= max_tokens, largest first.

    Powers of two, plus `max_query_len` itself: the usual full tree (root + k nodes) then
    runs in a graph of its own size instead of the next power of two.
    """
    seqs = [1 << i for i in range(max(max_seqs - 1, 0).bit_length() + 1)]
    queries = sorted({1 << i for i in range(max(max_query_len - 1, 0).bit_length())} | {max_query_len})
    ladder = [(b, q) for q in queries for b in seqs if b * q <= max_tokens]
    return sorted(ladder, key=lambda bq: (bq[0] * bq[1], bq[1]), reverse=True)


def _round_up(value: int, buckets: Sequence[int]) -> int:
    return next(b for b in sorted(buckets) if b >= value)


class CudaGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVCachePool,
        max_seqs: int,
        max_query_len: int,
        max_model_len: int,
        max_tokens: int = 2048,
    ):
        self.model = model
        self.kv_pool = kv_pool
        self.device = kv_pool.storage.device
        self.block_size = kv_pool.block_size
        self.max_model_len = max_model_len
        self.ladder = bucket_ladder(max_seqs, max_query_len, max_tokens)
        self.seq_buckets = sorted({b for b, _ in self.ladder})
        self.query_buckets = sorted({q for _, q in self.ladder})
        max_b = max(self.seq_buckets)
        max_t = max(b * q for b, q in self.ladder)
        self.max_blocks_per_seq = -(-(max_model_len + max(self.query_buckets)) // self.block_size)
        self.device_buffers = allocate_buffers(max_t, max_b, self.max_blocks_per_seq, self.device)
        self.host_buffers = allocate_buffers(max_t, max_b, self.max_blocks_per_seq, "cpu", pin=True)
        # Each graph ends at the final hidden states: logits are computed outside it for the
        # real rows only, so no bucket holds a [B*Q, vocab] float32 output of its own.
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_seconds = 0.0

    def capture_all(self) -> float:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        started = time.perf_counter()
        for bucket in self.ladder:
            self._capture(*bucket)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started
        return self.capture_seconds

    def _metadata(self, num_seqs: int, query_len: int) -> AttentionMetadata:
        buffers = bucket_view(self.device_buffers, num_seqs, query_len)
        return AttentionMetadata(
            query_start_loc=buffers["query_start_loc"],
            seq_lens=buffers["seq_lens"],
            block_tables=buffers["block_tables"],
            slot_mapping=buffers["slot_mapping"],
            tree_mask=buffers["tree_mask"] if query_len > 1 else None,
            max_query_len=query_len,
            max_seq_len=self.max_model_len,
            query_lens_host=[query_len] * num_seqs,
            seq_lens_host=[self.max_model_len] * num_seqs,  # upper bounds; the kernel reads seq_lens
        )

    @torch.inference_mode()
    def _forward(self, num_seqs: int, query_len: int) -> torch.Tensor:
        from gpu_target.triton_attention import paged_attention

        buffers = bucket_view(self.device_buffers, num_seqs, query_len)
        return self.model(
            buffers["input_ids"], buffers["positions"], self.kv_pool.layers, self._metadata(num_seqs, query_len), paged_attention
        )

    def _capture(self, num_seqs: int, query_len: int) -> None:
        self._stage([], num_seqs, query_len)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(num_seqs, query_len)  # compiles kernels and settles allocations
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(num_seqs, query_len)
        self.graphs[(num_seqs, query_len)] = (graph, hidden)

    def bucket_for(self, chunks: Sequence[SequenceChunk]) -> tuple[int, int] | None:
        """The bucket a decode/verification batch fits, or None (prefill, too large, or not captured)."""
        if not chunks or any(c.num_cached == 0 or len(c.logits_indices) != len(c.token_ids) for c in chunks):
            return None
        longest = max(len(c.token_ids) for c in chunks)
        if len(chunks) > self.seq_buckets[-1] or longest > self.query_buckets[-1]:
            return None
        if any(c.num_cached + len(c.token_ids) > self.max_model_len for c in chunks):
            return None
        bucket = (_round_up(len(chunks), self.seq_buckets), _round_up(longest, self.query_buckets))
        return bucket if bucket in self.graphs else None

    def _stage(self, chunks: Sequence[SequenceChunk], num_seqs: int, query_len: int) -> list[int]:
        """Lay the chunks out on the host and copy them into the bucket's device buffers.

        The pinned host buffers are reused every step while the copies are asynchronous;
        that is safe because each step's caller waits for its logits (the sampler's host
        copy) before the next step stages anything.
        """
        host = bucket_view(self.host_buffers, num_seqs, query_len)
        rows = fill_host_inputs(host, chunks, query_len, self.block_size)
        device = bucket_view(self.device_buffers, num_seqs, query_len)
        for name in BUFFER_NAMES:
            device[name].copy_(host[name], non_blocking=True)
        return rows

    def run(self, chunks: Sequence[SequenceChunk], bucket: tuple[int, int]) -> torch.Tensor:
        """Replay the bucket's graph for `chunks`; logits of every real token, in chunk order."""
        rows = self._stage(chunks, *bucket)
        graph, hidden = self.graphs[bucket]
        graph.replay()
        if rows == list(range(len(rows))):
            return self.model.compute_logits(hidden[: len(rows)])
        index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, index))

    def decode_inputs(self, chunks: Sequence[SequenceChunk], bucket: tuple[int, int]) -> tuple[DecodeInputs, Callable[[int], torch.Tensor]]:
        """Stage single-token decode chunks in a (B, 1) bucket for several steps in a row.

        Returns views of the real rows' graph inputs (advanced between steps on the
        device) and a function that replays the graph and returns those rows' hidden states.
        """
        self._stage(chunks, *bucket)
        graph, hidden = self.graphs[bucket]
        views = bucket_view(self.device_buffers, *bucket)
        num_real = len(chunks)
        inputs = DecodeInputs(
            *(views[name][:num_real] for name in ("input_ids", "positions", "seq_lens", "slot_mapping", "block_tables"))
        )

        def replay(step: int) -> torch.Tensor:
            graph.replay()
            return hidden[:num_real]

        return inputs, replay


BUFFER_NAMES = ("input_ids", "positions", "slot_mapping", "tree_mask", "seq_lens", "block_tables", "query_start_loc")


def allocate_buffers(max_tokens: int, max_seqs: int, max_blocks: int, device, pin: bool = False) -> dict[str, torch.Tensor]:
    """One set of bucket input buffers: static on the device, or (pinned) staging on the host."""
    int64 = dict(dtype=torch.int64, device=device)
    int32 = dict(dtype=torch.int32, device=device)
    buffers = dict(
        input_ids=torch.zeros(max_tokens, **int64),
        positions=torch.zeros(max_tokens, **int64),
        slot_mapping=torch.zeros(max_tokens, **int64),
        tree_mask=torch.zeros(max_tokens, **int64),
        seq_lens=torch.zeros(max_seqs, **int32),
        block_tables=torch.zeros(max_seqs, max_blocks, **int32),
        query_start_loc=torch.zeros(max_seqs + 1, **int32),
    )
    return {name: t.pin_memory() for name, t in buffers.items()} if pin else buffers


def bucket_view(buffers: dict[str, torch.Tensor], num_seqs: int, query_len: int) -> dict[str, torch.Tensor]:
    """The leading slices of `buffers` that a (num_seqs, query_len) bucket uses."""
    per_token = num_seqs * query_len
    sizes = dict(seq_lens=num_seqs, block_tables=num_seqs, query_start_loc=num_seqs + 1)
    return {name: buffers[name][: sizes.get(name, per_token)] for name in BUFFER_NAMES}


def fill_host_inputs(host: dict[str, torch.Tensor], chunks: Sequence[SequenceChunk], query_len: int, block_size: int) -> list[int]:
    """Lay `chunks` out in a bucket's host buffers as uniform sequences of `query_len` tokens.

    Every slot not covered by a chunk is padding aimed at the null block. Returns the flat
    rows of the tokens whose logits were asked for, in chunk order.
    """
    arrays = {name: tensor.numpy() for name, tensor in host.items()}
    num_seqs = len(arrays["seq_lens"])
    arrays["input_ids"][:] = 0
    arrays["positions"][:] = 0
    arrays["slot_mapping"][:] = NULL_BLOCK * block_size
    arrays["tree_mask"][:] = np.tile(np.left_shift(np.int64(1), np.arange(query_len, dtype=np.int64)), num_seqs)
    arrays["seq_lens"][:] = query_len
    arrays["block_tables"][:] = NULL_BLOCK
    arrays["query_start_loc"][:] = np.arange(0, (num_seqs + 1) * query_len, query_len, dtype=np.int32)
    # The real tokens, gathered in plain lists and written with one numpy assignment per
    # buffer: per-chunk numpy calls cost microseconds each, for every sequence of every step.
    causal = (np.left_shift(np.int64(2), np.arange(query_len, dtype=np.int64)) - 1).tolist()
    index: list[int] = []
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    masks: list[int] = []
    rows: list[int] = []
    for b, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        start = b * query_len
        index.extend(range(start, start + n))
        token_ids.extend(chunk.token_ids)
        positions.extend(chunk.positions)
        table = chunk.block_table
        slots.extend(table[i // block_size] * block_size + i % block_size for i in range(chunk.num_cached, chunk.num_cached + n))
        masks.extend(chunk.tree_mask if chunk.tree_mask is not None else causal[:n])
        rows.extend(start + i for i in chunk.logits_indices)
    if index:
        arrays["input_ids"][index] = token_ids
        arrays["positions"][index] = positions
        arrays["slot_mapping"][index] = slots
        arrays["tree_mask"][index] = masks
    if chunks:
        arrays["seq_lens"][: len(chunks)] = [chunk.num_cached + query_len for chunk in chunks]
        width = max(len(chunk.block_table) for chunk in chunks)
        arrays["block_tables"][: len(chunks), :width] = [
            list(chunk.block_table) + [NULL_BLOCK] * (width - len(chunk.block_table)) for chunk in chunks
        ]
    return rows
