"""The lookahead cache's parts as they were before its host-cost rework (commit 9ebb8f8), kept
as the reference the reworked parts must match: the same trees, in the same order, with the
same scores, and the same learning, decay, catch-up and memory-budget stops.

Only what the rework changed is kept here, as the library had it: token-by-token trie growth
(``HistoryAppender.append``, ``depth`` updates per token), suffix matching by walking from the
root (``match``) and the proposal builders. ``ReferenceLookaheadCache`` is the library's cache
with those parts in place of the new ones; everything the rework left alone is the library's.
"""
from __future__ import annotations

import heapq
from typing import Optional, Sequence

from hetero.core.protocols import ProposalRequest, TokenTree
from lookahead.cache import REQUEST_BYTES, TOKEN_BYTES, LookaheadCache, _Request, _stop_learning
from lookahead.proposal import Draft, Link, Match
from lookahead.trie import NODE_BYTES, ROOT, Trie


def match(trie: Trie, context: Sequence[int], min_len: int, max_len: int, limit: int) -> list[int]:
    """Nodes of `trie` reached by the longest suffixes of ``context`` (``max_len`` down to
    ``min_len`` tokens) that have a continuation; at most ``limit``, longest first."""
    found: list[int] = []
    children = trie.children
    n = len(context)
    for m in range(min(max_len, n, trie.depth - 1), min_len - 1, -1):
        node: Optional[int] = ROOT
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


class HistoryAppender:
    """Grows a trie one token at a time, as a request's history grows.

    Keeps the open path of each of the last ``depth - 1`` start positions, so a new token
    extends all of them and opens its own: ``depth`` updates per token, and the whole
    history is stored exactly once per position. Nodes are stamped with the token's
    position, so the most recent continuation of a context is its child with the largest
    ``last_used``. The trie must have no ``max_children`` (an open path must not be evicted).
    """

    def __init__(self, trie: Trie) -> None:
        if trie.max_children is not None:
            raise ValueError("HistoryAppender needs a trie without max_children")
        self.trie = trie
        self._open: list[tuple[int, int]] = []

    def restart(self) -> None:
        """Close the open paths: the next token follows a gap in the history, not its last token."""
        self._open = []

    def append(self, token: int, tick: int) -> None:
        trie = self.trie
        children, freq, last_used, depth_limit = trie.children, trie.freq, trie.last_used, trie.depth - 1
        still_open = []
        for node, depth in self._open + [(ROOT, 0)]:
            kids = children[node]
            child = kids.get(token) if kids is not None else None
            if child is None:
                child = trie.child(node, token, tick)
            freq[child] += 1.0
            last_used[child] = tick
            if depth < depth_limit:
                still_open.append((child, depth + 1))
        self._open = still_open


def _merged_children(groups: Sequence[Match], top_k_in_cell: int) -> list[tuple[float, int, int, list[Match]]]:
    """(score, latest tick, token, child matches) per distinct child token, best first."""
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
                entry[1] = max(entry[1], last_used[child])
                entry[2].append((trie, child, weight))
    ranked = sorted(((s, t, tok, g) for tok, (s, t, g) in merged.items()), key=lambda e: (-e[0], -e[1]))
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
    order = 0

    def enqueue(groups: Sequence[Match], parent: int, depth: int) -> None:
        nonlocal order
        for score, tick, token, group in _merged_children(groups, top_k_in_cell):
            if score < threshold:
                break
            heapq.heappush(heap, (-score, -tick, order, token, parent, depth, group))
            order += 1

    enqueue(matches, -1, 1)
    while heap and len(draft) < budget:
        neg_score, _, _, token, parent, depth, group = heapq.heappop(heap)
        sources = [(trie, node, trie.born[node]) for trie, node, _ in group]
        index = draft.add(token, parent, -neg_score, sources)
        if depth < max_depth and token != eos_token_id:
            enqueue(group, index, depth + 1)
    return draft


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
        for token, child in sorted(trie.children[node].items(), key=lambda kv: -last_used[kv[1]]):
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
        while len(chain) < min(max_depth, remaining) and children[node] and token != eos_token_id:
            token, node = max(children[node].items(), key=lambda kv: last_used[kv[1]])
            chain.append((token, freq[node] * weight, (trie, node, born[node])))
        remaining -= len(chain)
        chains.append(chain)
    return chains


class ReferenceLookaheadCache(LookaheadCache):
    """The library's cache proposing and learning through the parts above."""

    def _propose_one(self, request: ProposalRequest, catch_up: int) -> TokenTree:
        # A new request's state grows its trie with the token-by-token appender.
        if request.request_id not in self._requests and self._has_room(REQUEST_BYTES):
            state = self._requests[request.request_id] = _Request(request.num_prompt_tokens, self.config.trie_depth)
            state.appender = HistoryAppender(state.trie)
        return super()._propose_one(request, catch_up)

    def _histories_of(self, state: _Request) -> list[tuple[Trie, float]]:
        histories = [(state.trie, self.config.start_freq)]
        if self.config.global_cache_switch:
            histories.append((self.global_trie, 1.0))
        return histories

    def _draft(self, state: _Request, context: list[int], budget: int) -> Draft:
        config = self.config
        if config.cache_mode == 0:
            return self._old_raw_draft(state, context, budget, Draft())
        matches: list[Match] = [
            (trie, node, weight)
            for trie, weight in self._histories_of(state)
            for node in match(
                trie, context, config.min_match_length, config.turbo_match_length, config.token_paths_top_k
            )
        ]
        draft = frequency_tree(
            matches, budget, config.copy_length, config.threshold, config.top_k_in_cell, config.eos_token_id
        )
        if config.cache_mode == 2 and (not len(draft) or (config.is_hybrid and len(draft) < budget)):
            draft = self._old_raw_draft(state, context, budget, draft)
        return draft

    def _old_raw_draft(self, state: _Request, context: list[int], budget: int, draft: Draft) -> Draft:
        config = self.config
        matches: list[Match] = [
            (trie, node, weight)
            for trie, weight in self._histories_of(state)
            for node in match(trie, context, config.min_match_length, config.match_length, 1)
        ]
        for chain in recent_copies(matches, budget, config.copy_length, config.top_k, config.eos_token_id):
            draft.add_chain(chain, budget)
        return draft

    def _learn(self, state: _Request, tokens: Sequence[int]) -> None:
        """Append to a request's history, stopping for good when memory runs out."""
        trie = state.trie
        room_per_token = trie.depth * NODE_BYTES + TOKEN_BYTES
        for token in tokens:
            if not self._has_room(room_per_token):
                _stop_learning(state)
                return
            before = trie.size
            state.appender.append(int(token), len(state.history))
            state.history.append(int(token))
            self._request_nodes += trie.size - before
            self._history_tokens += 1
