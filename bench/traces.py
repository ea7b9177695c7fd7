"""Acceptance traces measured on real text, replayed by benches that time speculation with an
oracle proposer instead of a real draft (`bench.gpu_decode --trace code`).

`bench.acceptance` writes bench/data/traces/<workload>.json: per proposer, the per-position
acceptance (P(the d-th drafted token is accepted | the d - 1 before it were), d = 1, 2, ...)
and the accepted length of every replayed step. A trace is named `WORKLOAD` (the proposer
`DEFAULT_PROPOSER`, the real draft model's chain) or `WORKLOAD/PROPOSER`, e.g. `chat`,
`rewrite/lookahead-hybrid`. Sampling draws each position in turn with its rate, so a step's
accepted length follows the trace's conditional per-position acceptance; a depth beyond the
measured ones takes the deepest measured rate.

A proposer that often proposes nothing (the lookahead cache, when no n-gram matches) is
replayed from its recorded steps instead (`sample_recorded`): its per-position rates are
conditional on a proposal reaching that depth, so they alone would overstate it.
"""
from __future__ import annotations

import json
import pathlib
import random
from dataclasses import dataclass

TRACE_DIR = pathlib.Path(__file__).parent / "data" / "traces"
DEFAULT_PROPOSER = "draft-chain-16"


@dataclass(frozen=True)
class Trace:
    name: str
    per_position: tuple[float, ...]
    mean_accepted_length: float  # tokens per step (accepted + bonus) as measured, at the measured depth
    accepted: tuple[int, ...] = ()  # accepted draft tokens of every measured step, steps without a proposal included

    def rate(self, position: int) -> float:
        """Acceptance of the `position`-th drafted token (1-based) given the ones before it were accepted."""
        if position < 1:
            raise ValueError(f"position must be at least 1, got {position}")
        return self.per_position[min(position, len(self.per_position)) - 1]

    def sample_accepted(self, depth: int, rng: random.Random) -> int:
        """Accepted tokens of a chain drafted `depth` deep."""
        accepted = 0
        while accepted < depth and rng.random() < self.rate(accepted + 1):
            accepted += 1
        return accepted

    def sample_recorded(self, depth: int, rng: random.Random) -> int:
        """Accepted tokens of one recorded step drawn at random, capped at `depth`."""
        if not self.accepted:
            raise ValueError(f"trace {self.name} has no recorded steps")
        return min(depth, rng.choice(self.accepted))

    def expected_accepted(self, depth: int) -> float:
        """E[accepted tokens] of a chain `depth` deep under this trace."""
        expected, reach = 0.0, 1.0
        for position in range(1, depth + 1):
            reach *= self.rate(position)
            expected += reach
        return expected


def available() -> dict[str, list[str]]:
    """Workload -> proposers with a trace."""
    return {path.stem: sorted(json.loads(path.read_text())["proposers"]) for path in sorted(TRACE_DIR.glob("*.json"))}


def load_trace(name: str, trace_dir: pathlib.Path = TRACE_DIR) -> Trace:
    """The trace `WORKLOAD` or `WORKLOAD/PROPOSER`; ValueError lists what exists."""
    workload, _, proposer = name.partition("/")
    proposer = proposer or DEFAULT_PROPOSER
    path = trace_dir / f"{workload}.json"
    if not path.is_file():
        known = ", ".join(p.stem for p in sorted(trace_dir.glob("*.json"))) or "none"
        raise ValueError(f"no acceptance trace for workload {workload!r} (traces: {known}); run `python -m bench.acceptance`")
    proposers = json.loads(path.read_text())["proposers"]
    if proposer not in proposers:
        raise ValueError(f"trace {workload!r} has no proposer {proposer!r}; it has {', '.join(sorted(proposers))}")
    entry = proposers[proposer]
    return Trace(f"{workload}/{proposer}", tuple(entry["per_position"]), entry["mean_accepted_length"],
                 tuple(entry.get("accepted", ())))
