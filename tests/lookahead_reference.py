"""The lookahead cache as it was before its host-cost rework (commit 9ebb8f8), kept as the
reference its replacement must match: the same trees, in the same order, with the same
scores, and the same learning, decay, catch-up and memory-budget stops.

Token-by-token trie growth (``HistoryAppender.append``, ``depth`` updates per token) and
the proposal builders exactly as the library had them; only imports and names differ.
"""
from __future__ import annotations

import heapq
import json
import logging
import os
from array import array
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from hetero.core.lookahead_config import LookaheadConfig
from hetero.core.protocols import MAX_TREE_NODES, ProposalRequest, Proposer, SpecStats, TokenTree, Verdict
from lookahead.memory import default_memory_budget
from lookahead.stats import HitStats

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

    def match(self, context: Sequence[int], min_len: int, max_len: int, limit: int) -> list[int]:
        """Nodes reached by the longest suffixes of ``context`` (``max_len`` down to
        ``min_len`` tokens) that have a continuation; at most ``limit``, longest first."""
        found: list[int] = []
        children = self.children
        n = len(context)
        for m in range(min(max_len, n, self.depth - 1), min_len - 1, -1):
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


logger = logging.getLogger("hetero.lookahead.reference")

TOKEN_BYTES = 36  # a list slot plus an int object, per token of a request's history
REQUEST_BYTES = 1024  # fixed cost of one request's state
EVICTION_SLACK = 0.1  # evict this share of the global trie beyond what is needed, to amortise
# Output tokens a request learns at once when its next proposal comes after steps without
# speculation (plain decoding, whose tokens no verdict brought): the last ones only, at most
# MAX_CATCH_UP_TOKENS, and CATCH_UP_TOKENS shared by the proposal's batch (never fewer than
# MIN_CATCH_UP_TOKENS, what matching the latest context needs). Learning costs ``depth`` trie
# updates a token on the engine's thread; a plain stretch of a large batch would otherwise make
# the step that ends it wait for thousands of them.
MAX_CATCH_UP_TOKENS = 64
MIN_CATCH_UP_TOKENS = 8
CATCH_UP_TOKENS = 512


class _Request:
    __slots__ = ("history", "gaps", "num_prompt_tokens", "trie", "appender", "last_draft", "stats", "frozen")

    def __init__(self, num_prompt_tokens: int, depth: int) -> None:
        self.history: list[int] = []  # every token seen, learned or skipped (positions stamp the trie)
        self.gaps: list[tuple[int, int]] = []  # [start, end) ranges of ``history`` skipped, not learned
        self.num_prompt_tokens = num_prompt_tokens
        self.trie = Trie(depth)
        self.appender = HistoryAppender(self.trie)
        self.last_draft: Optional[Draft] = None
        self.stats = SpecStats()
        self.frozen = False  # stopped learning: the memory budget had no room left


