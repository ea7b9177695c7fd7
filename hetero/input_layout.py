"""A scheduled batch laid out for the runner: one `SequenceChunk` per sequence, and which
logits rows each sequence asked for.

A prefill chunk asks for the rows that score prompt tokens (prompt_logprobs) and, when it
ends at the sequence's last token, the row that samples the next one. A decode token asks
for its row. A token tree (SpecInfer, Miao et al. 2024) runs its root (the last known
token) and every node, each attending to its ancestors through the tree mask, and asks
for all their rows.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate
from typing import Optional

from gpu_target.runner import SequenceChunk, every_index
from hetero.core.protocols import MAX_TREE_NODES, TokenTree, tree_row_layout
from hetero.scheduler import ScheduledSeq, Sequence


@dataclass
class SampleRow:
    """One logits row that feeds sampling or verification, and whose sequence it is."""

    seq: Sequence
    path: list[int]  # draft tokens between the sequence's output and this row's position

    def context(self) -> list[int]:
        """Output tokens before this row's position (built only when a processor needs them)."""
        return self.seq.output_token_ids + self.path


@dataclass
class ChunkRows:
    """The logits rows one scheduled sequence asked for: prompt-logprob rows, then sampling
    rows (none, the last new token's, or a tree's root and each of its nodes)."""

    seq: Sequence
    num_prompt_rows: int
    num_sample_rows: int
    tree: Optional[TokenTree] = None

    def sample_rows(self) -> list[SampleRow]:
        """The sampling rows with the draft path before each one's position.

        Built only when a logits processor needs the rows' contexts: a greedy speculative
        step at batch 64 would otherwise build a few hundred paths it never reads.
        """
        if not self.num_sample_rows:
            return []
        rows = [SampleRow(self.seq, [])]
        if self.tree is not None:
            tokens = self.tree.token_list
            for node, parent in enumerate(self.tree.parent_list):
                rows.append(SampleRow(self.seq, rows[parent + 1].path + [tokens[node]]))
        return rows


def _as_int64(masks: list[int]) -> list[int]:
    """Masks as int64 values: node 62's bit lands on bit 63, the sign bit, as the kernels expect."""
    return [m - (1 << 64) if m >> 63 else m for m in masks]


@functools.lru_cache(maxsize=4096)
def tree_layout(parents: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`tree_row_layout` with the masks as the kernels' int64 values, computed once per tree shape."""
    depths, masks = tree_row_layout(parents)
    return depths, tuple(_as_int64(list(masks)))


@functools.lru_cache(maxsize=MAX_TREE_NODES + 1)
def chain_layout(num_nodes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`tree_layout` of a chain of `num_nodes` nodes, looked up by its length alone."""
    return tree_layout(tuple(range(-1, num_nodes - 1)))


def build_chunks(scheduled: list[ScheduledSeq]) -> tuple[list[SequenceChunk], list[ChunkRows]]:
    """The runner's chunks for a scheduled batch, and the logits rows each sequence gets back, in order.

    A sequential chunk's positions are a `range` (staging computes them from the storage
    indices; the eager path extends a list from them).
    """
    chunks, layout = [], []
    for item in scheduled:
        seq = item.seq
        start = seq.num_computed
        if item.tree is None:
            tokens = seq.token_ids[start : start + item.num_new_tokens]
            positions = range(start, start + item.num_new_tokens)
            logits_indices = prompt_logprob_indices(item)
            num_prompt_rows = len(logits_indices)
            if item.samples:
                logits_indices.append(item.num_new_tokens - 1)
            chunks.append(SequenceChunk(tokens, positions, seq.block_table, start, logits_indices, None, seq.table_row, True))
            layout.append(ChunkRows(seq, num_prompt_rows, int(item.samples)))
        else:
            # Row 0 is the root (the last known token), row i + 1 is node i.
            tree = item.tree
            tokens = [seq.token_ids[-1]] + tree.token_list
            if tree.is_chain:
                _, masks = chain_layout(len(tree.token_list))
                positions = range(start, start + len(tokens))
            else:
                depths, masks = tree_layout(tuple(tree.parent_list))
                positions = [start + depth for depth in depths]
            chunks.append(SequenceChunk(tokens, positions, seq.block_table, start, every_index(len(tokens)), masks, seq.table_row,
                                        tree.is_chain))
            layout.append(ChunkRows(seq, 0, len(tokens), item.tree))
    return chunks, layout


def prompt_logprob_indices(item: ScheduledSeq) -> list[int]:
    """Chunk rows whose logits score prompt tokens not scored yet, when prompt_logprobs is asked.

    Row i of the chunk scores the prompt token at position num_computed + i + 1. Counting
    from what is already recorded keeps a recomputed prefill (after a preemption) from
    scoring positions twice.
    """
    seq = item.seq
    group = seq.group
    if seq.params.prompt_logprobs is None or seq.index != 0:
        return []
    scored = len(group.prompt_logprobs) - 1 if group.prompt_logprobs else 0
    first = max(0, scored - seq.num_computed)
    last = min(seq.num_computed + item.num_new_tokens, seq.num_prompt_tokens - 1) - seq.num_computed
    return list(range(first, max(first, last)))


def row_offsets(layout: list[ChunkRows]) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Where each sequence's rows sit among the logits: its prompt rows' (start, stop), the
    first of its sampling rows counted among sampling rows only, and every sampling row's
    index among all rows."""
    if not any(rows.num_prompt_rows for rows in layout):  # decode and verification steps: sampling rows only
        sample_starts = list(accumulate((rows.num_sample_rows for rows in layout), initial=0))
        num_rows = sample_starts.pop()
        return [(start, start) for start in sample_starts], sample_starts, list(range(num_rows))
    prompt_slices, sample_starts, sample_index = [], [], []
    offset = 0
    for rows in layout:
        prompt_slices.append((offset, offset + rows.num_prompt_rows))
        offset += rows.num_prompt_rows
        sample_starts.append(len(sample_index))
        sample_index.extend(range(offset, offset + rows.num_sample_rows))
        offset += rows.num_sample_rows
    return prompt_slices, sample_starts, sample_index
