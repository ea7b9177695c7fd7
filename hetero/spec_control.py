"""How many tree nodes to verify per sequence this step, so speculation never loses.

Two limits apply. The node budget (`target_parallelism`, summed over the batch) shrinks
trees as the batch grows, because a large batch already fills the GPU. And the
controller measures, per batch-size bucket (powers of two), the tokens per second per
sequence that engine steps with and without speculation actually deliver (`record_step`; the engine
times a step from the end of the previous one while it is busy, so the caller's work
between steps counts, and it leaves out steps that the requests' lengths cut short).

Each option keeps its last `window` steps and is judged by their mean tokens per step over
their median seconds per step: acceptance really varies from step to step and its mean is
what pays, while a slow step (a cold first step, a pause) is noise that the median
ignores, as long as it is one of at least three. The controller first alternates, starting
with speculation, until each option has `min_samples` steps, or until a plain step has run
and speculation has accepted no draft token in enough sequence-steps (one step at batch
32): a step that accepts nothing emits a plain step's one token per sequence at a
verification's cost, so no timing is needed to rank it, and drafts that never fit cost two
steps to rule out at a large batch, not six. Then it runs the faster option (speculation
that is not running must lead by `margin` to be turned on; plain decoding returns once it
measures faster by more than the speculative estimate's standard error) and probes the
other one, to notice when acceptance changes: once the winner has run for
`probe_interval` of the loser's step times. Time, not steps: a plain
window emits 8 tokens per sequence and a speculative step a few, and a probe should cost
at most about 1/`probe_interval` of the time either way. The probe spacing doubles, up to
`max_probe_interval`, only while the evidence is solid: the losing option trails by more
than `margin` over a full window, or
over `SOLID_SEQUENCE_STEPS` sequence-steps (two steps at batch 64: what decides a
speculative step's worth is acceptance, and its estimate firms up with sequences, not
steps); a verdict that is solid when it is reached starts at twice the base spacing.
Drafts that accepted nothing are probed at `max_probe_interval` at once: no probe could
change that verdict short of the drafts themselves changing. A close call keeps probing
at `probe_interval`, and speculation that lost on a thin window (`_thin`) with drafts that
accepted something at a quarter of it; a probe faster than the winner is followed by
another at once, so a verdict that has become wrong is overturned within a few steps
instead of being locked in.

A probe at the base spacing takes about 1/`probe_interval` of the time, and what it loses
is the difference in tokens per second: 3 % of a step for speculation that trails by 3 %.
That holds while finished requests are replaced (a server, a queue of prompts). A batch
that drains (`DrainingBatch`: its caller waits for all of it, and no request waits to take
a finished one's place) ends with its slowest sequence, and two things change there.

Speculation's tokens per second overstate what it does for such a batch: its sequences
drift apart as their acceptance draws differ, and a sequence whose drafts fit worse than
the rest lags for good, so the batch ends later than its mean pace promises. The
controller scales speculation's measured pace by its reach (`speculation_reach`), the
share of it that reaches the batch's end, projected from each sequence's remaining tokens
and its own acceptance (`AcceptanceSpread`), and, for sequences with few trees yet, from
how unevenly drafts fitted earlier batches (`SpreadPrior`). On the GPU host's timings
(`bench/spec_control_sim.py`, 8 seeds), judging by the mean pace alone lost up to 6 % (the
worst seed) in closed batches of 4-32 sequences where speculation led by a few percent,
and 11-19 % (the median) at batch 16-64 where a quarter of the sequences drafted badly;
judged by its reach, under 2 % and under 2.5 %.

And a speculative probe costs nearly a whole step: its slowest sequence gets one token
from it, as from a plain token-step, at a verification's cost (at batch 32 on the GPU
host 3.3 ms of a 9.9 ms step: closed batches lost 0.3-0.4 % to probes at the base
spacing where speculation did not pay, bench/results/gpu_decode-20261123-122150). There,
speculation that lost a close call is probed at a doubling spacing too. A lone sequence
has no slower one to wait for.

How many nodes a speculating step verifies per sequence is the budget's share, cut to the
size with the most expected tokens per unit of step cost (`TreeSizer`): a node is worth
the measured probability of getting that far, and a deep node that is rarely reached
costs a large batch more than it brings.

A bucket with no verdict of its own borrows its neighbours' (`_inherited_verdict`):
speculation that pays at a batch size is kept at smaller ones, plain decoding that wins at
one is kept at larger ones, and the other option is probed every `probe_interval` steps
until the bucket has measured both. A batch whose requests finish unevenly therefore does
not re-explore every smaller bucket on its way down.

Within a speculating step, each sequence's own drafts are judged too (`DraftBackoff`): the
bucket's verdict is an average over its sequences, and a sequence whose drafts keep
missing pays for a tree every step while emitting one token, the same as a plain step
would. Its tree is withheld for a while, longer each time it keeps missing; a step in
which every sequence's tree is withheld is a plain step (multi-step windows included), and
is recorded as one: plain decoding's pace does not depend on drafts.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Optional, Sequence

import numpy as np


# Drafts whose first node is right with probability p accept nothing in this many
# sequence-steps with probability (1 - p)^32: 0.08 % at p = 0.2, below which speculation
# does not pay anyway. One step at batch 32 or more, 32 steps (never reached before the
# timed verdict) at batch 1.
NOTHING_ACCEPTED_SEQUENCE_STEPS = 32

# A losing option's window that spans this many sequence-steps is solid evidence, full or not:
# the mean accepted length over 128 sequence-steps has a standard error of about a tenth of a
# token per step, and its seconds are the median of at least `min_samples` steps.
SOLID_SEQUENCE_STEPS = 128


@dataclass
class _Samples:
    """Recent steps of one option in one bucket: (tokens emitted, seconds, sequences) each.

    The statistics are refreshed when a step is added, not when they are read: the engine
    reads them several times per step, plain windows included, and a median per read cost
    a measurable share of a plain window's host time.
    """

    window: int
    recent: deque = field(default_factory=deque)
    _sequence_steps: int = 0
    _mean_tokens: float = 0.0
    _median_seconds: float = 0.0
    _relative_error: float = 0.0
    _one_token_each: bool = True  # every step emitted at most one token per sequence

    def add(self, tokens: int, seconds: float, num_seqs: int) -> None:
        self.recent.append((tokens, seconds, num_seqs))
        if len(self.recent) > self.window:
            self.recent.popleft()
        count = len(self.recent)
        self._sequence_steps = sum(n for _, _, n in self.recent)
        self._mean_tokens = sum(t for t, _, _ in self.recent) / count
        self._median_seconds = median(s for _, s, _ in self.recent)
        self._one_token_each = all(t <= n for t, _, n in self.recent)
        variance = sum((t - self._mean_tokens) ** 2 for t, _, _ in self.recent) / max(count - 1, 1)
        self._relative_error = (variance / count) ** 0.5 / self._mean_tokens if self._mean_tokens else 0.0

    def sequence_steps(self) -> int:
        return self._sequence_steps

    def tokens_per_sequence_step(self) -> float:
        return self._mean_tokens * len(self.recent) / self._sequence_steps

    def accepted_any(self) -> bool:
        """Whether some step emitted more than one token per sequence (a draft token was accepted)."""
        return not self._one_token_each

    def accepted_nothing(self) -> bool:
        """No draft token accepted (one token per sequence each step) in at least
        `NOTHING_ACCEPTED_SEQUENCE_STEPS` sequence-steps."""
        return self._sequence_steps >= NOTHING_ACCEPTED_SEQUENCE_STEPS and self._one_token_each

    def pace(self) -> float:
        """Tokens per sequence-step over median seconds per step: tokens per second per sequence.

        Tokens vary from step to step for real (acceptance), and their mean is what a step
        delivers; a slow step (a pause, a cold start) is noise, which the median ignores.
        Per sequence, because a bucket spans batch sizes up to twice apart: a draining batch
        that speculated at 32 sequences and decoded plainly at 20 would otherwise credit
        speculation with the 12 sequences that had left.
        """
        return self.tokens_per_sequence_step() / self._median_seconds

    def seconds_per_step(self) -> float:
        return self._median_seconds

    def relative_error(self) -> float:
        """Standard error of the mean tokens per step, relative to it (0 while they never varied)."""
        return self._relative_error


@dataclass
class _Bucket:
    spec: _Samples
    plain: _Samples
    interval: int  # time between probes of the losing option, in its step times
    countdown: float  # time left until the next probe, in the losing option's step times
    speculating: Optional[bool] = None  # the last verdict, None while exploring
    reach: float = 1.0  # share of speculation's pace that reaches a draining batch's end (`speculation_reach`)
    reach_age: int = 0  # steps since the reach was projected
    reach_seqs: int = 0  # sequences it was projected for


class SpeculationController:
    REACH_REFRESH_STEPS = 4  # see `_refresh_reach`

    def __init__(
        self,
        max_nodes_per_seq: int,
        target_parallelism: int,
        probe_interval: int = 64,
        max_probe_interval: int = 1024,
        min_samples: int = 3,
        window: int = 16,
        margin: float = 0.05,
        always_speculate: bool = False,
        query_buckets: Optional[Sequence[int]] = None,
    ):
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [1, window={window}], got {min_samples}")
        self.max_nodes_per_seq = max_nodes_per_seq
        self.target_parallelism = target_parallelism
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.min_samples = min_samples  # samples per option before the first verdict
        self.window = window  # recent steps per option that its estimate is taken over
        self.margin = margin  # relative lead below which the verdict counts as a close call
        self.always_speculate = always_speculate  # skip the measurement (tests, cost benchmarks)
        self.tree_sizer = TreeSizer(max_nodes_per_seq, query_buckets)
        self._buckets: dict[int, _Bucket] = {}
        self.spread_prior = SpreadPrior()

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return 1 << max(num_seqs - 1, 0).bit_length()

    def _state(self, num_seqs: int) -> _Bucket:
        key = self.bucket(num_seqs)
        state = self._buckets.get(key)
        if state is None:
            state = _Bucket(_Samples(self.window), _Samples(self.window), self.probe_interval, self.probe_interval)
            self._buckets[key] = state
        return state

    def _verdict(self, state: _Bucket) -> Optional[bool]:
        """True: speculate; False: decode plainly; None: not measured enough yet.

        Speculative steps that accepted nothing settle it without timing: such a step emits
        one token per sequence, as a plain step does, at a verification's cost, while plain
        decoding runs in multi-step windows besides.
        """
        if not state.plain.recent:
            return None
        if state.spec.accepted_nothing():
            return False
        if min(len(state.spec.recent), len(state.plain.recent)) < self.min_samples:
            return None
        spec, plain = self._pace(state, True), self._pace(state, False)
        if state.speculating:
            return plain <= self._lead_to_switch(state, to_speculation=False) * spec
        return spec >= self._lead_to_switch(state, to_speculation=True) * plain

    @staticmethod
    def _pace(state: _Bucket, speculative: bool) -> float:
        """An option's measured pace (`_Samples.pace`); speculation's times its reach (`speculation_reach`)."""
        return state.spec.pace() * state.reach if speculative else state.plain.pace()

    def _lead_to_switch(self, state: _Bucket, to_speculation: bool) -> float:
        """How much faster than the current verdict the other option must measure to replace it.

        The speculative estimate is noisy at small batches: at batch 8 and p = 0.3 one step's
        tokens vary by about 18 %, so a window's mean by about 5 %. Speculation that is not
        running is turned on only past `margin`: without it the verdict flipped to
        speculation on lucky windows. Plain decoding, the floor, returns once it measures
        faster by more than the speculative estimate's standard error: returning as soon as
        it measured faster at all abandoned speculation that won by 8 % on its unlucky
        windows, most of the time (`test_noisy_speculation_that_wins_stays_on`).
        """
        return 1.0 + self.margin if to_speculation else 1.0 + state.spec.relative_error()

    def nodes_per_sequence(self, num_seqs: int, explore: bool = True, draining: Optional[DrainingBatch] = None) -> int:
        """Tree size to grant each decoding sequence this step (0 = plain decoding).

        ``explore=False`` is for a step that will not be recorded (one that also prefills):
        it follows the bucket's verdict, or its neighbours', and neither explores nor
        counts toward a probe; with no verdict at all it decodes plainly.

        ``draining``: given when the caller waits for the whole batch and no request waits
        to take a finished one's place, so the batch's run ends with its slowest sequence
        (see the module doc on draining batches).
        """
        budget = min(self.max_nodes_per_seq, self.target_parallelism // max(num_seqs, 1))
        if budget == 0:
            return 0
        if self.always_speculate:
            return budget
        size = self.tree_sizer.best_size(budget, num_seqs)
        draining = draining if num_seqs > 1 else None
        if explore:
            state = self._state(num_seqs)
            if draining is None:
                state.reach = 1.0
            else:
                self._refresh_reach(state, draining, size)
        return size if self._speculates(num_seqs, explore, draining is not None) else 0

    def _refresh_reach(self, state: _Bucket, draining: DrainingBatch, size: int) -> None:
        """Projects speculation's reach (`speculation_reach`) afresh every `REACH_REFRESH_STEPS`
        steps, and whenever a batch starts or a sequence leaves it.

        It moves slowly within a batch (it depends on trees and tokens left, summed over the
        run so far), and costs 0.1-0.3 ms of numpy per projection: a few percent of a
        speculative step at batch 8 if made at every step.
        """
        new_batch = not any(draining.trees)
        state.reach_age += 1
        if not (new_batch or len(draining.trees) != state.reach_seqs or state.reach_age >= self.REACH_REFRESH_STEPS):
            return
        state.reach_age, state.reach_seqs = 0, len(draining.trees)
        spread = AcceptanceSpread.of(draining, self.tree_sizer.accepted_dispersion(size), self.spread_prior.value)
        self.spread_prior.observe(draining, spread)
        if state.spec.recent and (not state.plain.recent or state.spec.pace() > state.plain.pace()):
            # (speculation slower than plain decoding at its whole pace loses at any reach)
            state.reach = speculation_reach(draining.remaining, state.spec.tokens_per_sequence_step(), spread)

    def _speculates(self, num_seqs: int, explore: bool, draining: bool) -> bool:
        """Whether this step speculates (see `nodes_per_sequence`); counts down to the next probe."""
        if not explore:
            state = self._buckets.get(self.bucket(num_seqs))
            verdict = None if state is None else self._verdict(state)
            if verdict is None:
                verdict = self._inherited_verdict(self.bucket(num_seqs))
            return bool(verdict)
        state = self._state(num_seqs)
        speculate = self._verdict(state)
        if speculate is None:
            inherited = self._inherited_verdict(self.bucket(num_seqs))
            if inherited is not None and state.countdown > 0:
                state.countdown -= 1  # in steps: the other option has no step time here yet
                return inherited
            if inherited is not None:
                state.countdown = self.probe_interval
            # Exploring (or probing an inherited verdict): the option measured less so far, speculation first.
            return len(state.spec.recent) <= len(state.plain.recent)
        if speculate != state.speculating:  # a new verdict: probe its loser at the base spacing (twice it on solid evidence)
            state.speculating = speculate
            state.interval = state.countdown = self._probe_spacing(state, speculate, self.probe_interval, draining)
        if state.countdown > 0:
            return speculate
        state.interval = state.countdown = self._probe_spacing(state, speculate, state.interval, draining)
        return not speculate

    def _probe_spacing(self, state: _Bucket, speculate: bool, current: int, draining: bool) -> int:
        """The loser's next probe spacing: the longest for drafts that accepted nothing; twice
        `current` on solid evidence (a verdict reached on it, or one that follows a thin
        window's short spacing, starts at twice the base); a quarter of the base for
        speculation that lost on a thin window; twice `current` for speculation that lost a
        close call in a draining batch (see the module doc on draining batches); else the base."""
        if state.spec.accepted_nothing():
            return self.max_probe_interval
        doubled = min(2 * max(current, self.probe_interval), self.max_probe_interval)  # never under twice the base
        if self._solid(state, speculate):
            return doubled
        if not speculate and state.spec.accepted_any() and self._thin(state.spec):
            return max(self.probe_interval // 4, 1)
        if not speculate and draining:
            return doubled
        return self.probe_interval

    def _thin(self, samples: _Samples) -> bool:
        """Whether an option's window is too short to trust: not full, and under `SOLID_SEQUENCE_STEPS`.

        The first verdict comes after `min_samples` speculative steps; at batch 1 or 8 their
        mean tokens are off by 10-25 %, and speculation that lost on them waited 64 of its
        step times (a whole 128-token run at batch 8) for its next chance: on the GPU host,
        batch 1 at p = 0.3 measured 1.00x in one run and 1.27x in the next. Drafts that
        accepted something are probed four times as often until their window is full or
        solid; drafts that accepted nothing are not, since at p = 0 each probe is a loss.
        """
        return len(samples.recent) < self.window and samples.sequence_steps() < SOLID_SEQUENCE_STEPS

    def _solid(self, state: _Bucket, speculate: bool) -> bool:
        """Whether the losing option trails by more than `margin` over a window that is not thin."""
        loser = state.plain if speculate else state.spec
        return not self._thin(loser) and self._pace(state, speculate) > (1 + self.margin) * self._pace(state, not speculate)

    def _inherited_verdict(self, bucket: int) -> Optional[bool]:
        """The verdict of measured neighbours for a bucket that has none of its own yet.

        Speculation that pays at a batch size pays at smaller ones too (each sequence gets
        more nodes, and verification costs less relative to a plain step), and plain
        decoding that wins at a batch size wins at larger ones. So a batch that shrinks as
        its requests finish keeps speculating without re-exploring each smaller bucket:
        there, a plain window costs 8 token-steps for a few sequences' last tokens.
        """
        verdicts = {key: self._verdict(state) for key, state in self._buckets.items() if key != bucket}
        speculate = any(v is True and key > bucket for key, v in verdicts.items())
        plain = any(v is False and key < bucket for key, v in verdicts.items())
        return None if speculate == plain else speculate

    def record_step(self, num_seqs: int, speculated: bool, tokens_emitted: int, seconds: float) -> None:
        """Measured outcome of one decode step."""
        if seconds <= 0:
            return
        state = self._state(num_seqs)
        (state.spec if speculated else state.plain).add(tokens_emitted, seconds, num_seqs)
        speculate = self._verdict(state)
        if speculate is None:
            return
        if speculated == speculate:
            loser = state.plain if speculate else state.spec
            state.countdown -= seconds / loser.seconds_per_step()
            return
        if state.spec.accepted_nothing():
            return
        pace = tokens_emitted / num_seqs / seconds * (state.reach if speculated else 1.0)
        if pace >= self._lead_to_switch(state, speculated) * self._pace(state, speculate):
            # A probe faster than the winner by what a switch takes: look again at once.
            # Consecutive such probes overturn the verdict; a fluke is outvoted by the probes after it.
            state.interval, state.countdown = self.probe_interval, 0

    def record_acceptance(self, num_nodes: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One step's verified trees: each one's node count and accepted draft tokens."""
        self.tree_sizer.record(num_nodes, num_accepted)
        self.spread_prior.trees_verified()

    def speculation_pays(self, num_seqs: int) -> bool | None:
        """Whether speculation measured faster at this batch size (None before both were measured)."""
        state = self._buckets.get(self.bucket(num_seqs))
        return None if state is None else self._verdict(state)


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
    # min(B * ROW_COST_PER_SEQUENCE, MAX_ROW_COST). Fitted to Llama-3-8B-shaped verification on
    # an H100 (graph replays and engine steps, bench/results/gpu_decode-20261123-07*): ~0.4 % per
    # row at batch 1, ~3 % at batch 8, ~5 % at batch 64.
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


def _at_least_counts(values: np.ndarray, top: int) -> np.ndarray:
    """[i] = how many of `values` are >= i, for i = 0..top."""
    return np.bincount(values, minlength=top + 1)[::-1].cumsum()[::-1].astype(np.float64)


class DraftBackoff:
    """Whether one sequence gets a tree this step, judged by its own recent acceptance.

    The batch-level verdict cannot see a sequence whose drafts are useless: a batch that
    speculates well shrinks, as its requests finish, to a straggler whose drafts all miss,
    and every speculative step then emits one token at more than a plain step's cost
    (and a speculative step gives up the multi-step windows plain decoding runs in).

    After `MISSES_BEFORE_BACKOFF` speculative steps in a row that accepted no draft token,
    the sequence gets no tree for a back-off of `FIRST_BACKOFF` of its decode steps; then
    one tree again as a probe. A probe that misses too doubles the back-off, up to
    `MAX_BACKOFF`, so a sequence whose drafts stay useless costs one speculative step per
    ever longer stretch of plain decoding; any accepted token ends the back-off (drafts
    that start to fit, say text the lookahead cache has seen, are used again). A run of
    misses, not a rate: a sequence that accepts now and then keeps its tree, and the
    state is three ints, cheap enough for every sequence of a 256-sequence step.

    Whether a tree accepts nothing depends on its first node only, so a run of misses has
    probability (1 - p)^n for drafts right with probability p, whatever the tree size. At
    p = 0.6 a run of 4 turned up by chance in most sequences of a 100-step batch (the GPU
    host's batch-64 runs), and the back-off put them behind the rest, lengthening the
    batch's tail. A run of 8 is still 5.8 % likely per step at p = 0.3, where a 3-node tree
    brings 0.42 tokens a step at batch 8 for a few percent of its cost: such sequences went
    without trees 28-42 % of the time, and the batch's speculative steps emitted a tenth
    fewer tokens by a run's end (the GPU host's batch 8). A run of 16 (0.3 % there) leaves
    them their trees 97-99 % of the time, and still withholds drafts right one time in ten
    for most of a run.
    """

    MISSES_BEFORE_BACKOFF = 16
    FIRST_BACKOFF = 4
    MAX_BACKOFF = 32

    __slots__ = ("misses", "steps_left", "next_backoff")

    def __init__(self) -> None:
        self.misses = 0  # speculative steps in a row that accepted no draft token
        self.steps_left = 0  # decode steps still to go without a tree
        self.next_backoff = self.FIRST_BACKOFF  # the back-off after the next miss past the limit

    def grants_tree(self) -> bool:
        """Whether the sequence gets a tree at this decode step (counts a step of back-off if not).

        Asked only at steps where the batch speculates: a back-off counts engine steps, so a
        lone sequence's back-off of 4 is 4 plain windows, and its probes cost about one
        speculative step per `MAX_BACKOFF` windows once the back-off is capped.
        """
        if self.steps_left:
            self.steps_left -= 1
            return False
        return True

    def record(self, num_accepted: int) -> None:
        """The outcome of a verified tree: how many of its draft tokens were accepted."""
        if num_accepted:
            self.misses = 0
            self.next_backoff = self.FIRST_BACKOFF
            return
        self.misses += 1
        if self.misses >= self.MISSES_BEFORE_BACKOFF:
            self.steps_left = self.next_backoff
            self.next_backoff = min(2 * self.next_backoff, self.MAX_BACKOFF)
