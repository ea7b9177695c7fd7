"""Depth-bounded suffix tries over token histories.

Every position i of a history stores the path ``tokens[i : i + depth]`` below the root,
so every n-gram that occurred (n <= depth) is a root path, and the children of the node
reached by walking a context are the tokens that followed that context, each with a
frequency and the tick of its latest occurrence. One dict lookup per token: matching a
context of m tokens costs m lookups, storing a token costs ``depth`` updates.

Nodes are integer ids into flat arrays, and a node's children are a ``{token: id}`` dict
of plain ints. Such dicts are invisible to Python's cyclic garbage collector, which would
otherwise re-scan millions of node objects and dominate the cost of learning.
Evicted ids are reused; ``born`` tells a reused id from the node it once was.
"""
from __future__ import annotations

from array import array
from typing import Optional, Sequence

import numpy as np

ROOT = 0

# Upper bound on the bytes one node costs in CPython 3.11, amortised: its array slots,
# its entry in the parent's dict and, when it has children, its own dict; measured on
# tries of random and of repetitive text (tests/test_lookahead.py checks it).
NODE_BYTES = 320


class Trie:
    def __init__(self, depth: int, max_children: Optional[int] = None) -> None:
        self.depth = depth
        self.max_children = max_children
        self.children: list[Optional[dict[int, int]]] = [None]
        self.freq = array("d", [0.0])
        self.last_used = array("q", [0])
        self.born = array("q", [0])  # creation serial; -1 while the id is free
        self.size = 0  # nodes below the root
        self._serial = 0
        self._free: list[int] = []

    def _new_node(self, tick: int) -> int:
        self._serial += 1
        self.size += 1
        if self._free:
            node = self._free.pop()
            self.children[node] = None
            self.freq[node] = 0.0
            self.last_used[node] = tick
            self.born[node] = self._serial
            return node
        self.children.append(None)
        self.freq.append(0.0)
        self.last_used.append(tick)
        self.born.append(self._serial)
        return len(self.children) - 1

    def _drop_subtree(self, node: int) -> int:
        """Free ``node`` and its descendants (already detached from the parent)."""
        count, stack = 0, [node]
        while stack:
            current = stack.pop()
            kids = self.children[current]
            if kids:
                stack.extend(kids.values())
            self.children[current] = None
            self.born[current] = -1
            self._free.append(current)
            count += 1
        self.size -= count
        return count

    def child(self, node: int, token: int, tick: int) -> int:
        """``node``'s child for ``token``, created when missing (below the root, evicting
        the least recently used sibling when the node already has ``max_children``)."""
        kids = self.children[node]
        if kids is None:
            kids = self.children[node] = {}
        found = kids.get(token)
        if found is not None:
            return found
        if self.max_children is not None and node != ROOT and len(kids) >= self.max_children:
            last_used, freq = self.last_used, self.freq
            coldest = min(kids, key=lambda t: (last_used[kids[t]], freq[kids[t]]))
            self._drop_subtree(kids.pop(coldest))
        created = kids[token] = self._new_node(tick)
        return created

    def insert(self, path: Sequence[int], weight: float, tick: int) -> None:
        """Add one occurrence of ``path`` (at most ``depth`` tokens) below the root; every
        node on it is stamped with ``tick``, so ancestors are never older than descendants."""
        node = ROOT
        for token in path[: self.depth]:
            node = self.child(node, token, tick)
            self.freq[node] += weight
            self.last_used[node] = tick

    def match(
        self, context: Sequence[int], min_len: int, max_len: int, limit: int, known: Sequence[int] = ()
    ) -> list[int]:
        """Nodes reached by the longest suffixes of ``context`` (``max_len`` down to
        ``min_len`` tokens) that have a continuation; at most ``limit``, longest first.
        ``known[-m]``, where given, is the node of the suffix of ``m`` tokens, found
        without walking (see ``HistoryAppender.suffix_nodes``)."""
        found: list[int] = []
        children = self.children
        n, num_known = len(context), len(known)
        for m in range(min(max_len, n, self.depth - 1), min_len - 1, -1):
            if m <= num_known:
                node: Optional[int] = known[-m]
            else:
                node = ROOT
                for token in context[n - m:]:
                    kids = children[node]
                    node = kids.get(token) if kids else None
                    if node is None:
                        break
            if node is not None and children[node]:
                found.append(node)
                if len(found) >= limit:
                    break
        return found

    def decay(self, node: int, born: int, factor: float) -> None:
        """Scale a node's frequency, unless its id was freed or reused since ``born``."""
        if self.born[node] == born:
            self.freq[node] *= factor

    def evict_least_recent(self, max_size: int) -> int:
        """Drop the least recently used nodes until at most ``max_size`` remain.

        Cuts whole subtrees at a tick cutoff; correct because ``insert`` stamps whole
        paths, so a node is never more recent than its ancestors. Returns nodes removed.
        """
        excess = self.size - max(max_size, 0)
        if excess <= 0:
            return 0
        ticks = np.array(self.last_used, dtype=np.int64)
        alive = np.array(self.born, dtype=np.int64) > 0
        cutoff = int(np.partition(ticks[alive], excess - 1)[excess - 1])
        removed, stack = 0, [ROOT]
        last_used, children = self.last_used, self.children
        while stack:
            node = stack.pop()
            kids = children[node]
            if not kids:
                continue
            for token in [t for t, c in kids.items() if last_used[c] <= cutoff]:
                removed += self._drop_subtree(kids.pop(token))
            if kids:
                stack.extend(kids.values())
            else:
                children[node] = None
        return removed


