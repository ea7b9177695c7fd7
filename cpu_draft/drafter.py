"""The draft model with per-sequence KV that rolls back in O(1), drafting a whole batch at once.

Each sequence has a *context* (its real tokens: prompt + output so far; the last one is the
root of the next tree) and KV holding ``kv_tokens``, the tokens whose K/V were computed,
in position order. Drafting writes the draft chain into that KV, so ``kv_tokens`` may run
ahead of the context. Setting a new context keeps the longest common prefix of the two
and truncates the rest: rollback is a length change (plus, in the paged layout, freeing
whole blocks past the end), never a copy. Stale K/V past the end is invisible (attention
reads ``seq_len`` tokens) and is overwritten by the next write.

A tree is a greedy chain, optionally with the next-best siblings of each chain node
(``tree_width`` > 1): the siblings come from logits the chain already computed, so they
cost no forward pass. Per depth level there is one batched forward over every sequence.

The model is loaded as `gpu_target.model.CausalLM`, the target's own code, and runs over
one of the KV layouts of `cpu_draft.draft_kv`: on the CPU, contiguous slots read by a native
forward (`cpu_draft.native_model`) or a lean torch one (`cpu_draft.lean_model`) built from
it; on CUDA, the target's paged pool and runner with `CausalLM` itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Sequence

import numpy as np
import torch

from cpu_draft.draft_kv import PagedDraftKV, SlotDraftKV, default_layout
from cpu_draft.draft_vocab import draft_head_ids
from gpu_target.loader import load_config, load_state_dict, resolve_model_path
from gpu_target.model import CausalLM, build_model
from hetero.core.protocols import TokenTree

logger = logging.getLogger("hetero.cpu_draft")

SeqId = Hashable
SHORT_FEED_TOKENS = 16  # catch-up feeds up to this long are fed with the tree's first level
# Longer feeds (prompts) are prefilled in forwards of up to this many tokens: on the CPU a short
# forward, so the worker answers a proposal within one; on a GPU, whole prompts at once.
PREFILL_FORWARD_TOKENS = {"cpu": 32, "cuda": 2048}
WARM_UP_BATCHES = (1, 4, 8, 16, 32, 64)  # the proposal batch sizes `Drafter.warm_up` runs


@dataclass(frozen=True)
class DraftModelOptions:
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    int8_weights: bool = False
    tree_width: int = 1  # 1: chains; w: each chain node comes with its w-1 next-best siblings
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 256
    block_size: int = 16  # paged layout only
    kv_layout: Optional[str] = None  # "slots" | "paged"; None: slots on the CPU, paged elsewhere
    pack_linears: bool = True  # slots layout, torch forward: oneDNN-packed projections and logits head
    native_kernels: bool = True  # slots layout: the native forward (cpu_draft.native_model) where it builds, else the torch one
    kv_dtype: Optional[str] = None  # "float32" | "bfloat16"; None: float32 (paged: the model's dtype)
    draft_vocab_size: Optional[int] = None  # the head scores this many frequent tokens (cpu_draft.draft_vocab); None: all
    token_map: Optional[str] = None  # a file of token ids, most frequent first (SGLang's speculative_token_map)
    keep_token_ids: tuple[int, ...] = ()  # ids the reduced head always scores (special tokens)
    max_model_len: Optional[int] = None  # the longest context drafted; None: the draft's max_position_embeddings
    cuda_graphs: bool = True  # paged layout on CUDA: replay CUDA graphs for the drafting forwards
    prefill_forward_tokens: Optional[int] = None  # prompt tokens per prefill forward; None: the device's (PREFILL_FORWARD_TOKENS)


def tree_levels(max_nodes: int, width: int) -> list[int]:
    """Nodes per depth level (one chain node plus siblings) for a budget of ``max_nodes``.

    The chain is as deep as ``ceil(max_nodes / width)``; siblings fill the shallow levels first.
    """
    if max_nodes <= 0:
        return []
    width = max(1, min(width, max_nodes))
    depth = -(-max_nodes // width)
    siblings = max_nodes - depth
    levels = []
    for _ in range(depth):
        extra = min(width - 1, siblings)
        siblings -= extra
        levels.append(1 + extra)
    return levels


@dataclass
class _SeqState:
    context: list[int] = field(default_factory=list)
    kv_tokens: list[int] = field(default_factory=list)
    kv: object = None  # the KV layout's handle: a slot, or a block list
    chain: list[int] = field(default_factory=list)  # the last drafted chain, drafted from `context`


class _TreeBuilder:
    """Grows one sequence's tree level by level from that level's top-k."""

    def __init__(self, levels: list[int]):
        self.levels = levels
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.chain: list[int] = []
        self._parent = -1
        self._path_prob = 1.0

    @property
    def done(self) -> bool:
        return len(self.chain) == len(self.levels)

    def add_level(self, top_tokens: list[int], top_probs: list[float]) -> None:
        count = self.levels[len(self.chain)]
        chain_node = len(self.tokens)
        for token, prob in zip(top_tokens[:count], top_probs[:count]):
            self.tokens.append(token)
            self.parents.append(self._parent)
            self.scores.append(self._path_prob * prob)
        self._parent = chain_node
        self._path_prob *= top_probs[0]
        self.chain.append(top_tokens[0])

    def tree(self) -> TokenTree:
        return TokenTree(np.asarray(self.tokens, np.int64), np.asarray(self.parents, np.int32), np.asarray(self.scores, np.float32))


@dataclass
class _Work:
    index: int
    state: _SeqState
    builder: _TreeBuilder


class Drafter:
    def __init__(self, model: CausalLM, options: DraftModelOptions):
        self.config = model.config  # the model itself lives in the KV layout (the slots one keeps only its lean copy)
        self.options = options
        self.device = torch.device(options.device)
        self.max_positions = min(model.config.max_position_embeddings, options.max_model_len or model.config.max_position_embeddings)
        self.kv_layout = default_layout(self.device, options.kv_layout)
        ids = draft_head_ids(model.config.vocab_size, options.draft_vocab_size, options.token_map, options.keep_token_ids)
        # Head column -> token id (None: the head scores the whole vocabulary, column = id), read
        # on the host: one small index per level.
        self._head_id_array = ids
        head_ids = self.head_ids
        if self.kv_layout == "slots":
            self.kv = SlotDraftKV(model, options.dtype, options.kv_cache_bytes, self.max_positions, options.pack_linears, options.int8_weights,
                                  options.native_kernels, options.kv_dtype, head_ids)
        else:
            if head_ids is not None:
                restrict_head(model, head_ids)
            self.kv = PagedDraftKV(_paged_layout_model(model, options), options.dtype, self.device, options.kv_cache_bytes, options.max_num_seqs,
                                   options.block_size, self.max_positions, options.kv_dtype, options.cuda_graphs)
        self._seqs: dict[SeqId, _SeqState] = {}

    @classmethod
    def load(cls, model: str, options: DraftModelOptions) -> "Drafter":
        """Load a draft checkpoint (HF directory or GGUF) onto ``options.device``."""
        path = resolve_model_path(model)
        config = load_config(path)
        state = load_state_dict(path, config, options.dtype, options.device)
        net = build_model(config, state, options.dtype, options.device)
        del state
        return cls(net, options)

    # ------------------------------------------------------------ sequences
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def context(self, seq_id: SeqId) -> list[int]:
        return self._seqs[seq_id].context

    def last_chain(self, seq_id: SeqId) -> list[int]:
        return self._seqs[seq_id].chain

    def kv_length(self, seq_id: SeqId) -> int:
        return len(self._seqs[seq_id].kv_tokens)

    def set_context(self, seq_id: SeqId, token_ids: Sequence[int]) -> None:
        """The sequence's real tokens; the KV keeps its longest common prefix with them."""
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = _SeqState(kv=self.kv.new_handle())
        tokens = list(token_ids)
        if not tokens:
            raise ValueError(f"sequence {seq_id!r}: a context needs at least the root token")
        if tokens != state.context:
            state.chain = []
        state.context = tokens
        self._truncate(state, common_prefix_length(state.kv_tokens, tokens))

    def release(self, seq_id: SeqId) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self.kv.release(state.kv)

    def release_all(self) -> None:
        for seq_id in list(self._seqs):
            self.release(seq_id)

    def kv_snapshot(self, seq_id: SeqId) -> torch.Tensor:
        """K/V of the sequence's cached tokens: [layers, 2, kv_length, kv_heads, head_dim] (a copy)."""
        state = self._seqs[seq_id]
        return self.kv.snapshot(state.kv, len(state.kv_tokens))

    def warm_up(self, max_nodes: int) -> None:
        """Run a proposal's code paths once at each of `WARM_UP_BATCHES` (up to ``max_num_seqs``):
        a prompt's prefill, the first level's catch-up and the next levels' forwards.

        Their one-time costs (Triton compiles for new shapes on a GPU, first touches of packed
        weights and buffers on the CPU) are then paid at start-up rather than inside the first
        proposals of a batch size, where the engine's speculation controller would take them
        for what speculation costs. vLLM warms its model runner up the same way."""
        prompt = [(7919 * i) % self.vocab_size for i in range(2 * SHORT_FEED_TOKENS + 1)]
        for batch in sorted({min(b, self.options.max_num_seqs) for b in WARM_UP_BATCHES}):
            seq_ids = [("warm-up", i) for i in range(batch)]
            for seq_id in seq_ids:
                self.set_context(seq_id, prompt)
            self.draft([(seq_id, max_nodes) for seq_id in seq_ids])
            for seq_id in seq_ids:
                self.release(seq_id)
        self.kv.reset()

    # -------------------------------------------------------------- drafting
    def draft(
        self,
        requests: Sequence[tuple[SeqId, int]],
        interrupt: Optional[Callable[[], bool]] = None,
        cut: Optional[Callable[[], bool]] = None,
    ) -> Optional[list[TokenTree]]:
        """One tree per (seq_id, max_nodes), from each sequence's current context.

        ``interrupt`` is polled between depth levels; when it returns True drafting stops and
        None is returned (the KV stays consistent, no chain is recorded). ``cut`` is polled
        there next; when it returns True drafting stops and the trees of the levels drafted so
        far are returned, with their chains: what a smaller budget would have drafted (their
        sizes' `tree_levels` are a prefix of the budget's).
        """
        trees = [TokenTree.empty() for _ in requests]
        batch_ids = {seq_id for seq_id, _ in requests}
        work: list[_Work] = []
        for index, (seq_id, max_nodes) in enumerate(requests):
            state = self._seqs[seq_id]
            state.chain = []
            levels = tree_levels(max_nodes, self.options.tree_width)
            if not levels or len(state.context) + len(levels) > self.max_positions:
                continue
            self._truncate(state, min(len(state.kv_tokens), len(state.context) - 1))
            if self._reserve(state, len(state.context) + len(levels) - 1, batch_ids):
                work.append(_Work(index, state, _TreeBuilder(levels)))
        if not work:
            return trees
        top = self._catch_up([w.state for w in work], _level_width(work))
        active = work
        while True:
            self._add_levels(active, *top)
            active = [w for w in active if not w.builder.done]
            if not active:
                break
            if interrupt is not None and interrupt():
                return None
            if cut is not None and cut():
                break
            top = self._forward_top([w.state for w in active], [[w.builder.chain[-1]] for w in active], _level_width(active))
        for w in work:
            w.state.chain = w.builder.chain
            trees[w.index] = w.builder.tree()
        return trees

    def shrink_last_draft(self, seq_id: SeqId, tree: TokenTree, max_nodes: int) -> TokenTree:
        """The tree ``draft`` would have made with a budget of ``max_nodes`` <= the one ``tree`` had.

        ``tree`` must be the sequence's last draft: same logits, so the smaller tree is the
        first nodes of each of its levels. The recorded chain and the KV shrink to match.
        """
        state = self._seqs[seq_id]
        have = tree_levels(len(tree), self.options.tree_width)
        want = tree_levels(max_nodes, self.options.tree_width)
        starts, new_starts = np.cumsum([0] + have), np.cumsum([0] + want)
        keep = np.asarray([starts[d] + i for d, n in enumerate(want) for i in range(n)], np.int64)
        parents = np.asarray([-1 if d == 0 else new_starts[d - 1] for d, n in enumerate(want) for _ in range(n)], np.int32)
        scores = tree.scores[keep] if tree.scores is not None else None
        state.chain = state.chain[: len(want)]
        self._truncate(state, len(state.context) + max(len(want) - 1, 0))
        return TokenTree(tree.tokens[keep], parents, scores)

    def assume_accepted(self, seq_ids: Sequence[SeqId]) -> list[SeqId]:
        """Extend each sequence's context by its last chain and the draft's guess of the bonus token.

        One batched forward (the chain's last token; for a sequence without a chain, its root:
        the guess is then of the token the target decodes next); returns the sequences
        extended (those whose KV holds all but that token). Used to draft step t+1 during step t.
        """
        states = []
        for seq_id in seq_ids:
            state = self._seqs.get(seq_id)
            if state is None or not state.context:
                continue
            known = state.context + state.chain  # the last of these is fed now
            cached, checked = len(known) - 1, max(len(state.chain), 1)  # the chain's K/V (or the root's predecessor) must be in place
            if len(state.kv_tokens) > cached:  # the KV holds the root too (a context set back): it is fed again
                self._truncate(state, min(cached, common_prefix_length(state.kv_tokens, known)))
            if len(state.kv_tokens) != cached or state.kv_tokens[cached - checked :] != known[cached - checked : cached]:
                continue
            if len(known) + 1 > self.max_positions or not self._reserve(state, len(known), set(seq_ids)):
                continue
            states.append((seq_id, state, known))
        if not states:
            return []
        _, columns = self._forward_top([s for _, s, _ in states], [[known[-1]] for _, _, known in states], 1)
        guesses = [tokens[0] for tokens in self._token_ids(columns)]
        for (_, state, known), guess in zip(states, guesses):
            state.context = known + [guess]
            state.chain = []
        return [seq_id for seq_id, _, _ in states]

    @property
    def head_ids(self) -> Optional[torch.Tensor]:
        """The reduced head's token id per column (None: the whole vocabulary, column = id)."""
        return None if self._head_id_array is None else torch.from_numpy(self._head_id_array)

    # -------------------------------------------------------------- internals
    def _token_ids(self, columns: torch.Tensor) -> list[list[int]]:
        """Token ids of head columns [rows, k] (the reduced head scores a subset of the vocabulary), as lists."""
        columns = columns.cpu().numpy()
        return (columns if self._head_id_array is None else self._head_id_array[columns]).tolist()

    def _add_levels(self, work: list[_Work], top_probs: torch.Tensor, top_columns: torch.Tensor) -> None:
        """Each sequence's next level from its row of the level's best columns (`_level_width` of them)."""
        for w, tokens, probs in zip(work, self._token_ids(top_columns), top_probs.tolist()):
            w.builder.add_level(tokens, probs)

    def uncached(self, seq_id: SeqId) -> int:
        """Context tokens whose K/V the sequence's next draft must compute first (its root at least)."""
        state = self._seqs[seq_id]
        return len(state.context) - len(state.kv_tokens)

    def prefill(self, seq_ids: Sequence[SeqId], interrupt: Optional[Callable[[], bool]] = None) -> bool:
        """Compute the K/V of each sequence's context but its root, in forwards of up to
        `PREFILL_FORWARD_TOKENS` tokens; polls ``interrupt`` between them. True once done."""
        states = [self._seqs[s] for s in seq_ids]
        for state in states:
            if not self._reserve(state, len(state.context), set(seq_ids)):
                return False
        return self._prefill(states, interrupt)

    def _prefill(self, states: list[_SeqState], interrupt: Optional[Callable[[], bool]] = None) -> bool:
        while True:
            pending = [s for s in states if len(s.context) - 1 > len(s.kv_tokens)]
            if not pending:
                return True
            if interrupt is not None and interrupt():
                return False
            batch, feeds = [], []
            room = self.options.prefill_forward_tokens or PREFILL_FORWARD_TOKENS.get(self.device.type, PREFILL_FORWARD_TOKENS["cuda"])
            for state in pending:
                take = min(len(state.context) - 1 - len(state.kv_tokens), room)
                if take <= 0:
                    break
                batch.append(state)
                feeds.append(state.context[len(state.kv_tokens) : len(state.kv_tokens) + take])
                room -= take
            self._forward(batch, feeds)

    def _catch_up(self, states: list[_SeqState], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every sequence's uncached context (at least its root); the k best columns at each root, in order.

        Feeds up to `SHORT_FEED_TOKENS` share one forward; longer ones (prompts) are prefilled
        first (`prefill`), leaving their roots to it."""
        self._prefill([s for s in states if len(s.context) - len(s.kv_tokens) > SHORT_FEED_TOKENS])
        return self._forward_top(states, [s.context[len(s.kv_tokens) :] for s in states], k)

    def _forward(self, states: list[_SeqState], feeds: list[list[int]]) -> torch.Tensor:
        """Append ``feeds`` to the sequences' KV (room already reserved); logits of each feed's last token."""
        cached_lens = [len(state.kv_tokens) for state in states]
        logits = self.kv.forward([state.kv for state in states], cached_lens, feeds)
        for state, feed in zip(states, feeds):
            state.kv_tokens.extend(feed)
        return logits

    def _forward_top(self, states: list[_SeqState], feeds: list[list[int]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`_forward`, read as (probabilities, head columns) of each feed's last token's k best
        (`cpu_draft.top_probs`: by the native forward in its own call where it runs)."""
        cached_lens = [len(state.kv_tokens) for state in states]
        top = self.kv.forward_top([state.kv for state in states], cached_lens, feeds, k)
        for state, feed in zip(states, feeds):
            state.kv_tokens.extend(feed)
        return top

    def _reserve(self, state: _SeqState, num_tokens: int, protected: set) -> bool:
        """Room for ``num_tokens`` of KV; evicts the KV of sequences outside ``protected`` if short."""
        if self.kv.reserve(state.kv, num_tokens):
            return True
        for seq_id, other in self._seqs.items():
            if seq_id not in protected and self.kv.holds_kv(other.kv):
                self._truncate(other, 0)
                if self.kv.reserve(state.kv, num_tokens):
                    return True
        logger.warning("draft KV cache is full: a sequence goes without a draft this step")
        return False

    def _truncate(self, state: _SeqState, length: int) -> None:
        del state.kv_tokens[length:]
        self.kv.truncate(state.kv, length)


def _level_width(work: list[_Work]) -> int:
    """Nodes of the widest next level among ``work``: the best columns its forward reads."""
    return max(w.builder.levels[len(w.builder.chain)] for w in work)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0 or a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0])


