"""The lookahead cache: a model-free ``Proposer`` over token histories.

Two histories are searched for the sequence's latest tokens:

* the request's own (prompt and output so far), weighted by ``start_freq`` so that
  copy-heavy work (summarise, rewrite, code edits) finds its prompt first;
* the global one, shared by all requests: finished requests' outputs and prompts
  (prompts unless ``ignore_prompt``) and the warm-up file, unless
  ``global_cache_switch`` is off.

Each is a depth-bounded suffix trie (``lookahead.trie``). The global trie is bounded by
``cache_size`` nodes and, together with every request's state, by the memory budget;
least recently used paths are evicted first. Verdicts feed back: nodes the verifier
turned down have their frequency multiplied by ``decay`` and drop out of turbo's trees
once below ``threshold``.

Single-threaded: ``num_threads`` is accepted for TACO compatibility and not used.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Optional, Sequence

from hetero.core.protocols import MAX_TREE_NODES, ProposalRequest, Proposer, SpecStats, TokenTree, Verdict
from hetero.core.lookahead_config import LookaheadConfig
from lookahead.memory import default_memory_budget
from lookahead.proposal import Draft, Match, frequency_tree, recent_copies
from lookahead.stats import HitStats
from lookahead.trie import NODE_BYTES, HistoryAppender, Trie

logger = logging.getLogger("hetero.lookahead")

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


class LookaheadCache(Proposer):
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

    def _histories(self, state: _Request, context: list[int]) -> list[tuple[Trie, float, Sequence[int]]]:
        """(trie, weight, nodes of the context's suffixes known without walking) per history."""
        # The request's trie was just grown by the context's own tokens unless it stopped learning.
        known = state.appender.suffix_nodes() if state.history[-len(context):] == context else ()
        histories = [(state.trie, self.config.start_freq, known)]
        if self.config.global_cache_switch:
            histories.append((self.global_trie, 1.0, ()))
        return histories

    def _draft(self, state: _Request, context: list[int], budget: int) -> Draft:
        config = self.config
        histories = self._histories(state, context)
        if config.cache_mode == 0:
            return self._raw_draft(histories, context, budget, Draft())
        matches: list[Match] = [
            (trie, node, weight)
            for trie, weight, known in histories
            for node in trie.match(
                context, config.min_match_length, config.turbo_match_length, config.token_paths_top_k, known
            )
        ]
        draft = frequency_tree(
            matches, budget, config.copy_length, config.threshold, config.top_k_in_cell, config.eos_token_id
        )
        if config.cache_mode == 2 and (not len(draft) or (config.is_hybrid and len(draft) < budget)):
            draft = self._raw_draft(histories, context, budget, draft)
        return draft

    def _raw_draft(
        self, histories: list[tuple[Trie, float, Sequence[int]]], context: list[int], budget: int, draft: Draft
    ) -> Draft:
        config = self.config
        matches: list[Match] = [
            (trie, node, weight)
            for trie, weight, known in histories
            for node in trie.match(context, config.min_match_length, config.match_length, 1, known)
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
        trie, history = state.trie, state.history
        tokens = [int(token) for token in tokens]
        room_per_token = trie.depth * NODE_BYTES + TOKEN_BYTES
        # A token adds at most ``room_per_token``: when all of them fit, no check can fail or evict,
        # and they are learned at once; else one at a time, each checked.
        fits_all = self.memory_bytes() + len(tokens) * room_per_token <= self.memory_budget_bytes
        for chunk in [tokens] if fits_all else [[token] for token in tokens]:
            if not fits_all and not self._has_room(room_per_token):
                _stop_learning(state)
                return
            before = trie.size
            state.appender.extend(chunk, len(history))
            history.extend(chunk)
            self._request_nodes += trie.size - before
            self._history_tokens += len(chunk)

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
