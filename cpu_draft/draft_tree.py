"""The shape of a drafted tree and its growth, level by level, from each level's top-k.

A tree is a greedy chain, optionally with the next-best siblings of each chain node
(``tree_width`` > 1): the siblings come from logits the chain already computed, so they
cost no forward pass. Beside the tree the builder keeps, per level, the tokens ranked just
below the chain's (the siblings and the best token outside the tree) with their path
probabilities: the draft's guesses of what the target decodes where it rejects the tree
at that level (`cpu_draft.runner_up`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hetero.core.protocols import TokenTree


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


class TreeBuilder:
    """Grows one sequence's tree level by level from that level's top-k (k: the level's nodes + 1)."""

    def __init__(self, levels: list[int]):
        self.levels = levels
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.chain: list[int] = []
        self.runner_ups: list[list[tuple[int, float]]] = []  # per level: (token, path probability) ranked below the chain's
        self.path_probs: list[float] = []  # per level: the chain's path probability down to it
        self._parent = -1

    @property
    def done(self) -> bool:
        return len(self.chain) == len(self.levels)

    def add_level(self, top_tokens: list[int], top_probs: list[float]) -> None:
        count = self.levels[len(self.chain)]
        chain_node = len(self.tokens)
        path_prob = self.path_probs[-1] if self.path_probs else 1.0
        for token, prob in zip(top_tokens[:count], top_probs[:count]):
            self.tokens.append(token)
            self.parents.append(self._parent)
            self.scores.append(path_prob * prob)
        self.runner_ups.append([(t, path_prob * p) for t, p in zip(top_tokens[1 : count + 1], top_probs[1 : count + 1])])
        self._parent = chain_node
        self.path_probs.append(path_prob * top_probs[0])
        self.chain.append(top_tokens[0])

    def tree(self) -> TokenTree:
        return TokenTree(np.asarray(self.tokens, np.int64), np.asarray(self.parents, np.int32), np.asarray(self.scores, np.float32))


class RunnerUp(NamedTuple):
    """An outcome of a step besides full acceptance with the draft's bonus: the real context's
    first ``prefix`` tokens (the old context and the part of the chain accepted), then ``token``."""

    kind: str  # "rejected": the target's token at a level is the draft's best outside the tree; "bonus": the bonus its second choice
    prob: float  # the draft's probability of the outcome
    prefix: int
    token: int


def runner_ups(context_len: int, levels: list[int], ranked: list[list[tuple[int, float]]], path_probs: list[float],
               bonus_ranked: list[tuple[int, float]]) -> list[RunnerUp]:
    """The runner-up outcomes of a chain drafted from a context of ``context_len`` tokens: per
    level, rejected with the draft's best token outside the level (``ranked``:
    `TreeBuilder.runner_ups`); and the chain accepted with each bonus of ``bonus_ranked``."""
    outcomes = [RunnerUp("rejected", level[width - 1][1], context_len + depth, level[width - 1][0])
                for depth, (width, level) in enumerate(zip(levels, ranked)) if len(level) >= width]
    chain_prob = path_probs[-1] if path_probs else 1.0
    return outcomes + [RunnerUp("bonus", chain_prob * prob, context_len + len(levels), token) for token, prob in bonus_ranked]
