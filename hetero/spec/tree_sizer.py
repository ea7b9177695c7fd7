"""How many tree nodes a speculating step verifies per sequence: the size with the most
expected tokens per unit of step cost (`TreeSizer`; SpecInfer and Sequoia size trees the same way)."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


class TreeSizer:
    """The tree size, within the node budget, with the most expected tokens per unit of step cost.

    A verified tree's i-th node pays off with the probability that the sequence accepts at
    least i draft tokens, P(>= i), measured here over recent trees that had at least i
    nodes. A speculative step of n nodes per sequence is expected to emit 1 + P(>= 1) + ...
    + P(>= n) tokens per sequence, and costs one token-step plus a row cost (`_row_cost`)
    per extra query row per sequence, rows rounded up to the CUDA-graph query bucket the
    step will replay (`query_buckets`; a graph of 4 rows costs the same for 2 or 3 nodes).
    That cost is fitted to the GPU's graph replays; without graphs (the CPU, enforce_eager)
    no tree is cut and the budget alone decides.

    The budget alone (`target_parallelism`) gave a batch of 64 one node per sequence or
    eight, never the three that pay best at P(>= 1) = 0.6, and a batch of 8 its full 8
    nodes at P(>= 1) = 0.3, where 1 to 3 measured faster (bench/results/gpu_decode-20261123-074*).

    Positions deeper than the recent trees reached (too few trees offered them) are
    extrapolated from the deepest measured one at its own conditional rate, so a tree cut
    short grows back when its last node starts being accepted more often. Before any
    measurement, P(>= i) = `PRIOR_ACCEPTANCE` ** i. The counts decay with a half-life of
    `HALF_LIFE_SEQUENCE_STEPS`, so a change of workload shows within a few hundred
    sequence-steps.
    """

    HALF_LIFE_SEQUENCE_STEPS = 512
    MIN_TREES = 16.0  # trees offering position i (decayed) before P(>= i) counts as measured
    # Cost of one more query row per sequence, as a share of a one-token step, at B sequences:
    # min(B * ROW_COST_PER_SEQUENCE, MAX_ROW_COST), fitted to measured verification steps of a
    # Llama-3-8B-shaped target (bench/results/gpu_decode-20261123-07*).
    ROW_COST_PER_SEQUENCE = 0.004
    MAX_ROW_COST = 0.05
    # P(>= i) = 0.6 ** i until measured: a batch of 64 starts at 3 nodes, not 8, and a batch of 1
    # at 8 (at 0.5 ** i, 7 and 8 nodes tie there, and the first trees at batch 1 lost a node).
    PRIOR_ACCEPTANCE = 0.6

    def __init__(self, max_nodes: int, query_buckets: Optional[Sequence[int]] = None):
        self.max_nodes = max_nodes
        self.query_buckets = sorted(query_buckets) if query_buckets else None
        self.offered = np.zeros(max_nodes + 1)  # [i]: decayed count of trees with >= i nodes
        self.reached = np.zeros(max_nodes + 1)  # [i]: of those, trees with >= i accepted tokens
        self._best: dict[tuple[int, int], int] = {}  # (budget, num_seqs) -> best_size, until the next record
        self._dispersion: dict[int, float] = {}  # nodes -> accepted_dispersion, until the next record

    def record(self, num_nodes: Sequence[int], num_accepted: Sequence[int]) -> None:
        if not len(num_nodes):
            return
        decay = 0.5 ** (len(num_nodes) / self.HALF_LIFE_SEQUENCE_STEPS)
        nodes = np.minimum(np.asarray(num_nodes, dtype=np.int64), self.max_nodes)
        accepted = np.minimum(np.asarray(num_accepted, dtype=np.int64), nodes)
        self.offered = self.offered * decay + _at_least_counts(nodes, self.max_nodes)
        self.reached = self.reached * decay + _at_least_counts(accepted, self.max_nodes)
        self._best.clear()
        self._dispersion.clear()

    def acceptance_at_least(self) -> np.ndarray:
        """P(>= i) for i = 1..max_nodes (index i - 1); `PRIOR_ACCEPTANCE` ** i before any position is measured."""
        measured = self.offered[1:] >= self.MIN_TREES
        if not measured[0]:
            return self.PRIOR_ACCEPTANCE ** np.arange(1, self.max_nodes + 1)
        depth = int(np.argmin(measured)) if not measured.all() else len(measured)
        probs = np.minimum.accumulate(self.reached[1 : depth + 1] / self.offered[1 : depth + 1])
        previous = probs[-2] if depth > 1 else 1.0
        rate = probs[-1] / previous if previous > 0 else 0.0
        tail = probs[-1] * rate ** np.arange(1, self.max_nodes - depth + 1)
        return np.concatenate([probs, tail])

    def accepted_dispersion(self, nodes: int) -> float:
        """Variance over mean of the draft tokens a tree of `nodes` nodes accepts (1 before any acceptance).

        E[A] = sum of P(>= i) and E[A^2] = sum of (2i - 1) P(>= i), for i = 1..nodes.
        """
        dispersion = self._dispersion.get(nodes)
        if dispersion is None:
            at_least = self.acceptance_at_least()[:nodes]
            mean = at_least.sum()
            second = ((2 * np.arange(1, nodes + 1) - 1) * at_least).sum()
            dispersion = self._dispersion[nodes] = float((second - mean * mean) / mean) if mean > 0 else 1.0
        return dispersion

    def best_size(self, budget: int, num_seqs: int) -> int:
        """The node count in 1..budget with the most expected tokens per unit of step cost."""
        if budget <= 1 or self.query_buckets is None:
            return budget
        best = self._best.get((budget, num_seqs))
        if best is None:
            best = self._best[(budget, num_seqs)] = self._best_size(budget, num_seqs)
        return best

    def _best_size(self, budget: int, num_seqs: int) -> int:
        sizes = np.arange(1, budget + 1)
        expected_tokens = 1.0 + np.cumsum(self.acceptance_at_least()[:budget])
        cost = 1.0 + self._row_cost(num_seqs) * (np.array([self._rows(n) for n in sizes]) - 1)
        ratio = expected_tokens / cost
        return int(sizes[np.flatnonzero(ratio >= ratio.max() * (1 - 1e-9))[-1]])  # ties: the larger tree

    def _row_cost(self, num_seqs: int) -> float:
        """One more query row per sequence, as a share of a one-token step's cost."""
        return min(num_seqs * self.ROW_COST_PER_SEQUENCE, self.MAX_ROW_COST)

    def _rows(self, nodes: int) -> int:
        """Query rows a sequence's tree of `nodes` nodes occupies in the step (root included)."""
        return next((q for q in self.query_buckets if q > nodes), nodes + 1)


def _at_least_counts(values: np.ndarray, top: int) -> np.ndarray:
    """[i] = how many of `values` are >= i, for i = 0..top."""
    return np.bincount(values, minlength=top + 1)[::-1].cumsum()[::-1].astype(np.float64)