class HistoryAppender:
    """Grows a trie as a request's history grows.

    Keeps the open path of each of the last ``depth - 1`` start positions, so a new token
    extends all of them and opens its own: ``depth`` updates per token, and the whole
    history is stored exactly once per position. Nodes are stamped with the token's
    position, so the most recent continuation of a context is its child with the largest
    ``last_used``. The trie must have no ``max_children`` and never be evicted from (an open
    path must not be evicted), so new nodes are simply appended.
    """

    def __init__(self, trie: Trie) -> None:
        if trie.max_children is not None:
            raise ValueError("HistoryAppender needs a trie without max_children")
        self.trie = trie
        # The open paths' current nodes, oldest start first: the i-th of k is at depth k - i.
        self._open: list[int] = []

    def restart(self) -> None:
        """Close the open paths: the next token follows a gap in the history, not its last token."""
        self._open = []

    def extend(self, tokens: Sequence[int], tick: int) -> None:
        """Append ``tokens``, stamped with positions ``tick, tick + 1, ...``."""
        trie = self.trie
        children, freq, last_used, born, depth = trie.children, trie.freq, trie.last_used, trie.born, trie.depth
        serial = trie._serial
        paths = self._open
        for token in tokens:
            paths.append(ROOT)
            reached = []
            for node in paths:
                kids = children[node]
                child = kids.get(token) if kids is not None else None
                if child is None:  # a new node, made here rather than by ``Trie.child``: this trie never evicts
                    child = len(children)
                    if kids is None:
                        children[node] = {token: child}
                    else:
                        kids[token] = child
                    children.append(None)
                    freq.append(1.0)
                    last_used.append(tick)
                    serial += 1
                    born.append(serial)
                else:
                    freq[child] += 1.0
                    last_used[child] = tick
                reached.append(child)
            if len(reached) == depth:  # the oldest path is complete
                del reached[0]
            paths = reached
            tick += 1
        trie.size += serial - trie._serial
        trie._serial = serial
        self._open = paths

    def suffix_nodes(self) -> list[int]:
        """``[-m]``: for the last ``m`` tokens appended since the last ``restart``, the node a
        walk from the root over them would reach (as far as ``depth - 1`` tokens back)."""
        return self._open
