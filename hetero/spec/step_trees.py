"""A step's token trees as one set of flat arrays, made once per step.

The engine concatenates the proposed trees' tokens for its vocabulary check when it
attaches them, and greedy verification needs the same flat tokens with node offsets (vLLM's
rejection sampler is likewise fed flat draft metadata: vllm/v1/spec_decode/metadata.py).
`StepTrees` carries that one concatenation from the first use to the second instead of
each making its own; parents are concatenated only if some tree is not a chain, since a
chain's parents are implied by its node offsets.
"""
from __future__ import annotations

import operator
from itertools import accumulate
from typing import Optional, Sequence

import numpy as np

from hetero.core.protocols import TokenTree


class StepTrees:
    """Non-empty trees, in order: their tokens (int64) and node offsets ([T + 1]) back to back."""

    __slots__ = ("trees", "tokens", "node_offsets", "chains", "_parents")

    def __init__(self, trees: Sequence[TokenTree]):
        self.trees = list(trees)
        self.tokens = np.concatenate([tree.tokens for tree in trees]) if trees else np.zeros(0, np.int64)
        self.node_offsets = np.asarray(list(accumulate((len(tree.token_list) for tree in trees), initial=0)), np.int64)
        self.chains = all(tree.is_chain for tree in trees)  # then the parents follow from the offsets
        self._parents: Optional[np.ndarray] = None

    @property
    def parents(self) -> Optional[np.ndarray]:
        """The trees' tree-local parents (int64), concatenated at the first call; None when every tree is a chain."""
        if self.chains:
            return None
        if self._parents is None:
            self._parents = np.concatenate([tree.parents for tree in self.trees]).astype(np.int64)
        return self._parents

    def in_vocab(self, vocab_size: int) -> bool:
        """Whether every node's token lies in [0, vocab_size)."""
        return not len(self.tokens) or (self.tokens.min() >= 0 and self.tokens.max() < vocab_size)

    def holds(self, trees: Sequence[TokenTree]) -> bool:
        """Whether these are exactly `trees` (the same objects, in order)."""
        return len(trees) == len(self.trees) and all(map(operator.is_, trees, self.trees))