def restrict_head(model: CausalLM, head_ids: torch.Tensor) -> None:
    """Give ``model`` a logits head over ``head_ids`` only (its columns in that order); embeddings stay whole."""
    weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    head = torch.nn.Linear(weight.shape[1], head_ids.numel(), bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        head.weight.copy_(weight[head_ids.to(weight.device)])
    model.lm_head = head.requires_grad_(False)


def _paged_layout_model(model: CausalLM, options: DraftModelOptions) -> CausalLM:
    """The model the paged layout runs: INT8 projections if asked, else IPEX's CPU linears where they apply.

    (The slots layout builds its own lean CPU model, quantised there after folding.)
    """
    if options.int8_weights:
        from cpu_draft.quantize import quantize_model_int8

        return quantize_model_int8(model, options.dtype)
    if torch.device(options.device).type == "cpu":
        return _maybe_ipex_optimize(model, options.dtype)
    return model


def _maybe_ipex_optimize(model: CausalLM, dtype: torch.dtype) -> CausalLM:
    """IPEX's prepacked CPU linears, only when IPEX is installed and built for this torch."""
    try:
        import intel_extension_for_pytorch as ipex
    except ImportError:
        return model
    if ipex.__version__.split("+")[0].rsplit(".", 1)[0] != torch.__version__.split("+")[0].rsplit(".", 1)[0]:
        logger.warning("IPEX %s does not match torch %s; drafting with plain PyTorch", ipex.__version__, torch.__version__)
        return model
    return ipex.optimize(model, dtype=dtype, inplace=True)
