"""A draining batch (its caller waits for all of it): how much of speculation's pace reaches
the batch's end, from each sequence's own acceptance and the spread between sequences
(`DrainingBatch`, `speculation_reach`, `AcceptanceSpread`, `SpreadPrior`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class DrainingBatch:
    """A batch whose caller waits for all of it, per sequence: the tokens it may still emit
    (its `max_tokens` left), its verified trees, their accepted draft tokens so far and the
    sum of their squares."""

    remaining: Sequence[int]
    trees: Sequence[int]
    accepted: Sequence[int]
    squared: Sequence[int]


def speculation_reach(remaining: Sequence[int], tokens_per_step: float, spread: AcceptanceSpread) -> float:
    """The share of speculation's mean pace that reaches a draining batch's end.

    Plain decoding ends the batch in max R_i token-steps (R_i: tokens sequence i has left).
    Speculating, sequence i emits a random 1 + A_i tokens a step, so it needs a random
    number of steps T_i, about normal with mean R_i / mu_i and variance R_i var(A_i) / mu_i^3
    (renewal theory; mu_i = 1 + E[A_i]), and the batch ends at max T_i. Its expectation
    exceeds max R_i / mu, which is what the mean pace (mu tokens a sequence-step) promises,
    for two reasons: sequences that draw fewer accepted tokens fall behind the rest (at
    batch 8 and p = 0.3, tied sequences of 128 tokens finish about 7 % later than their mean),
    and sequences whose drafts fit worse lag for good. So the reach is
    (max R_i / mu) / E[max T_i], at most 1. E[A_i] is the step's mean acceptance times each
    sequence's own relative to the batch's, var(A_i) the variance within a sequence at that
    mean (`AcceptanceSpread`), and T_i is a mixture over how uncertain mu_i still is (three
    points, `_HERMITE_POINTS`): a sequence with few trees may yet turn out a laggard.
    """
    remaining = np.asarray(remaining, dtype=np.float64)
    longest = float(remaining.max(initial=0.0))
    if longest <= 0 or tokens_per_step <= 1.0:
        return 1.0
    if spread.relative_variance.any():
        relative = spread.relative[:, None] + np.sqrt(spread.relative_variance)[:, None] * _HERMITE_POINTS
        weights = _HERMITE_WEIGHTS
    else:
        relative, weights = spread.relative[:, None], None
    accepted = (tokens_per_step - 1.0) * np.maximum(relative, 0.0)
    rate = 1.0 + accepted
    means = remaining[:, None] / rate
    deviations = np.sqrt(spread.within_dispersion * accepted * remaining[:, None]) / rate**1.5
    finish = min(expected_maximum(means, deviations, weights), longest)  # never under one token a step
    return float(min(longest / tokens_per_step / finish, 1.0))


# Three-point Gauss-Hermite rule for a normal's mean and variance: how uncertain a sequence's
# rate still is enters its finishing time through 1 / rate, which is convex, so a rate that
# may be low weighs more than its symmetric chance of being high.
_HERMITE_POINTS = np.array([-np.sqrt(3.0), 0.0, np.sqrt(3.0)])
_HERMITE_WEIGHTS = np.array([1.0, 4.0, 1.0]) / 6.0


@dataclass(frozen=True)
class AcceptanceSpread:
    """How a draining batch's sequences differ in their accepted draft tokens per tree.

    A sequence's rate over n trees has sampling variance w / n, w the variance of a tree's
    accepted count within a sequence; the spread of the rates beyond that, s, is taken for
    real differences between the sequences (empirical Bayes). Each sequence's rate is then
    the batch's plus the share s / (s + w / n) of its deviation (`relative`, over the
    batch's rate), and it is still uncertain by s (w / n) / (s + w / n) (`relative_variance`,
    over the batch's rate squared): sequences alike in their drafts all count as the batch
    (no lucky or unlucky few taken for laggards), while one whose drafts fit worse is seen
    for what it is once its trees say so. A sequence with no tree yet counts as the batch,
    uncertain by all of s.

    s is what earlier batches measured (the prior, over the rate squared), or what this
    batch's rates show beyond doubt (their estimate less a standard error) where that is
    more: a batch whose sequences have few trees yet expects the spread its predecessors
    had. `measured` is this batch's own estimate, not clipped at zero (so that averaging
    estimates of a spread of zero gives zero), once its sequences have two trees each on
    average; None before.

    `within_dispersion`: w over the batch's rate. w is pooled from each sequence's own trees
    (their sums of squares), not taken from every tree's spread around the batch's rate:
    that spread includes the differences between sequences, and where a quarter of them
    drafted at a third of the rest's rate it read as noise and hid the laggards for dozens
    of steps. Before any sequence has two trees, `dispersion`, the variance over mean of
    the accepted count over every recent tree, stands in.
    """

    relative: np.ndarray
    relative_variance: np.ndarray
    within_dispersion: float
    measured: Optional[float] = None
    measured_error: float = 0.0  # the standard error of `measured`

    @classmethod
    def of(cls, batch: DrainingBatch, dispersion: float, prior: float = 0.0) -> AcceptanceSpread:
        trees = np.asarray(batch.trees, dtype=np.float64)
        accepted = np.asarray(batch.accepted, dtype=np.float64)
        prior = max(prior, 0.0)
        seen = trees > 0
        if not seen.any() or accepted.sum() <= 0:
            return cls(np.ones_like(trees), np.full_like(trees, prior), dispersion)
        batch_rate = accepted.sum() / trees.sum()
        seen_trees, seen_accepted = trees[seen], accepted[seen]
        squared = np.asarray(batch.squared, dtype=np.float64)[seen]
        degrees = seen_trees.sum() - len(seen_trees)
        if degrees < len(seen_trees):  # under two trees a sequence on average: w is not the batch's own yet
            within = dispersion * batch_rate
            relative, uncertain = _shrunk(seen, seen_accepted / seen_trees / batch_rate, within / seen_trees / batch_rate**2, prior)
            return cls(relative, uncertain, dispersion)
        within = max((squared - seen_accepted**2 / seen_trees).sum() / degrees, 1e-9)
        rates = seen_accepted / seen_trees / batch_rate
        noise = within / seen_trees / batch_rate**2
        # The spread this batch's rates show beyond doubt: their estimate less a standard error,
        # from the rates' own fourth moment (a sequence's rate over a few trees is far from
        # normal). A batch of 8 alike sequences with 3 trees each shows a spread by chance often
        # enough that believing it turned speculation that paid 1.65x off for a whole batch.
        deviations = (rates - rates.mean()) ** 2
        measured = float(deviations.mean() - noise.mean())
        error = float(deviations.var() / (len(rates) - 1)) ** 0.5 if len(rates) > 1 else float("inf")  # one rate: no spread to see
        relative, uncertain = _shrunk(seen, rates, noise, max(prior, measured - error))
        return cls(relative, uncertain, within / batch_rate, measured, error)


def _shrunk(seen: np.ndarray, rates: np.ndarray, noise: np.ndarray, spread: float) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's rate relative to the batch's, pulled towards 1 by the share of its
    deviation that `noise` (its sampling variance) explains given a real `spread`, and the
    variance left in it; for sequences not `seen` (no tree yet), 1 and all of the spread.
    Everything over the batch's rate (squared)."""
    spread = max(spread, 0.0)
    relative, uncertain = np.ones(len(seen)), np.full(len(seen), spread)
    share = spread / (spread + noise)
    relative[seen] = 1.0 + share * (rates - 1.0)
    uncertain[seen] = share * noise
    return relative, uncertain


