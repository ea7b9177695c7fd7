"""What the coordinator and the draft worker say to each other: kinds and numpy array layouts.

Coordinator -> worker
    SYNC / PROPOSE: context updates ``ids``, ``keep``, ``new_lens``, ``tokens`` (sequence
    ``ids[i]`` keeps its first ``keep[i]`` tokens and appends the next ``new_lens[i]`` of
    ``tokens``), ``released`` ids to forget, and for PROPOSE the batch to draft: ``batch``
    ids, ``max_nodes`` and ``sent_at`` (the coordinator's `time.monotonic()` as it sends, a
    clock both processes share). A SYNC carries updates too big for one PROPOSE slot and gets no reply.
    SHUTDOWN: exit cleanly.
Worker -> coordinator
    READY: the model is loaded (``pid``).
    TREES: per batch entry ``counts`` nodes, then ``tokens``/``parents``/``scores`` of all
    trees back to back, and the worker's cumulative ``stats`` (see STAT_NAMES).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np

from hetero.core.protocols import TokenTree

SYNC, PROPOSE, SHUTDOWN = 1, 2, 3
READY, TREES = 101, 102

STAT_NAMES = ("exposed_s", "hidden_s", "predraft_hits", "predraft_misses", "ahead_s", "ahead_levels")
_ARRAY_TABLE_BYTES = 4096  # generous room for the array table and alignment of one message


@dataclass
class ContextUpdate:
    seq_id: int
    keep: int
    new_tokens: Sequence[int]


def update_arrays(updates: Sequence[ContextUpdate], released: Sequence[int] = ()) -> dict[str, np.ndarray]:
    return {
        "ids": np.asarray([u.seq_id for u in updates], np.int64),
        "keep": np.asarray([u.keep for u in updates], np.int64),
        "new_lens": np.asarray([len(u.new_tokens) for u in updates], np.int64),
        "tokens": np.fromiter((t for u in updates for t in u.new_tokens), np.int64),
        "released": np.asarray(released, np.int64),
    }


def read_updates(arrays: Mapping[str, np.ndarray]) -> Iterator[ContextUpdate]:
    tokens = arrays["tokens"].tolist()
    offset = 0
    for seq_id, keep, n in zip(arrays["ids"].tolist(), arrays["keep"].tolist(), arrays["new_lens"].tolist()):
        yield ContextUpdate(seq_id, keep, tokens[offset : offset + n])
        offset += n


def split_updates(updates: Sequence[ContextUpdate], max_tokens: int) -> list[list[ContextUpdate]]:
    """Group updates into messages of at most ``max_tokens`` new tokens, cutting long ones in pieces."""
    groups: list[list[ContextUpdate]] = [[]]
    room = max_tokens
    for update in updates:
        keep, tokens = update.keep, list(update.new_tokens)
        while True:
            if room == 0:
                groups.append([])
                room = max_tokens
            piece = tokens[:room]
            groups[-1].append(ContextUpdate(update.seq_id, keep, piece))
            room -= len(piece)
            keep += len(piece)
            tokens = tokens[len(piece) :]
            if not tokens:
                break
    return groups


def max_update_tokens(slot_bytes: int, batch_size: int) -> int:
    """New tokens that fit one message next to a batch of ``batch_size`` entries."""
    per_entry_bytes = 8 * 5  # ids, keep, new_lens, batch, max_nodes (released rides in the same room)
    return max(1, (slot_bytes - _ARRAY_TABLE_BYTES - per_entry_bytes * 2 * batch_size) // 8)


def tree_arrays(trees: Sequence[TokenTree], stats: Sequence[float], ready_in_s: float = 0.0) -> dict[str, np.ndarray]:
    """A TREES reply: the trees, the worker's cumulative stats (STAT_NAMES) and the seconds until
    its pending trees should be ready (0: none pending, or no estimate yet)."""
    if trees:
        tokens = np.concatenate([t.tokens for t in trees])
        parents = np.concatenate([t.parents for t in trees])
        scores = np.concatenate([t.scores if t.scores is not None else np.zeros(len(t), np.float32) for t in trees])
    else:
        tokens, parents, scores = np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32)
    return {
        "counts": np.asarray([len(t) if t.ready else -1 for t in trees], np.int64),  # -1: `TokenTree.pending`
        "tokens": tokens.astype(np.int64, copy=False),
        "parents": parents.astype(np.int32, copy=False),
        "scores": scores.astype(np.float32, copy=False),
        "stats": np.asarray(stats, np.float64),
        "ready_in_s": np.asarray([ready_in_s], np.float64),
    }


def read_trees(arrays: Mapping[str, np.ndarray]) -> list[TokenTree]:
    counts = arrays["counts"]
    bounds = np.concatenate([[0], np.cumsum(np.maximum(counts, 0))]).tolist()
    tokens, parents, scores = arrays["tokens"], arrays["parents"], arrays["scores"]
    return [TokenTree(tokens[a:b].copy(), parents[a:b].copy(), scores[a:b].copy()) if count >= 0 else TokenTree.pending()
            for a, b, count in zip(bounds, bounds[1:], counts.tolist())]
