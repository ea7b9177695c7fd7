"""How many sequences the draft worker drafts for, so its drafting stays behind the GPU's step.

Where the cores cannot draft every sequence's next tree while the GPU verifies the current
ones, the worker drafts for the sequences whose chains were accepted most and answers the
rest with no tree (they decode their one token in the verification step): the batch then
never waits for drafts it cannot use. The cost model is the worker's own measurements: the
time from answering one proposal to the next (the verification step), and the seconds per
drafted depth level, which grow with the rows of the forward as `row_overhead` + rows (a
forward's fixed cost of thread barriers and weight streaming counted in rows).
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
    accepted: dict[int, float] = field(default_factory=dict)  # per sequence: running share of its chain accepted

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

    def observe_accepted(self, seq_id: int, share: float) -> None:
        self.accepted[seq_id] = self._mean(self.accepted.get(seq_id), share)

    def forget(self, seq_id: int) -> None:
        self.accepted.pop(seq_id, None)

    def _seconds_per_row(self) -> float:
        """The measured level time per row of the cost model (`row_overhead` + rows per level)."""
        return self.level_s / (self.row_overhead + self.level_rows)

    def capacity(self, num_seqs: int, depth: int) -> int:
        """Sequences whose next trees (``depth`` levels, plus the bonus guess) fit one step; all until measured."""
        if self.cycle_s is None or self.level_s is None or num_seqs <= 1:
            return num_seqs
        fits = int(self.cycle_s / ((depth + 1) * self._seconds_per_row()) - self.row_overhead)
        return max(1, min(num_seqs, fits))

    def draft_now_pays(self, misses: list[int], batch_size: int, depth: int) -> bool:
        """Whether the step should wait for the trees of ``misses`` (sequences without a tree
        drafted ahead) rather than decode them without one.

        Waiting ``w`` seconds delays all ``batch_size`` sequences, whose step of ``cycle_s``
        yields about E tokens each; the misses' trees add about E - 1 tokens each, E being
        1 + their accepted share x ``depth``. It pays while ``w < cycle_s * m (E - 1) / (B E)``:
        at batch 1 a few milliseconds of drafting, in a large batch almost never. True until
        measured."""
        if not misses:
            return False
        if self.cycle_s is None or self.level_s is None:
            return True
        wait = depth * self._seconds_per_row() * (self.row_overhead + len(misses))
        gain = sum(self.accepted.get(s, 1.0) for s in misses) / len(misses) * depth  # E - 1
        return wait < self.cycle_s * len(misses) * gain / (batch_size * (1.0 + gain))

    def select(self, seq_ids: Iterable[int], depth: int) -> set[int]:
        """The sequences to draft for: those accepted most (new ones first), as many as fit."""
        seq_ids = list(seq_ids)
        ranked = sorted(seq_ids, key=lambda s: -self.accepted.get(s, 1.0))
        chosen = set(ranked[: self.capacity(len(seq_ids), depth)])
        for seq_id in seq_ids:
            if seq_id not in chosen and seq_id in self.accepted:
                self.accepted[seq_id] = min(1.0, self.accepted[seq_id] + self.aging)
        return chosen
