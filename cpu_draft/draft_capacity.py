"""How many sequences the draft worker drafts for, and how deep, so its drafting stays behind the GPU's step.

Where the cores cannot draft every sequence's next tree while the GPU verifies the current
ones, the worker drafts for the sequences whose chains were accepted most and answers the
rest with no tree (they decode their one token in the verification step): the batch then
never waits for drafts it cannot use. Shallower trees fit more sequences into the same step,
so the depth is chosen with them: the plan that yields the most tokens per step, each
sequence's tree worth (1 - a^(d+1)) / (1 - a) tokens at depth d for its acceptance rate a
(Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", 2023, eq. 1).
A depth at which not even one sequence's tree fits the step is no plan: a batch of one,
which cannot shed sequences, gets trees as deep as its draft-ahead fits (a deeper tree makes
the engine wait for every level past it; how many of the granted nodes pay at the
sequence's acceptance is the engine's tree sizing).
The cost model is the worker's own measurements: the time from answering one proposal to the
next (the verification step), and the seconds per drafted depth level, which grow with the
rows of the forward as `row_overhead` + rows (a forward's fixed cost of thread barriers and
weight streaming counted in rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional


@dataclass
class DraftCapacity:
    row_overhead: float = 5.0
    smoothing: float = 0.3  # weight of the newest measurement in the running means
    aging: float = 0.05  # share by which a sequence left without a tree regains the benefit of the doubt per step
    cycle_s: Optional[float] = None  # from answering a proposal to the next one
    level_s: Optional[float] = None  # seconds per drafted depth level, at `level_rows` rows
    level_rows: int = 1
    # Per sequence: running means of the tokens accepted per chain and of the chains cut short;
    # their ratio is the maximum-likelihood acceptance rate of a chain's geometric run.
    accepted: dict[int, float] = field(default_factory=dict)
    rejected: dict[int, float] = field(default_factory=dict)

    def _mean(self, old: Optional[float], new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_cycle(self, seconds: float) -> None:
        self.cycle_s = self._mean(self.cycle_s, seconds)

    def observe_levels(self, seconds: float, levels: int, rows: int) -> None:
        """``levels`` forwards of ``rows`` rows took ``seconds``; kept as the time per level at ``rows``."""
        if levels < 1 or rows < 1:
            return
        per_level = seconds / levels
        if self.level_s is not None and rows != self.level_rows:  # carry the old mean over to the new row count
            self.level_s *= (self.row_overhead + rows) / (self.row_overhead + self.level_rows)
        self.level_s, self.level_rows = self._mean(self.level_s, per_level), rows

    def observe_accepted(self, seq_id: int, accepted: int, drafted: int) -> None:
        """``accepted`` of a chain's ``drafted`` tokens were accepted (the verifier stopped at the
        next one when fewer)."""
        self.accepted[seq_id] = self._mean(self.accepted.get(seq_id), float(accepted))
        self.rejected[seq_id] = self._mean(self.rejected.get(seq_id), float(accepted < drafted))

    def forget(self, seq_id: int) -> None:
        self.accepted.pop(seq_id, None)
        self.rejected.pop(seq_id, None)

    def acceptance_rate(self, seq_id: int) -> float:
        """The chance that the sequence's next drafted token is accepted; 1 until measured."""
        accepted, rejected = self.accepted.get(seq_id, 0.0), self.rejected.get(seq_id, 0.0)
        return 1.0 if accepted + rejected == 0 else accepted / (accepted + rejected)

    def expected_tokens(self, seq_id: int, depth: int) -> float:
        """Tokens a step yields for the sequence with a chain of ``depth`` (the bonus token included)."""
        rate = self.acceptance_rate(seq_id)
        return depth + 1.0 if rate >= 1.0 else (1.0 - rate ** (depth + 1)) / (1.0 - rate)

    def _seconds_per_row(self) -> float:
        """The measured level time per row of the cost model (`row_overhead` + rows per level)."""
        return self.level_s / (self.row_overhead + self.level_rows)

    def capacity(self, num_seqs: int, depth: int) -> int:
        """Sequences whose next trees (``depth`` levels, plus the bonus guess) fit one step; all until measured."""
        if self.cycle_s is None or self.level_s is None or num_seqs <= 1:
            return num_seqs
        return max(1, min(num_seqs, self._rows_in_step(depth)))

    def _rows_in_step(self, depth: int) -> int:
        """Rows whose draft-ahead of ``depth`` levels and the bonus guess fits one step (measured)."""
        return int(self.cycle_s / ((depth + 1) * self._seconds_per_row()) - self.row_overhead)

    def draft_now_pays(self, misses: list[int], batch_size: int, depth: int) -> bool:
        """Whether the step should wait for the trees of ``misses`` (sequences without a tree
        drafted ahead) rather than decode them without one.

        Waiting ``w`` seconds delays all ``batch_size`` sequences, whose step of ``cycle_s``
        yields about E tokens each; the misses' trees add about E - 1 tokens each, E being
        1 + their accepted share x ``depth``. It pays while ``w < cycle_s * m (E - 1) / (B E)``:
        at batch 1 a few milliseconds of drafting, in a large batch almost never. Until
        measured, only at batch 1: a wait of unknown length would hold up the whole batch (the
        cycle is measured between proposals in a row, so a batch probing speculation after
        each plain window would otherwise wait for every tree at every probe)."""
        if not misses:
            return False
        if self.cycle_s is None or self.level_s is None:
            return batch_size == 1
        wait = depth * self._seconds_per_row() * (self.row_overhead + len(misses))
        gain = sum(self.expected_tokens(s, depth) for s in misses) / len(misses) - 1.0  # E - 1
        return wait < self.cycle_s * len(misses) * gain / (batch_size * (1.0 + gain))

    def plan(self, seq_ids: Iterable[int], depth: int) -> tuple[set[int], int]:
        """The sequences to draft for (those accepted most, new ones first) and the depth, at most
        ``depth``, that together fit one step and yield the most tokens; the deepest on a tie.
        Once measured, only depths at which at least one tree fits (one level where none does).
        Sequences left out regain `aging` of the benefit of the doubt."""
        seq_ids = list(seq_ids)
        ranked = sorted(seq_ids, key=lambda s: -self.acceptance_rate(s))
        measured = self.cycle_s is not None and self.level_s is not None
        best_tokens, count, best_depth = -1.0, len(ranked), depth
        for trial in range(depth, 0, -1):
            if measured and trial > 1 and self._rows_in_step(trial) < 1:
                continue
            fits = self.capacity(len(ranked), trial)
            tokens = sum(self.expected_tokens(s, trial) for s in ranked[:fits]) + len(ranked) - fits
            if tokens > best_tokens + 1e-9:
                best_tokens, count, best_depth = tokens, fits, trial
        chosen = set(ranked[:count])
        for seq_id in seq_ids:
            if seq_id not in chosen and seq_id in self.rejected:
                self.rejected[seq_id] *= 1.0 - self.aging
        return chosen, best_depth
