"""Building token trees from matched trie nodes.

A *match* is a trie node reached by walking a context, paired with the weight of the
history it came from; its children are the continuations seen after that context.
Two builders:

* ``frequency_tree`` (turbo): best-first expansion of the merged continuations of all
  matches, highest score first, where a node's score is the weighted sum of its trie
  frequencies. Nodes scoring under ``threshold`` are pruned with their subtrees. Because
  a node is only queued once its parent is emitted, parents precede children.
* ``recent_copies`` (raw): LLMA / prompt-lookup copying: up to ``top_k`` chains, each the
  continuation of the most recent occurrence of the matched context (the child with the
  latest tick at every step), branching only on the first token.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from hetero.core.protocols import TokenTree
from lookahead.trie import Trie

Match = tuple[Trie, int, float]  # (trie, node reached by a context, weight of that history)
Source = tuple[Trie, int, int]  # (trie, node, its ``born`` serial when proposed)
Link = tuple[int, float, Source]  # one chain element: (token, score, source)


@dataclass
class Draft:
    """A tree under construction, with the trie nodes behind each tree node so that the
    verifier's verdict can be fed back to them."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    sources: list[list[Source]] = field(default_factory=list)
    _index: dict[tuple[int, int], int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float, sources: list[Source]) -> int:
        index = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.sources.append(sources)
        self._index[(parent, token)] = index
        return index

    def add_chain(self, chain: Sequence[Link], budget: int) -> None:
        """Merge a chain below the root, sharing any prefix already in the tree."""
        parent = -1
        for token, score, source in chain:
            existing = self._index.get((parent, token))
            if existing is not None:
                parent = existing
                continue
            if len(self) >= budget:
                return
            parent = self.add(token, parent, score, [source])

    def to_tree(self) -> TokenTree:
        return TokenTree(
            np.asarray(self.tokens, np.int64),
            np.asarray(self.parents, np.int32),
            np.asarray(self.scores, np.float32),
        )

    def rejected_sources(self, accepted: Sequence[int]) -> list[Source]:
        """Trie nodes behind the tree nodes the verifier turned down: every child of the
        root and of each accepted node, except the accepted path itself."""
        children: dict[int, list[int]] = {}
        for index, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(index)
        rejected: list[Source] = []
        parent = -1
        for depth in range(len(accepted) + 1):
            taken = accepted[depth] if depth < len(accepted) else None
            next_parent = None
            for index in children.get(parent, ()):
                if self.tokens[index] == taken:
                    next_parent = index
                else:
                    rejected.extend(self.sources[index])
            if next_parent is None:
                break
            parent = next_parent
        return rejected


def _rank(entry: tuple) -> tuple[float, int]:
    return -entry[0], -entry[1]


def _merged_children(groups: Sequence[Match], top_k_in_cell: int) -> list[tuple[float, int, int, list[Match]]]:
    """(score, latest tick, token, child matches) per distinct child token, best first."""
    if not groups:
        return []
    if len(groups) == 1:  # nothing to merge: the usual case below the first level
        trie, node, weight = groups[0]
        kids = trie.children[node]
        if not kids:
            return []
        freq, last_used = trie.freq, trie.last_used
        if len(kids) == 1:
            ((token, child),) = kids.items()
            return [(freq[child] * weight, last_used[child], token, [(trie, child, weight)])]
        items = kids.items()
        if len(kids) > top_k_in_cell:
            items = heapq.nlargest(top_k_in_cell, items, key=lambda kv: freq[kv[1]])
        ranked = [(freq[child] * weight, last_used[child], token, [(trie, child, weight)]) for token, child in items]
        ranked.sort(key=_rank)
        return ranked[:top_k_in_cell]
    merged: dict[int, list] = {}
    for trie, node, weight in groups:
        kids = trie.children[node]
        if not kids:
            continue
        freq, last_used = trie.freq, trie.last_used
        items = kids.items()
        if len(kids) > top_k_in_cell:
            items = heapq.nlargest(top_k_in_cell, items, key=lambda kv: freq[kv[1]])
        for token, child in items:
            entry = merged.get(token)
            if entry is None:
                merged[token] = [freq[child] * weight, last_used[child], [(trie, child, weight)]]
            else:
                entry[0] += freq[child] * weight
                tick = last_used[child]
                if tick > entry[1]:
                    entry[1] = tick
                entry[2].append((trie, child, weight))
    ranked = [(score, tick, token, group) for token, (score, tick, group) in merged.items()]
    if len(ranked) > 1:
        ranked.sort(key=_rank)
    return ranked[:top_k_in_cell]


def frequency_tree(
    matches: Sequence[Match],
    budget: int,
    max_depth: int,
    threshold: float,
    top_k_in_cell: int,
    eos_token_id: Optional[int] = None,
) -> Draft:
    """Turbo: the ``budget`` best-scoring continuations as one tree (see module doc)."""
    draft = Draft()
    if budget <= 0 or not matches:
        return draft
    heap: list = []
    push, pop, add = heapq.heappush, heapq.heappop, draft.add
    order = size = 0
    groups, parent, depth = matches, -1, 1
    while True:
        for score, tick, token, group in _merged_children(groups, top_k_in_cell):
            if score < threshold:
                break
            push(heap, (-score, -tick, order, token, parent, depth, group))
            order += 1
        if not heap:
            return draft
        neg_score, _, _, token, parent, depth, groups = pop(heap)
        parent = add(token, parent, -neg_score, [(trie, node, trie.born[node]) for trie, node, _ in groups])
        size += 1
        if size >= budget:  # full: the last node's children could not be added
            return draft
        if depth >= max_depth or token == eos_token_id:
            groups = ()
        depth += 1


def recent_copies(
    matches: Sequence[Match],
    budget: int,
    max_depth: int,
    top_k: int,
    eos_token_id: Optional[int] = None,
) -> list[list[Link]]:
    """Raw: up to ``top_k`` chains of (token, score, source), most recent first.

    Matches are taken in order (the request's own history before the global one); each
    contributes first tokens by recency until ``top_k`` distinct ones are chosen. Chains
    together hold at most ``budget`` tokens.
    """
    starts: list[tuple[int, Trie, int, float]] = []
    chosen: set[int] = set()
    for trie, node, weight in matches:
        last_used = trie.last_used
        kids = trie.children[node]
        for token, child in sorted(kids.items(), key=lambda kv: -last_used[kv[1]]) if len(kids) > 1 else kids.items():
            if len(starts) >= top_k:
                break
            if token not in chosen:
                chosen.add(token)
                starts.append((token, trie, child, weight))
    chains = []
    remaining = budget
    for token, trie, node, weight in starts:
        if remaining <= 0:
            break
        children, freq, last_used, born = trie.children, trie.freq, trie.last_used, trie.born
        chain = [(token, freq[node] * weight, (trie, node, born[node]))]
        length = min(max_depth, remaining)
        while len(chain) < length and children[node] and token != eos_token_id:
            kids = children[node]
            if len(kids) == 1:
                ((token, node),) = kids.items()
            else:
                token, node = max(kids.items(), key=lambda kv: last_used[kv[1]])
            chain.append((token, freq[node] * weight, (trie, node, born[node])))
        remaining -= len(chain)
        chains.append(chain)
    return chains