class ReferenceLookaheadCache(Proposer):
    def __init__(self, config: Optional[LookaheadConfig] = None, memory_budget_bytes: Optional[int] = None) -> None:
        self.config = config or LookaheadConfig()
        self.memory_budget_bytes = default_memory_budget() if memory_budget_bytes is None else int(memory_budget_bytes)
        if self.memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be positive, got {memory_budget_bytes}")
        self.global_trie = Trie(self.config.trie_depth, max_children=self.config.cell_max_size)
        self.hit_stats = HitStats()
        self.spec_stats = SpecStats()
        self._requests: dict[str, _Request] = {}
        self._tick = 0
        self._request_nodes = 0
        self._history_tokens = 0
        if self.config.warmup_file:
            self.warmup(self.config.warmup_file)

    # ----------------------------------------------------------------- Proposer

    def propose(self, batch: Sequence[ProposalRequest]) -> list[TokenTree]:
        catch_up = max(MIN_CATCH_UP_TOKENS, min(MAX_CATCH_UP_TOKENS, CATCH_UP_TOKENS // max(len(batch), 1)))
        return [self._propose_one(request, catch_up) for request in batch]

    def commit(self, verdicts: Sequence[Verdict]) -> None:
        for verdict in verdicts:
            self._commit_one(verdict)

    def release(self, request_id: str) -> None:
        """Forget a request; its history goes into the global cache (if enabled)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self._request_nodes -= state.trie.size
        self._history_tokens -= len(state.history)
        if self.config.global_cache_switch:
            start = state.num_prompt_tokens if self.config.ignore_prompt else 0
            for begin, end in _learned_spans(state.gaps, start, len(state.history)):
                self._insert_global(state.history[begin:end])

    # ------------------------------------------------------------ public extras

    def warmup(self, path: str | os.PathLike) -> int:
        """Load ``[{"prompt": [ids], "output": [ids]}, ...]`` into the global cache.

        Returns the number of records loaded (0 when the global cache is switched off).
        """
        records = _read_warmup(os.fspath(path), self.config.voc_size)
        if not self.config.global_cache_switch:
            logger.warning("lookahead warm-up file %s ignored: global_cache_switch is off", path)
            return 0
        for record in records:
            prompt = [] if self.config.ignore_prompt else record["prompt"]
            self._insert_global(prompt + record["output"])
        return len(records)

    @property
    def target_parallelism(self) -> int:
        """The step's node budget summed over the batch, as the coordinator reads it."""
        return self.config.target_parallelism

    def request_stats(self, request_id: str) -> Optional[SpecStats]:
        """Speculation counters of a running request (gone after ``release``)."""
        state = self._requests.get(request_id)
        return state.stats if state else None

    def memory_bytes(self) -> int:
        """Estimate of the bytes this cache holds; never above ``memory_budget_bytes``."""
        return (
            (self.global_trie.size + self._request_nodes) * NODE_BYTES
            + self._history_tokens * TOKEN_BYTES
            + len(self._requests) * REQUEST_BYTES
        )

    def log_line(self) -> str:
        return self.hit_stats.log_line()

    # ---------------------------------------------------------------- proposing

    def _propose_one(self, request: ProposalRequest, catch_up: int) -> TokenTree:
        state = self._requests.get(request.request_id)
        if state is None:
            if not self._has_room(REQUEST_BYTES):
                return TokenTree.empty()
            state = self._requests[request.request_id] = _Request(request.num_prompt_tokens, self.config.trie_depth)
        if not state.frozen and len(request.token_ids) > len(state.history):
            self._catch_up(state, request.token_ids, catch_up)
        budget = min(request.max_nodes, MAX_TREE_NODES)
        state.last_draft = None
        if budget <= 0:
            return TokenTree.empty()
        context = [int(t) for t in request.token_ids[-self.config.context_length:]]
        draft = self._draft(state, context, budget)
        if not len(draft):
            return TokenTree.empty()
        state.last_draft = draft
        return draft.to_tree()

    def _histories(self, state: _Request) -> list[tuple[Trie, float]]:
        histories = [(state.trie, self.config.start_freq)]
        if self.config.global_cache_switch:
            histories.append((self.global_trie, 1.0))
        return histories

    def _draft(self, state: _Request, context: list[int], budget: int) -> Draft:
        config = self.config
        if config.cache_mode == 0:
            return self._raw_draft(state, context, budget, Draft())
        matches: list[Match] = [
            (trie, node, weight)
            for trie, weight in self._histories(state)
            for node in trie.match(context, config.min_match_length, config.turbo_match_length, config.token_paths_top_k)
        ]
        draft = frequency_tree(
            matches, budget, config.copy_length, config.threshold, config.top_k_in_cell, config.eos_token_id
        )
        if config.cache_mode == 2 and (not len(draft) or (config.is_hybrid and len(draft) < budget)):
            draft = self._raw_draft(state, context, budget, draft)
        return draft

    def _raw_draft(self, state: _Request, context: list[int], budget: int, draft: Draft) -> Draft:
        config = self.config
        matches: list[Match] = [
            (trie, node, weight)
            for trie, weight in self._histories(state)
            for node in trie.match(context, config.min_match_length, config.match_length, 1)
        ]
        for chain in recent_copies(matches, budget, config.copy_length, config.top_k, config.eos_token_id):
            draft.add_chain(chain, budget)
        return draft

    # ---------------------------------------------------------------- learning

    def _commit_one(self, verdict: Verdict) -> None:
        state = self._requests.get(verdict.request_id)
        draft = state.last_draft if state else None
        num_accepted = len(verdict.accepted_tokens)
        num_draft = verdict.num_draft_tokens or (len(draft) if draft else 0)
        self.hit_stats.record(num_draft, num_accepted)
        self.spec_stats.record(num_draft, num_accepted)
        if self.config.is_debug and self.hit_stats.num_iters % self.config.log_interval == 0:
            logger.info(self.log_line())
        if state is None:
            return
        state.stats.record(num_draft, num_accepted)
        if draft is not None and verdict.bonus_token is not None:
            for trie, node, born in draft.rejected_sources(verdict.accepted_tokens):
                trie.decay(node, born, self.config.decay)
        state.last_draft = None
        new_tokens = list(verdict.accepted_tokens)
        if verdict.bonus_token is not None:
            new_tokens.append(verdict.bonus_token)
        if not state.frozen:
            self._learn(state, new_tokens)

    def _catch_up(self, state: _Request, token_ids: Sequence[int], limit: int) -> None:
        """Learn the tokens of ``token_ids`` beyond the history: the prompt's all, of the
        output only the last ``limit`` (the others are skipped: kept as positions, left out
        of the tries)."""
        start = len(state.history)
        prompt_end = max(start, min(state.num_prompt_tokens, len(token_ids)))
        self._learn(state, token_ids[start:prompt_end])
        skip_end = max(prompt_end, len(token_ids) - limit)
        if skip_end > prompt_end and not state.frozen:
            if not self._has_room((skip_end - prompt_end) * TOKEN_BYTES):
                _stop_learning(state)
                return
            state.gaps.append((prompt_end, skip_end))
            state.history.extend(int(t) for t in token_ids[prompt_end:skip_end])
            self._history_tokens += skip_end - prompt_end
            state.appender.restart()
        if not state.frozen:
            self._learn(state, token_ids[skip_end:])

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

    def _insert_global(self, tokens: Sequence[int]) -> None:
        depth = self.global_trie.depth
        tokens = list(tokens[-self.config.max_seq_len:])
        for start in range(len(tokens)):
            if not self._has_global_room(min(depth, len(tokens) - start)):
                return
            self._tick += 1
            self.global_trie.insert(tokens[start:start + depth], 1.0, self._tick)

    # ------------------------------------------------------------------ memory

    def _global_node_limit(self) -> int:
        other_bytes = self.memory_bytes() - self.global_trie.size * NODE_BYTES
        return min(self.config.cache_size, (self.memory_budget_bytes - other_bytes) // NODE_BYTES)

    def _evict_global(self, max_size: int) -> None:
        slack = int(self.global_trie.size * EVICTION_SLACK)
        self.global_trie.evict_least_recent(max_size - slack)

    def _has_global_room(self, nodes: int) -> bool:
        """Make room for ``nodes`` more global nodes, evicting if needed."""
        limit = self._global_node_limit()
        if self.global_trie.size + nodes > limit:
            self._evict_global(limit - nodes)
        return self.global_trie.size + nodes <= limit

    def _has_room(self, num_bytes: int) -> bool:
        """Make room for ``num_bytes`` outside the global trie, evicting global nodes."""
        over = self.memory_bytes() + num_bytes - self.memory_budget_bytes
        if over > 0:
            self._evict_global(self.global_trie.size - -(-over // NODE_BYTES))
        return self.memory_bytes() + num_bytes <= self.memory_budget_bytes


def _read_warmup(path: str, voc_size: int) -> list[dict[str, list[int]]]:
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"lookahead warm-up file {path}: {e}") from None
    if not isinstance(records, list):
        raise ValueError(f"lookahead warm-up file {path}: expected a JSON list of records")
    checked = []
    for i, record in enumerate(records):
        if not isinstance(record, dict) or set(record) - {"prompt", "output"}:
            raise ValueError(f"lookahead warm-up file {path}: record {i} must be an object with prompt and output")
        fields = {}
        for key in ("prompt", "output"):
            ids = record.get(key, [])
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < voc_size for t in ids
            ):
                raise ValueError(
                    f"lookahead warm-up file {path}: record {i} {key} must be a list of token ids in [0, {voc_size})"
                )
            fields[key] = ids
        checked.append(fields)
    return checked


def _stop_learning(state: _Request) -> None:
    """The memory budget has no room left: the request learns nothing more, for good."""
    state.frozen = True
    logger.warning("lookahead cache: memory budget reached, a request stops learning")


def _learned_spans(gaps: Sequence[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The [begin, end) ranges of ``[start, end)`` outside ``gaps`` (sorted, disjoint)."""
    spans, at = [], start
    for gap_start, gap_end in gaps:
        if gap_start > at:
            spans.append((at, min(gap_start, end)))
        at = max(at, gap_end)
    if at < end:
        spans.append((at, end))
    return [(b, e) for b, e in spans if e > b]
