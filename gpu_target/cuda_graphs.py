"""CUDA graphs for decode and tree-verification steps.

A step that only decodes or verifies trees (no prefill chunk) is laid out uniformly: B
sequences of Q new tokens each, with B and Q rounded up to a ladder of buckets. Each
(B, Q) bucket is captured once into a CUDA graph over static input buffers; a step then
costs a few host-to-device copies and one graph launch instead of hundreds of kernel
launches from Python, which is what keeps batch-1 decode near the memory roofline.

A step that prefills (a prompt chunk, alone or beside decodes and trees: under
speculation requests finish unevenly and are admitted one or a few at a time) is laid out
ragged instead: the chunks' tokens back to back, padded to a ladder of token counts
(`Ragged` buckets), beside up to the largest sequence bucket's sequences, the unused ones
empty. Eager, such a step costs more in Python and kernel launches than in GPU work;
replayed, it costs the GPU work.

Padding never touches real data: padding tokens write their K/V into the reserved null
block (block 0, which the allocator never hands out) and padding sequences read only that
block. In a uniform bucket a real sequence with n < Q tokens is given ``seq_len = cached +
Q``, because the kernel derives the cached length as ``seq_len - Q``; its padding tokens sit
at storage indices no real token's tree bits name, so no real token sees them. In a ragged
bucket the padding tokens follow the last sequence's, where no sequence reads them, and
the empty sequences have no tokens at all.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from gpu_target.attention import AttentionMetadata
from gpu_target.kv_cache import NULL_BLOCK, BlockTableRows, KVCachePool
from gpu_target.model import AttentionFn, CausalLM
from gpu_target.runner import DecodeInputs, SequenceChunk, every_index

RAGGED_STEP = 128  # token granularity of the ragged buckets: a prefill's cost grows with its padded tokens


@dataclass(frozen=True)
class Ragged:
    """The bucket of a step that prefills: up to `num_tokens` tokens, packed back to back."""

    num_tokens: int


Bucket = Union[tuple[int, int], Ragged]  # uniform (num_seqs, query_len), or ragged


def bucket_ladder(max_seqs: int, max_query_len: int, max_tokens: int) -> list[tuple[int, int]]:
    """(num_seqs, tokens per sequence) buckets, B*Q <= max_tokens, largest first.

    Powers of two, plus `max_query_len` itself: the usual full tree (root + k nodes) then
    runs in a graph of its own size instead of the next power of two.
    """
    seqs = [1 << i for i in range(max(max_seqs - 1, 0).bit_length() + 1)]
    queries = sorted({1 << i for i in range(max(max_query_len - 1, 0).bit_length())} | {max_query_len})
    ladder = [(b, q) for q in queries for b in seqs if b * q <= max_tokens]
    return sorted(ladder, key=lambda bq: (bq[0] * bq[1], bq[1]), reverse=True)


def ragged_ladder(max_tokens: int) -> list[int]:
    """Token counts of the ragged buckets, largest first: 64, then every multiple of
    RAGGED_STEP up to the first at or above `max_tokens`.

    Steps of a fixed size, not powers of two: a step that prefills a few prompts is
    compute-bound, so padding 630 tokens to 1024 cost 60 % more than it ran eagerly.
    """
    top = -(-max_tokens // RAGGED_STEP) * RAGGED_STEP
    return [*range(top, 0, -RAGGED_STEP), RAGGED_STEP // 2]


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
        max_step_tokens: int = 2048,
        attention_fn: Optional[AttentionFn] = None,
    ):
        self.model = model
        self.attention_fn = attention_fn  # None: gpu_target/triton_attention.py's paged_attention
        self.kv_pool = kv_pool
        self.device = kv_pool.storage.device
        self.block_size = kv_pool.block_size
        self.max_model_len = max_model_len
        self.ladder = bucket_ladder(max_seqs, max_query_len, max_tokens)
        self.ragged = ragged_ladder(max_step_tokens)
        self.seq_buckets = sorted({b for b, _ in self.ladder})
        self.query_buckets = sorted({q for _, q in self.ladder})
        max_b = max(self.seq_buckets)
        max_t = max([b * q for b, q in self.ladder] + self.ragged)
        self.max_blocks_per_seq = -(-(max_model_len + max(self.query_buckets)) // self.block_size)
        self.device_buffers = allocate_buffers(max_t, max_b, self.max_blocks_per_seq, self.device)
        self.host_buffers = allocate_buffers(max_t, max_b, self.max_blocks_per_seq, "cpu", pin=True)
        self._staging_views: dict[Bucket, tuple[dict[str, np.ndarray], list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.table_rows: Optional[BlockTableRows] = None  # the scheduler's mirror of the chunks' block tables, if given
        # Each graph ends at the final hidden states: logits are computed outside it for the
        # real rows only, so no bucket holds a [B*Q, vocab] float32 output of its own.
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_seconds = 0.0

    def release(self) -> None:
        """Free the captured graphs; later steps run eagerly. A graph that captured NCCL
        collectives holds its communicator's resources, so a process group torn down before its
        graphs waits forever (pytorch/pytorch#115388): tensor parallelism calls this first."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def capture_all(self, report: Callable[[str], None] = lambda phase: None) -> float:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool;
        `report` is told each bucket before its warm-up and capture."""
        started = time.perf_counter()
        buckets = [*map(Ragged, self.ragged), *self.ladder]
        for i, bucket in enumerate(buckets):
            report(f"capturing CUDA graph {i + 1}/{len(buckets)} (bucket {bucket})")
            self._capture(bucket)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started
        return self.capture_seconds

    def _shape(self, bucket: Bucket) -> tuple[int, int, int]:
        """(sequences, tokens, max_query_len) of a bucket's layout."""
        if isinstance(bucket, Ragged):
            return self.seq_buckets[-1], bucket.num_tokens, bucket.num_tokens
        num_seqs, query_len = bucket
        return num_seqs, num_seqs * query_len, query_len

    def _metadata(self, bucket: Bucket) -> AttentionMetadata:
        num_seqs, num_tokens, max_query_len = self._shape(bucket)
        buffers = bucket_view(self.device_buffers, num_seqs, num_tokens)
        return AttentionMetadata(
            query_start_loc=buffers["query_start_loc"],
            seq_lens=buffers["seq_lens"],
            block_tables=buffers["block_tables"],
            slot_mapping=buffers["slot_mapping"],
            tree_mask=buffers["tree_mask"] if max_query_len > 1 else None,
            max_query_len=max_query_len,
            max_seq_len=self.max_model_len,
            query_lens_host=[max_query_len] * num_seqs,
            seq_lens_host=[self.max_model_len] * num_seqs,  # upper bounds; the kernel reads seq_lens
        )

    @torch.inference_mode()
    def _forward(self, bucket: Bucket) -> torch.Tensor:
        from gpu_target.triton_attention import paged_attention

        num_seqs, num_tokens, _ = self._shape(bucket)
        buffers = bucket_view(self.device_buffers, num_seqs, num_tokens)
        attention_fn = self.attention_fn or paged_attention
        return self.model(buffers["input_ids"], buffers["positions"], self.kv_pool.layers, self._metadata(bucket), attention_fn)

    def _capture(self, bucket: Bucket) -> None:
        self._stage([], bucket)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(bucket)  # compiles kernels and settles allocations
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(bucket)
        self.graphs[bucket] = (graph, hidden)

    def bucket_for(self, chunks: Sequence[SequenceChunk]) -> Bucket | None:
        """The bucket a step fits: uniform for decodes and trees, ragged for a step that
        prefills; None when it is too large for any (it then runs eagerly)."""
        if not chunks or len(chunks) > self.seq_buckets[-1]:
            return None
        if any(c.num_cached + len(c.token_ids) > self.max_model_len for c in chunks):
            return None
        if any(c.num_cached == 0 or len(c.logits_indices) != len(c.token_ids) for c in chunks):
            num_tokens = sum(len(c.token_ids) for c in chunks)
            if num_tokens > self.ragged[0]:
                return None
            if any(len(c.block_table) > self.max_blocks_per_seq for c in chunks):
                return None
            return Ragged(_round_up(num_tokens, self.ragged))
        longest = max(len(c.token_ids) for c in chunks)
        if longest > self.query_buckets[-1]:
            return None
        bucket = (_round_up(len(chunks), self.seq_buckets), _round_up(longest, self.query_buckets))
        return bucket if bucket in self.graphs else None

    def _stage(self, chunks: Sequence[SequenceChunk], bucket: Bucket) -> list[int]:
        """Lay the chunks out on the host and copy them into the bucket's device buffers.

        The pinned host buffers are reused every step while the copies are asynchronous;
        that is safe because each step's caller waits for its logits (the sampler's host
        copy) before the next step stages anything.
        """
        host, copies = self._staging(bucket)
        if isinstance(bucket, Ragged):
            rows = fill_ragged_host_inputs(host, chunks, self.block_size, self.table_rows)
        else:
            rows = fill_host_inputs(host, chunks, bucket[1], self.block_size, self.table_rows)
        for device, pinned in copies:
            device.copy_(pinned, non_blocking=True)
        return rows

    def _staging(self, bucket: Bucket) -> tuple[dict[str, np.ndarray], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The bucket's host buffers as numpy arrays, and its (device, pinned host) buffer pairs.

        Sliced once per bucket: a dozen tensor slices per step were a measurable share of
        the host time between two speculative steps, which the device spends waiting.
        """
        staging = self._staging_views.get(bucket)
        if staging is None:
            num_seqs, num_tokens, _ = self._shape(bucket)
            host = bucket_view(self.host_buffers, num_seqs, num_tokens)
            device = bucket_view(self.device_buffers, num_seqs, num_tokens)
            staging = {name: host[name].numpy() for name in BUFFER_NAMES}, [(device[name], host[name]) for name in BUFFER_NAMES]
            self._staging_views[bucket] = staging
        return staging

    def run(self, chunks: Sequence[SequenceChunk], bucket: Bucket) -> torch.Tensor:
        """Replay the bucket's graph for `chunks`; logits of the rows they ask for, in chunk order."""
        rows = self._stage(chunks, bucket)
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
        self._stage(chunks, bucket)
        graph, hidden = self.graphs[bucket]
        views = bucket_view(self.device_buffers, bucket[0], bucket[0] * bucket[1])
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


def bucket_view(buffers: dict[str, torch.Tensor], num_seqs: int, num_tokens: int) -> dict[str, torch.Tensor]:
    """The leading slices of `buffers` that a bucket of `num_seqs` sequences and `num_tokens` tokens uses."""
    sizes = dict(seq_lens=num_seqs, block_tables=num_seqs, query_start_loc=num_seqs + 1)
    return {name: buffers[name][: sizes.get(name, num_tokens)] for name in BUFFER_NAMES}


def fill_host_inputs(arrays: dict[str, np.ndarray], chunks: Sequence[SequenceChunk], query_len: int, block_size: int,
                     table_rows: Optional[BlockTableRows] = None) -> list[int]:
    """Lay `chunks` out in a bucket's host buffers (numpy views) as uniform sequences of `query_len` tokens.

    Every slot not covered by a chunk is padding aimed at the null block. Returns the flat
    rows of the tokens whose logits were asked for, in chunk order. With `table_rows`
    holding every chunk's block table (`SequenceChunk.table_row`), the tables are copied
    from there in one gather; when every chunk is `SequenceChunk.sequential`, positions and
    masks are computed for the whole batch from each token's index in its chunk.
    """
    own_bits, query_starts, causal = _uniform_pattern(len(arrays["seq_lens"]), query_len)
    arrays["input_ids"][:] = 0
    arrays["positions"][:] = 0
    arrays["slot_mapping"][:] = NULL_BLOCK * block_size
    arrays["tree_mask"][:] = own_bits
    arrays["seq_lens"][:] = query_len
    arrays["query_start_loc"][:] = query_starts
    if not _gather_block_tables(arrays["block_tables"], chunks, table_rows):
        arrays["block_tables"][:] = NULL_BLOCK
        _write_block_tables(arrays["block_tables"], chunks)
    if not chunks:
        return []
    # Tokens, positions and masks are gathered in plain lists and written with one numpy
    # assignment per buffer, and the cache slots computed for the whole batch at once
    # (`_cache_slots`): per-chunk numpy calls cost microseconds each, for every sequence of every step.
    lens = [len(chunk.token_ids) for chunk in chunks]
    num_cached = [chunk.num_cached for chunk in chunks]
    token_ids: list[int] = []
    sequential = all(chunk.sequential for chunk in chunks)
    if sequential:
        for chunk in chunks:
            token_ids.extend(chunk.token_ids)
    else:
        positions: list[int] = []
        masks: list[int] = []
        for chunk, n in zip(chunks, lens):
            token_ids.extend(chunk.token_ids)
            positions.extend(chunk.positions)
            masks.extend(chunk.tree_mask if chunk.tree_mask is not None else causal[:n])
    seq_of_token, within = _token_coordinates(lens)
    index = seq_of_token * query_len + within
    storage = _storage_indices(num_cached, seq_of_token, within)
    arrays["input_ids"][index] = token_ids
    arrays["positions"][index] = storage if sequential else positions
    arrays["slot_mapping"][index] = _cache_slots(arrays["block_tables"], storage, seq_of_token, block_size)
    arrays["tree_mask"][index] = _causal_bits(query_len)[within] if sequential else masks
    arrays["seq_lens"][: len(chunks)] = np.asarray(num_cached) + query_len
    # Decode and tree chunks want every token's logits: their rows are the tokens' own slots.
    every = every_index(query_len)
    if all(chunk.logits_indices == every[:n] for chunk, n in zip(chunks, lens)):
        return index.tolist()
    return [b * query_len + i for b, chunk in enumerate(chunks) for i in chunk.logits_indices]


@functools.lru_cache(maxsize=None)
def _uniform_pattern(num_seqs: int, query_len: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """A uniform bucket's constant parts, made once per bucket (shared: read-only): each slot's
    own tree bit (what a padding token sees), the sequences' query starts, and the causal
    masks of a chunk's first tokens."""
    own_bits = np.tile(np.left_shift(np.int64(1), np.arange(query_len, dtype=np.int64)), num_seqs)
    query_starts = np.arange(0, (num_seqs + 1) * query_len, query_len, dtype=np.int32)
    own_bits.setflags(write=False)
    query_starts.setflags(write=False)
    return own_bits, query_starts, _causal_bits(query_len).tolist()


@functools.lru_cache(maxsize=None)
def _causal_bits(query_len: int) -> np.ndarray:
    """The causal mask of each of a chunk's first `query_len` tokens, as int64 (shared: read-only)."""
    bits = np.left_shift(np.int64(2), np.arange(query_len, dtype=np.int64)) - 1
    bits.setflags(write=False)
    return bits


def fill_ragged_host_inputs(arrays: dict[str, np.ndarray], chunks: Sequence[SequenceChunk], block_size: int,
                            table_rows: Optional[BlockTableRows] = None) -> list[int]:
    """Lay `chunks` out in a ragged bucket's host buffers (numpy views): their tokens back to back.

    The sequences after the chunks are empty (no tokens, length 0, the null block's table);
    the tokens after theirs are padding aimed at the null block. Causal tokens carry no
    tree bits (the kernel's causal rule). Returns the flat rows of the tokens whose logits
    were asked for, in chunk order. Block tables as in `fill_host_inputs`.
    """
    query_lens = [len(chunk.token_ids) for chunk in chunks]
    starts = np.concatenate([[0], np.cumsum(query_lens, dtype=np.int64)])
    num_real = int(starts[-1])
    arrays["input_ids"][:] = 0
    arrays["positions"][:] = 0
    arrays["slot_mapping"][:] = NULL_BLOCK * block_size
    arrays["tree_mask"][:] = 0
    arrays["seq_lens"][:] = 0
    arrays["query_start_loc"][:] = num_real
    arrays["query_start_loc"][: len(chunks) + 1] = starts
    if not _gather_block_tables(arrays["block_tables"], chunks, table_rows):
        arrays["block_tables"][:] = NULL_BLOCK
        _write_block_tables(arrays["block_tables"], chunks)
    if not chunks:
        return []
    token_ids: list[int] = []
    positions: list[int] = []
    masks: list[int] = []
    rows: list[int] = []
    for chunk, start in zip(chunks, starts.tolist()):
        n = len(chunk.token_ids)
        token_ids.extend(chunk.token_ids)
        positions.extend(chunk.positions)
        masks.extend(chunk.tree_mask if chunk.tree_mask is not None else [0] * n)
        rows.extend(start + i for i in chunk.logits_indices)
    seq_of_token, within = _token_coordinates(query_lens)
    arrays["input_ids"][:num_real] = token_ids
    arrays["positions"][:num_real] = positions
    storage = _storage_indices([chunk.num_cached for chunk in chunks], seq_of_token, within)
    arrays["slot_mapping"][:num_real] = _cache_slots(arrays["block_tables"], storage, seq_of_token, block_size)
    arrays["tree_mask"][:num_real] = masks
    arrays["seq_lens"][: len(chunks)] = [chunk.num_cached + n for chunk, n in zip(chunks, query_lens)]
    return rows


def _token_coordinates(lens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """For chunks of `lens` tokens laid back to back: each token's chunk, and its index in that
    chunk (shared: read-only). Steps repeat their lengths (every tree of a step is often the
    same size), so each is computed once."""
    return _coordinates(tuple(lens))


@functools.lru_cache(maxsize=256)
def _coordinates(lens: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    seq_of_token = np.repeat(np.arange(len(lens)), lens)
    within = np.arange(len(seq_of_token)) - np.repeat(np.cumsum(lens) - lens, lens)
    seq_of_token.setflags(write=False)
    within.setflags(write=False)
    return seq_of_token, within


def _storage_indices(num_cached: Sequence[int], seq_of_token: np.ndarray, within: np.ndarray) -> np.ndarray:
    """Storage indices of the chunks' new tokens (`num_cached` onwards, per chunk), for the whole batch at once."""
    return np.asarray(num_cached, dtype=np.int64)[seq_of_token] + within


def _cache_slots(block_tables: np.ndarray, storage: np.ndarray, seq_of_token: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slots of the tokens at `storage` indices, from the block tables already written into `block_tables`."""
    return block_tables[seq_of_token, storage // block_size].astype(np.int64) * block_size + storage % block_size


def _gather_block_tables(block_tables: np.ndarray, chunks: Sequence[SequenceChunk], table_rows: Optional[BlockTableRows]) -> bool:
    """The chunks' block tables into the first rows, the null block after them, from `table_rows`
    (where every row ends with null blocks); False, writing nothing, when a chunk's table is not there."""
    if table_rows is None:
        return False
    rows = [chunk.table_row for chunk in chunks]
    if None in rows:
        return False
    mirrored = table_rows.array
    width = min(block_tables.shape[1], mirrored.shape[1])
    if width < mirrored.shape[1] and mirrored[rows, width:].any():
        return False  # a table longer than the bucket's rows: the caller's writes raise as they should
    block_tables[: len(rows), :width] = mirrored[rows, :width]
    block_tables[: len(rows), width:] = NULL_BLOCK
    block_tables[len(rows) :] = NULL_BLOCK
    return True


def _write_block_tables(block_tables: np.ndarray, chunks: Sequence[SequenceChunk]) -> None:
    """The chunks' block tables into the first rows, which the caller has filled with the null block."""
    for row, chunk in zip(block_tables, chunks):
        row[: len(chunk.block_table)] = chunk.block_table
