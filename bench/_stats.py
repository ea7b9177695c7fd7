"""Pure maths of the serving benchmark: per-request records, percentiles, goodput, arrivals.

Nothing here does I/O, so tests can check every number by hand. Times inside a
``RequestRecord`` are seconds; the summary reports latencies in milliseconds, as
serving benchmarks conventionally do.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass
class RequestRecord:
    """What one streamed request measured.

    ``ttft`` is from sending the request to the first chunk carrying text; ``itl`` holds
    the gaps between successive text-carrying chunks (a speculative server may put several
    tokens in one chunk, so there can be fewer gaps than tokens); ``e2e`` runs to the end
    of the stream.
    """

    success: bool
    output_tokens: int = 0
    prompt_tokens: int = 0
    ttft: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    start: float = 0.0  # seconds after the measured run began
    usage_reported: bool = False  # token counts came from the server's usage block
    error: str = ""

    @property
    def tpot(self) -> Optional[float]:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1).

        ``None`` for failed requests and for outputs of fewer than two tokens, which
        have no decode phase to time.
        """
        if not self.success or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "tpot": self.tpot}


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100) with linear interpolation between order statistics.

    Same definition as ``numpy.percentile``'s default, written out so it can be checked
    by hand: position ``(n - 1) * q / 100`` in the sorted values.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    lower = math.floor(position)
    upper = math.ceil(position)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def latency_stats_ms(values_s: Sequence[float]) -> dict:
    """Mean, median and p99 in milliseconds of latencies given in seconds (None if empty)."""
    if not values_s:
        return {"mean": None, "median": None, "p99": None}
    return {
        "mean": 1000 * sum(values_s) / len(values_s),
        "median": 1000 * percentile(values_s, 50),
        "p99": 1000 * percentile(values_s, 99),
    }


def parse_slos(specs: Sequence[str]) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` into ``{"ttft": 500.0, "tpot": 50.0}`` (ms)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"--goodput: bad SLO {spec!r}; expected NAME:MILLISECONDS with NAME one of "
                f"{', '.join(SLO_METRICS)}"
            )
        try:
            bound = float(value)
        except ValueError:
            raise ValueError(f"--goodput: SLO {spec!r} has a non-numeric bound {value!r}") from None
        if bound <= 0:
            raise ValueError(f"--goodput: SLO {spec!r} must be positive")
        slos[name] = bound
    return slos


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request is within every SLO.

    A request with fewer than two output tokens has no time per output token and counts
    as meeting a TPOT bound.
    """
    if not record.success:
        return False
    measured_s = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2e": record.e2e}
    return all(measured_s[name] * 1000 <= bound for name, bound in slos_ms.items())


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slos_ms: Optional[dict[str, float]] = None) -> dict:
    """Aggregate the measured run: throughputs over ``duration_s``, latency statistics
    over successful requests, goodput (requests per second within every SLO) and the
    failures grouped by error message."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(Counter(r.error for r in failed).most_common()),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "token_counts_from_usage": all(r.usage_reported for r in ok),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": latency_stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": latency_stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": latency_stats_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": latency_stats_ms([r.e2e for r in ok]),
        "slos_ms": dict(slos_ms or {}),
        "goodput": None,
    }
    if slos_ms:
        summary["goodput"] = sum(meets_slos(r, slos_ms) for r in ok) / duration_s
    return summary


def arrival_offsets(num_requests: int, request_rate: float, rng: random.Random) -> list[float]:
    """Send times (seconds after the start) of a Poisson process at ``request_rate``.

    The first request goes at 0; gaps are exponential with mean ``1 / request_rate``.
    An infinite rate sends everything at once.
    """
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    offsets, now = [], 0.0
    for index in range(num_requests):
        if index:
            now += rng.expovariate(request_rate)
        offsets.append(now)
    return offsets
