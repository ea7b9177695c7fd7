"""Summarise a CPU draft worker's debug timeline: where the engine waited for its trees.

The worker logs a line per message at DEBUG (`HETERO_LOGGING_LEVEL=DEBUG`, or
`bench.e2e_speculation --log-level debug`): for a proposal, how long it queued behind the
worker's own drafting, how long the reply took, and how its trees were made (drafted ahead,
drafted again, pending, empty). The engine's wait for a proposal is about its queue and reply
times, so this table says which kind of proposal the waits went to:

* ``ahead``: every tree drafted ahead (the guesses held);
* ``redrafted``: no tree kept from drafting ahead (none was made, or one that a proposal
  rejecting a guess interrupted) and every tree drafted before the reply;
* ``pending``: some trees not ready (a prompt or plain window still being fed);
* ``empty``: no tree at all (every sequence left for after the reply);
* ``mixed``: the rest (hits beside misses).

A proposal that follows steps without trees (a SYNC came between, or more than twice the
median step since the last reply) is also counted as ``after_plain``: the probes of a
speculation that is off. ``overrun_share`` is the share of draft-aheads longer than the
median step between proposals.

    python -m bench.worker_timeline LOG [LOG ...]
"""
from __future__ import annotations

import argparse
import math
import re
import statistics
from dataclasses import dataclass
from typing import Iterable, Optional

from bench._report import markdown_table

PROPOSE_LINE = re.compile(
    r"PROPOSE of (?P<n>\d+), sent (?P<cycle>[\d.]+|nan) ms after the last reply: queued (?P<queued>[\d.]+) ms, "
    r"replied in (?P<replied>[\d.]+) ms \((?P<ahead>\d+) drafted ahead, (?P<again>\d+) drafted again, (?P<pending>\d+) pending, "
    r"(?P<empty>\d+) empty\); then drafted ahead for (?P<drafted>[\d.]+) ms")
KINDS = ("ahead", "mixed", "redrafted", "pending", "empty")


@dataclass(frozen=True)
class Proposal:
    seqs: int
    cycle_ms: float  # since the last reply; nan when a SYNC came between
    queued_ms: float
    replied_ms: float
    ahead: int
    again: int
    pending: int
    empty: int
    drafted_ms: float  # drafting ahead after the reply

    @property
    def wait_ms(self) -> float:
        return self.queued_ms + self.replied_ms

    @property
    def kind(self) -> str:
        if self.pending:
            return "pending"
        if self.empty == self.seqs:
            return "empty"
        if self.ahead == self.seqs:
            return "ahead"
        if self.ahead == 0 and self.empty == 0:
            return "redrafted"
        return "mixed"


def parse(lines: Iterable[str]) -> list[Proposal]:
    proposals = []
    for line in lines:
        match = PROPOSE_LINE.search(line)
        if match:
            g = match.groupdict()
            proposals.append(Proposal(int(g["n"]), float(g["cycle"]), float(g["queued"]), float(g["replied"]), int(g["ahead"]),
                                      int(g["again"]), int(g["pending"]), int(g["empty"]), float(g["drafted"])))
    return proposals


def summary(proposals: list[Proposal], name: str = "") -> Optional[dict]:
    """One row: proposals and the wait per kind (count / total ms), those after plain steps, the
    median step and reply, and the share of draft-aheads that overran the median step."""
    if not proposals:
        return None
    steps = [p.cycle_ms for p in proposals if not math.isnan(p.cycle_ms)]
    step = statistics.median(steps) if steps else math.nan
    after_plain = [p for p in proposals if math.isnan(p.cycle_ms) or p.cycle_ms > 2 * step]
    row = dict(log=name, proposals=len(proposals), wait_ms=round(sum(p.wait_ms for p in proposals), 1),
               wait_ms_per_proposal=round(statistics.mean(p.wait_ms for p in proposals), 2))
    for kind in KINDS:
        of_kind = [p for p in proposals if p.kind == kind]
        row[kind] = f"{len(of_kind)} / {sum(p.wait_ms for p in of_kind):.1f}"
    row["after_plain"] = f"{len(after_plain)} / {sum(p.wait_ms for p in after_plain):.1f}"
    row["step_ms_p50"] = round(step, 2)
    row["reply_ms_p50"] = round(statistics.median(p.replied_ms for p in proposals), 2)
    row["overrun_share"] = round(sum(p.drafted_ms > step for p in proposals) / len(proposals), 2) if steps else ""
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="files holding the worker's DEBUG lines (other lines are skipped)")
    args = parser.parse_args(argv)
    rows = []
    for path in args.logs:
        with open(path) as f:
            row = summary(parse(f), path)
        if row is not None:
            rows.append(row)
    print("kinds: proposals / their queue + reply ms")
    print("\n".join(markdown_table(rows)))


if __name__ == "__main__":
    main()
