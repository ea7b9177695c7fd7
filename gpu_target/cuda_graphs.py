"""CUDA graphs for decode and tree-verification steps.

A step that only decodes or verifies trees (no prefill chunk) is laid out uniformly: B
sequences of Q new tokens each, with B and Q rounded up to a ladder of buckets. Each
(B, Q) bucket is captured once into a CUDA graph over static input buffers; a step then
costs a few host-to-device copies and one graph launch instead of hundreds of kernel
launches from Python, which is what keeps batch-1 decode near the memory roofline.

Padding never touches real data: padding tokens write their K/V into the reserved null
block (block 0, which the allocator never hands out), padding sequences read only that
block, and padding tokens inside a real sequence see only its cached context (their tree
bit lies beyond the sequence length), so no real token sees them.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Sequence

import numpy as np
import torch

from gpu_target.attention import AttentionMetadata
from gpu_target.kv_cache import KVCachePool
from gpu_target.model import CausalLM
from gpu_target.runner import SequenceChunk

logger = logging.getLogger("hetero")

NULL_BLOCK = 0


def bucket_ladder(max_seqs: int, max_query_len: int, max_tokens: int) -> list[tuple[int, int]]:
    """(num_seqs, tokens per sequence) buckets: powers of two, B*Q <= max_tokens, largest first."""
    seqs = [1 << i for i in range(max(max_seqs - 1, 0).bit_length() + 1)]
    queries = [1 << i for i in range(max(max_query_len - 1, 0).bit_length() + 1)]
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
        self.max_blocks_per_seq = -(-max_model_len // self.block_size) + 1
        dev = self.device
        self.input_ids = torch.zeros(max_t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_t, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(max_t, dtype=torch.int64, device=dev)
        self.tree_mask = torch.zeros(max_t, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_b, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.zeros(max_b + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_b, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
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
        logger.info("captured %d CUDA graphs in %.1f s", len(self.graphs), self.capture_seconds)
        return self.capture_seconds

    def _metadata(self, num_seqs: int, query_len: int) -> AttentionMetadata:
        tokens = num_seqs * query_len
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs],
            block_tables=self.block_tables[:num_seqs],
            slot_mapping=self.slot_mapping[:tokens],
            tree_mask=self.tree_mask[:tokens] if query_len > 1 else None,
            max_query_len=query_len,
            max_seq_len=self.max_model_len,
            query_lens_host=[query_len] * num_seqs,
            seq_lens_host=[self.max_model_len] * num_seqs,  # upper bounds; the kernel reads seq_lens
        )

    @torch.inference_mode()
    def _forward(self, num_seqs: int, query_len: int) -> torch.Tensor:
        from gpu_target.triton_attention import paged_attention

        tokens = num_seqs * query_len
        attention = functools.partial(paged_attention, max_query_len=query_len, max_seq_len=self.max_model_len)
        hidden = self.model(
            self.input_ids[:tokens], self.positions[:tokens], self.kv_pool.layers, self._metadata(num_seqs, query_len), attention
        )
        return self.model.compute_logits(hidden)

    def _capture(self, num_seqs: int, query_len: int) -> None:
        self._fill_padding(num_seqs, query_len, real_seqs=0)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(num_seqs, query_len)  # compiles kernels and settles allocations
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(num_seqs, query_len)
        self.graphs[(num_seqs, query_len)] = (graph, logits)

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

    def _fill_padding(self, num_seqs: int, query_len: int, real_seqs: int) -> None:
        """Point the padding sequences of a bucket at the null block."""
        pad = slice(real_seqs, num_seqs)
        self.seq_lens[pad] = 1
        self.block_tables[pad] = NULL_BLOCK
        self.query_start_loc[: num_seqs + 1] = torch.arange(0, (num_seqs + 1) * query_len, query_len, device=self.device)
        tokens = slice(real_seqs * query_len, num_seqs * query_len)
        self.input_ids[tokens] = 0
        self.positions[tokens] = 0
        self.slot_mapping[tokens] = NULL_BLOCK * self.block_size
        self.tree_mask[tokens] = 1

    def run(self, chunks: Sequence[SequenceChunk], bucket: tuple[int, int]) -> torch.Tensor:
        """Replay the bucket's graph for `chunks`; logits of every real token, in chunk order."""
        num_seqs, query_len = bucket
        host = _host_inputs(chunks, num_seqs, query_len, self.block_size, self.max_blocks_per_seq)
        tokens = num_seqs * query_len
        self.input_ids[:tokens].copy_(host["input_ids"], non_blocking=True)
        self.positions[:tokens].copy_(host["positions"], non_blocking=True)
        self.slot_mapping[:tokens].copy_(host["slot_mapping"], non_blocking=True)
        self.tree_mask[:tokens].copy_(host["tree_mask"], non_blocking=True)
        self.seq_lens[:num_seqs].copy_(host["seq_lens"], non_blocking=True)
        self.block_tables[:num_seqs].copy_(host["block_tables"], non_blocking=True)
        self.query_start_loc[: num_seqs + 1].copy_(host["query_start_loc"], non_blocking=True)
        graph, logits = self.graphs[bucket]
        graph.replay()
        rows = torch.from_numpy(host["rows"]).to(self.device, non_blocking=True)
        return logits.index_select(0, rows)


def _host_inputs(chunks: Sequence[SequenceChunk], num_seqs: int, query_len: int, block_size: int, max_blocks: int) -> dict[str, torch.Tensor]:
    """The bucket's input buffers on the host, padding included (pinned for async copies)."""
    tokens = num_seqs * query_len
    input_ids = np.zeros(tokens, np.int64)
    positions = np.zeros(tokens, np.int64)
    slot_mapping = np.full(tokens, NULL_BLOCK * block_size, np.int64)
    tree_mask = np.ones(tokens, np.int64)
    seq_lens = np.ones(num_seqs, np.int32)
    block_tables = np.full((num_seqs, max_blocks), NULL_BLOCK, np.int32)
    rows = []
    for b, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        start = b * query_len
        input_ids[start : start + n] = chunk.token_ids
        positions[start : start + n] = chunk.positions
        table = np.asarray(chunk.block_table, np.int64)
        storage = np.arange(chunk.num_cached, chunk.num_cached + n)
        slot_mapping[start : start + n] = table[storage // block_size] * block_size + storage % block_size
        padding_bits = np.left_shift(np.int64(1), np.arange(n, query_len, dtype=np.int64))
        if chunk.tree_mask is not None:
            tree_mask[start : start + n] = chunk.tree_mask
        else:
            tree_mask[start : start + n] = np.left_shift(np.int64(2), np.arange(n, dtype=np.int64)) - 1  # causal
        tree_mask[start + n : start + query_len] = padding_bits
        seq_lens[b] = chunk.num_cached + n
        block_tables[b, : len(table)] = table
        rows.extend(start + i for i in chunk.logits_indices)
    query_start_loc = np.arange(0, (num_seqs + 1) * query_len, query_len, dtype=np.int32)
    arrays = dict(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        tree_mask=tree_mask,
        seq_lens=seq_lens,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
    )
    pin = torch.cuda.is_available()
    out = {name: torch.from_numpy(value) for name, value in arrays.items()}
    if pin:
        out = {name: tensor.pin_memory() for name, tensor in out.items()}
    out["rows"] = np.asarray(rows, np.int64)
    return out