class SpreadPrior:
    """How unevenly drafts fit a draining batch's sequences, carried from batch to batch.

    Each batch starts with no tree of its own, so without it the first steps of every batch
    took its sequences for alike: where a quarter of them drafted at a tenth of the rest's
    rate, batches speculated for a dozen steps before their laggards showed.

    One estimate per batch (the last one measured while at least three quarters of its
    sequences were still decoding: the tail is its laggards, alike among themselves), since
    a batch's estimates from step to step share most of their trees. `value` is a running
    mean of the estimates (the first `MEMORY_BATCHES` alike, then each new one at that share)
    less two standard errors of such a mean, so that a spread that a single batch of 8 shows
    by chance is not carried into the next ones.
    """

    MEMORY_BATCHES = 4

    def __init__(self) -> None:
        self.value = 0.0  # the spread to expect, over the batch's rate squared (`AcceptanceSpread`)
        self._mean = self._error = 0.0  # running means of the batches' estimates and of their standard errors
        self._batches = 0
        self._estimate: Optional[tuple[float, float]] = None  # this batch's latest (estimate, standard error)
        self._batch_size = 0  # decoding sequences this batch started with
        self._fresh = False  # trees verified since the last observation

    def trees_verified(self) -> None:
        self._fresh = True

    def observe(self, batch: DrainingBatch, spread: AcceptanceSpread) -> None:
        """One draining step's view; a step whose sequences have verified no tree starts a new batch."""
        num_seqs = len(batch.trees)
        if not any(batch.trees):
            self._close_batch()
            self._batch_size = num_seqs
            return
        self._batch_size = max(self._batch_size, num_seqs)
        if self._fresh and spread.measured is not None and num_seqs >= 0.75 * self._batch_size:
            self._estimate = (spread.measured, spread.measured_error)
        self._fresh = False

    def _close_batch(self) -> None:
        if self._estimate is None:
            return
        self._batches += 1
        count = min(self._batches, self.MEMORY_BATCHES)
        estimate, error = self._estimate
        self._mean += (estimate - self._mean) / count
        self._error += (error - self._error) / count
        self.value = self._mean - 2.0 * self._error / count**0.5
        self._estimate = None


def expected_maximum(means: np.ndarray, deviations: np.ndarray, weights: Optional[np.ndarray] = None, points: int = 24) -> float:
    """E[max X_i] of independent X_i, each normal (`means`, `deviations` of shape (n, 1)) or a
    mixture of normals (shape (n, k), component weights `weights` of shape (k,)): the integral
    of 1 - prod_i P(X_i <= x) from a point where that product is nought (four deviations under
    some variable's every component: 3e-5) to where it is one (four over every variable's:
    under 1 - 3e-5 n). Variables that cannot reach the lower point are left out."""
    low = (means - 4.0 * deviations).min(axis=1).max()
    high = (means + 4.0 * deviations).max()
    if high - low < 1e-9:
        return float(means.max())
    contenders = (means + 4.0 * deviations).max(axis=1) > low
    x = np.linspace(low, high, points)
    z = (x[:, None, None] - means[contenders]) / np.maximum(deviations[contenders], 1e-12)
    cdf = _normal_cdf(z)[..., 0] if weights is None else (_normal_cdf(z) * weights).sum(axis=2)  # no matmul: BLAS threads cost more than they save here
    above = 1.0 - np.prod(cdf, axis=1)
    return float(low + (above[:-1] + above[1:]).sum() * (x[1] - x[0]) / 2)


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    """The standard normal CDF (Abramowitz and Stegun 7.1.26, error under 1e-7): numpy has no erf."""
    x = np.abs(z) / np.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t
    return 0.5 * (1.0 + np.sign(z) * (1.0 - poly * np.exp(-x * x)))
