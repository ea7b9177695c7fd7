"""Speculative-decoding counters from a server's Prometheus /metrics text.

hetero exports (the names this module looks for first)::

    hetero:spec_decode_num_draft_tokens_total     draft tokens proposed
    hetero:spec_decode_num_accepted_tokens_total  draft tokens the target accepted
    hetero:spec_decode_num_steps_total            verification steps (one per sequence per step)

Each verification step yields the accepted tokens plus one bonus token, so over a run

    mean acceptance length = (accepted + steps) / steps

Other servers spell the counters differently (vLLM: ``vllm:spec_decode_num_drafts_total``
for the steps); any counter whose name contains ``spec_decode`` and ``accepted`` /
``draft_tokens`` / ``num_steps`` or ``num_drafts`` is taken, summed over its label sets.
Per-position breakdowns (``per_pos``) and ``_created`` timestamps are ignored.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

HETERO_ACCEPTED = "hetero:spec_decode_num_accepted_tokens_total"
HETERO_DRAFT_TOKENS = "hetero:spec_decode_num_draft_tokens_total"
HETERO_STEPS = "hetero:spec_decode_num_steps_total"

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Metric name -> value summed over all its label sets; comments are skipped."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        name = match.group(1)
        totals[name] = totals.get(name, 0.0) + value
    return totals


@dataclass(frozen=True)
class SpecDecodeCounters:
    accepted: float
    draft_tokens: Optional[float]
    steps: Optional[float]
    names: dict  # which metric each field was read from


def _pick(samples: dict[str, float], preferred: str, *fragments_any: str) -> Optional[str]:
    if preferred in samples:
        return preferred
    candidates = sorted(
        name for name in samples
        if "spec_decode" in name and "per_pos" not in name and not name.endswith("_created")
        and any(fragment in name for fragment in fragments_any)
    )
    counters = [name for name in candidates if name.endswith("_total")]
    return (counters or candidates or [None])[0]


def find_spec_decode_counters(samples: dict[str, float]) -> Optional[SpecDecodeCounters]:
    """The speculative counters in parsed /metrics samples, or None if there are none."""
    accepted = _pick(samples, HETERO_ACCEPTED, "accepted")
    if accepted is None:
        return None
    draft = _pick(samples, HETERO_DRAFT_TOKENS, "draft_tokens")
    steps = _pick(samples, HETERO_STEPS, "num_steps", "num_drafts")
    return SpecDecodeCounters(
        accepted=samples[accepted],
        draft_tokens=samples[draft] if draft else None,
        steps=samples[steps] if steps else None,
        names={"accepted": accepted, "draft_tokens": draft, "steps": steps},
    )


def acceptance_over_run(before: SpecDecodeCounters, after: SpecDecodeCounters) -> dict:
    """Mean acceptance length and draft acceptance rate from counters read around a run."""
    accepted = after.accepted - before.accepted
    steps = _delta(before.steps, after.steps)
    drafts = _delta(before.draft_tokens, after.draft_tokens)
    return {
        "metric_names": after.names,
        "accepted_tokens": accepted,
        "draft_tokens": drafts,
        "steps": steps,
        "mean_acceptance_length": (accepted + steps) / steps if steps else None,
        "draft_acceptance_rate": accepted / drafts if drafts else None,
    }


def _delta(before: Optional[float], after: Optional[float]) -> Optional[float]:
    if before is None or after is None:
        return None
    return after - before
