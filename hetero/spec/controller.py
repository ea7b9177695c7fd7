"""Whether a step speculates, so that speculation never loses to plain decoding.

The controller measures, per batch-size bucket (powers of two), the tokens per second per
sequence that whole engine steps deliver with and without speculation (`record_step`).
Each option is judged by its mean tokens per step over its typical seconds per step (the
mean without the slowest eighth, `trimmed_mean_seconds`, plus the mean wait for drafts): the
mean of acceptance is what pays, an isolated slow step (a pause) is left out, and the waits
for drafts count, each of them (a draft worker's stall is the draft's cost, not a pause).

It first alternates, starting with speculation, until each option has `min_samples` steps.
Then it runs the faster option and probes the other, to notice when acceptance changes.
Speculation that is not running must lead by `margin` to be turned on.
- Probes are spaced in time, not steps: `probe_interval` of the loser's step times.
- The spacing doubles (up to `max_probe_interval`) while the evidence is solid.
- Drafts that accepted nothing are probed at the longest spacing at once.
- A probe that got only pending trees (the proposer not ready) is not judged, and is taken
  again, once, at the next step (`probe_not_judged`).
- A speculative step right after plain steps waits for the proposer to catch up on their
  tokens (a draft worker feeds a plain window's tokens before it can draft): a cost of
  switching, not of speculating. That step is not judged; speculation is probed again at
  the next two steps, which are, and the switch's extra wait spaces the probes so that they
  cost at most `SWITCH_COST_SHARE` of the time between them (`record_switch`).

A batch whose caller waits for all of it (`DrainingBatch`) ends with its slowest sequence.
There, speculation's pace is scaled by its reach, the share of it that reaches the
batch's end (`hetero.spec.draining`). Tree sizes come from `TreeSizer`; sequences whose
drafts keep missing are held back by `DraftBackoff`. Measurements behind the constants are
in bench/results (`bench.spec_control_sim`, `bench.gpu_decode --sections spec`).
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence


from hetero.spec.draining import AcceptanceSpread, DrainingBatch, SpreadPrior, speculation_reach
from hetero.spec.tree_sizer import TreeSizer

logger = logging.getLogger("hetero")


# Drafts whose first node is right with probability p accept nothing in this many
# sequence-steps with probability (1 - p)^32: 0.08 % at p = 0.2, below which speculation
# does not pay anyway. One step at batch 32 or more, 32 steps (never reached before the
# timed verdict) at batch 1.
NOTHING_ACCEPTED_SEQUENCE_STEPS = 32

# A losing option's window that spans this many sequence-steps is solid evidence, full or not:
# the mean accepted length over 128 sequence-steps has a standard error of about a tenth of a
# token per step, and its seconds come from at least `min_samples` steps.
SOLID_SEQUENCE_STEPS = 128

# The share of the time between speculation's probes that their switching cost (the catch-up
# wait of a step right after plain steps) may take: speculation that cannot pay may cost 1 %.
SWITCH_COST_SHARE = 0.01


def cut_short(rooms: list[int], tokens_per_seq: int, tolerance: float = 0.1) -> bool:
    """Whether the sequences' remaining lengths (``rooms``) take more than ``tolerance`` of the
    ``tokens_per_seq`` each could emit this step: a step that mostly measures requests ending,
    which `SpeculationController.record_step` should not be shown.

    A share, not any one sequence: in a server some request is always about to finish.
    """
    lost = sum(max(0, tokens_per_seq - room) for room in rooms)
    return lost > tolerance * tokens_per_seq * len(rooms)


def trimmed_mean_seconds(seconds: list[float]) -> float:
    """The mean of the step times without the slowest eighth (at least one, from three steps on).

    A step that a pause or a cold start made slow is rare, and left out; steps that are slow
    in a quarter or a third of cases are what the option costs, and stay in, where a median
    would hide them. Waits for drafts are not trimmed at all: `_Samples.add` takes them out
    of the steps' times first and adds their mean back.
    """
    ordered = sorted(seconds)
    drop = max(len(ordered) // 8, 1) if len(ordered) >= 3 else 0
    kept = ordered[: len(ordered) - drop]
    return sum(kept) / len(kept)


@dataclass
class _Samples:
    """Recent steps of one option in one bucket: (tokens emitted, seconds, sequences, seconds
    of those waiting for drafts) each.

    The statistics are refreshed when a step is added, not when they are read: the engine
    reads them several times per step, plain windows included, and a sort per read cost
    a measurable share of a plain window's host time.
    """

    window: int
    recent: deque = field(default_factory=deque)
    _sequence_steps: int = 0
    _mean_tokens: float = 0.0
    _typical_seconds: float = 0.0
    _relative_error: float = 0.0
    _one_token_each: bool = True  # every step emitted at most one token per sequence
    _mean_wait: float = 0.0

    def add(self, tokens: int, seconds: float, num_seqs: int, waited: float = 0.0) -> None:
        self.recent.append((tokens, seconds, num_seqs, min(waited, seconds)))
        if len(self.recent) > self.window:
            self.recent.popleft()
        count = len(self.recent)
        self._sequence_steps = sum(n for _, _, n, _ in self.recent)
        self._mean_tokens = sum(t for t, _, _, _ in self.recent) / count
        self._mean_wait = sum(w for _, _, _, w in self.recent) / count
        # The slowest steps are trimmed by their own time; every wait for drafts counts.
        self._typical_seconds = trimmed_mean_seconds([s - w for _, s, _, w in self.recent]) + self._mean_wait
        self._one_token_each = all(t <= n for t, _, n, _ in self.recent)
        variance = sum((t - self._mean_tokens) ** 2 for t, _, _, _ in self.recent) / max(count - 1, 1)
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
        """Tokens per sequence-step over typical seconds per step: tokens per second per sequence.

        Tokens vary from step to step for real (acceptance), and their mean is what a step
        delivers; seconds are `trimmed_mean_seconds` of the steps' own time plus the mean wait for drafts.
        Per sequence, because a bucket spans batch sizes up to twice apart: a draining batch
        that speculated at 32 sequences and decoded plainly at 20 would otherwise credit
        speculation with the 12 sequences that had left.
        """
        return self.tokens_per_sequence_step() / self._typical_seconds

    def seconds_per_step(self) -> float:
        return self._typical_seconds

    def mean_wait(self) -> float:
        """The mean time its steps waited for drafts."""
        return self._mean_wait

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
    reprobes: int = 0  # steps that probe speculation again, the probe before not judged (`probe_not_judged`, `record_switch`)
    reprobing: bool = False  # this step is one of those probes
    switch_seconds: deque = field(default_factory=lambda: deque(maxlen=3))  # the last switches' costs (`record_switch`)


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
        reprobe, state.reprobes, state.reprobing = state.reprobes > 0, max(state.reprobes - 1, 0), False
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
            self._space_probes(state, speculate, self.probe_interval, draining)
            logger.debug("batch of %d: %s (tokens per second per sequence: speculative %.1f, plain %.1f); "
                         "next probe in %.0f step times", num_seqs, "speculating" if speculate else "decoding plainly",
                         self._pace(state, True), self._pace(state, False), state.countdown)
        elif reprobe and not speculate:
            state.reprobing = True
            return True
        if state.countdown > 0:
            return speculate
        self._space_probes(state, speculate, state.interval, draining)
        return not speculate

    def _space_probes(self, state: _Bucket, speculate: bool, current: int, draining: bool) -> None:
        """Sets the loser's next probe spacing (`_probe_spacing`) and the countdown to it (`_count_down`)."""
        state.interval = self._probe_spacing(state, speculate, current, draining)
        self._count_down(state, speculate)

    def _count_down(self, state: _Bucket, speculate: bool) -> None:
        """Steps to the loser's next probe: its spacing, never closer for speculation than its
        switching cost allows (`_switch_spacing`)."""
        state.countdown = max(state.interval, self._switch_spacing(state, speculate))

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

    def _switch_spacing(self, state: _Bucket, speculate: bool) -> int:
        """The spacing, in speculation's step times, at which a probe's switching cost is
        `SWITCH_COST_SHARE` of the time between probes; 0 when plain decoding is probed (it
        has no catch-up). The cost is the least of the last three switches': a catch-up that
        also fed prompts just admitted (a server's start, a new batch) is not what the next
        switch will cost."""
        if speculate or not state.switch_seconds or not state.spec.recent:
            return 0
        steps = min(state.switch_seconds) / SWITCH_COST_SHARE / state.spec.seconds_per_step()
        return min(math.ceil(steps), self.max_probe_interval)

    def _thin(self, samples: _Samples) -> bool:
        """Whether an option's window is too short to trust: not full, and under `SOLID_SEQUENCE_STEPS`.

        The first verdict comes after `min_samples` speculative steps, whose mean tokens at
        small batches are far off the true mean; speculation that lost on them would wait 64 of
        its step times (a whole short run) for its next chance. Drafts that accepted something
        are probed four times as often until their window is full or solid; drafts that
        accepted nothing are not, since at p = 0 each probe is a loss.
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

    def record_step(self, num_seqs: int, speculated: bool, tokens_emitted: int, seconds: float,
                    draft_wait: float = 0.0) -> None:
        """Measured outcome of one decode step; ``draft_wait``: the part of ``seconds`` spent waiting for its drafts."""
        if seconds <= 0:
            return
        state = self._state(num_seqs)
        (state.spec if speculated else state.plain).add(tokens_emitted, seconds, num_seqs, draft_wait)
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

    def probe_not_judged(self, num_seqs: int) -> None:
        """The last step got no tree, only pending ones (the proposer not ready: a draft worker
        still feeding the tokens of the plain windows before it), so it was not judged. Where it
        was speculation's probe against a plain verdict, the next step probes again: a probe
        lost this way would otherwise be followed by more plain windows, after which the
        worker is behind again, and speculation that pays could stay off for good. Once: a
        second probe not judged either (a worker prefilling prompts, which takes many steps)
        waits for the next spaced probe."""
        state = self._buckets.get(self.bucket(num_seqs))
        if state is not None and state.speculating is False:
            state.reprobes = 0 if state.reprobing else 1
            state.reprobing = False

    def record_switch(self, num_seqs: int, draft_wait: float) -> None:
        """A speculative step right after steps without trees, at its launch, for a proposer
        that drafts ahead and so catches up on their tokens first (the CPU draft worker): not
        judged (see the module doc). Its wait beyond speculation's mean wait is the switch's
        cost, which spaces speculation's probes (`_switch_spacing`).

        Where it was a probe against a plain verdict, the next two steps speculate again and
        are judged: under async scheduling a step is decided before the one before it is
        recorded, so a winning first judged probe can only ask for the step after the second
        (`record_step`: look again at once), which must not follow a plain window (another
        switch) for a chain of probes to form."""
        state = self._state(num_seqs)
        state.switch_seconds.append(max(draft_wait - (state.spec.mean_wait() if state.spec.recent else 0.0), 0.0))
        if state.speculating is False:
            state.reprobes, state.reprobing = 2, False
            self._count_down(state, False)  # spaced by this switch too

    def record_acceptance(self, num_nodes: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One step's verified trees: each one's node count and accepted draft tokens."""
        self.tree_sizer.record(num_nodes, num_accepted)
        self.spread_prior.trees_verified()

    def speculation_pays(self, num_seqs: int) -> bool | None:
        """Whether speculation measured faster at this batch size (None before both were measured)."""
        state = self._buckets.get(self.bucket(num_seqs))
        return None if state is None else self._verdict(state)
