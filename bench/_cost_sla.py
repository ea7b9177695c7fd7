"""Service-level objectives over recorded load points: which points meet them, goodput, and what
a million output tokens cost at the highest offered load that still meets each one.

A point meets an SLA when no request failed and its p99 TPOT and p99 TTFT are within the
bounds. Goodput is the requests per second that met both bounds each (DistServe's per-request
definition, Zhong et al., 2024). The cost at an SLA is the price per hour over the output
tokens per hour of the point that meets it with the most output tokens per second (normally
the highest offered load that meets it; picking by throughput keeps a looser SLA from ever
costing more when two rates measure alike). Points are not interpolated, so the answer is
only as fine as the measured rates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class Sla:
    p99_tpot_ms: float
    p99_ttft_ms: float

    @property
    def name(self) -> str:
        return f"p99 TPOT ≤ {self.p99_tpot_ms:g} ms, p99 TTFT ≤ {self.p99_ttft_ms / 1000:g} s"

    @property
    def short(self) -> str:
        return f"TPOT≤{self.p99_tpot_ms:g}ms"


DEFAULT_SLAS = (Sla(30.0, 1000.0), Sla(60.0, 1000.0))


def parse_sla(text: str) -> Sla:
    """``tpot:30,ttft:1000`` (milliseconds, both bounds required)."""
    bounds = {}
    for part in text.split(","):
        name, sep, value = part.partition(":")
        name = name.strip().lower()
        if not sep or name not in ("tpot", "ttft"):
            raise ValueError(f"bad SLA {text!r}: expected tpot:MS,ttft:MS")
        try:
            bounds[name] = float(value)
        except ValueError:
            raise ValueError(f"bad SLA {text!r}: {value!r} is not a number") from None
        if bounds[name] <= 0:
            raise ValueError(f"bad SLA {text!r}: bounds must be positive")
    if set(bounds) != {"tpot", "ttft"}:
        raise ValueError(f"bad SLA {text!r}: give both tpot and ttft")
    return Sla(bounds["tpot"], bounds["ttft"])


def meets(point, sla: Sla) -> bool:
    """No failed request, and p99 TPOT and p99 TTFT within the SLA's bounds."""
    if point.failed or not point.completed or point.p99_tpot_ms is None or point.p99_ttft_ms is None:
        return False
    return point.p99_tpot_ms <= sla.p99_tpot_ms and point.p99_ttft_ms <= sla.p99_ttft_ms


def goodput(point, sla: Sla) -> Optional[float]:
    """Requests per second that met both bounds, each on its own; None without per-request records.

    A request with a single output token has no TPOT and is judged by its TTFT alone.
    """
    if not point.requests or not point.duration_s:
        return None
    good = sum(1 for ttft_s, tpot_s in point.requests
               if ttft_s is not None and ttft_s * 1000 <= sla.p99_ttft_ms and (tpot_s or 0.0) * 1000 <= sla.p99_tpot_ms)
    return good / point.duration_s


def best_under_sla(points: Sequence, sla: Sla, load_key: Callable) -> Optional[object]:
    """The point meeting the SLA with the most output tokens per second, the higher offered load
    on a tie (None: no point meets it)."""
    passing = [point for point in points if meets(point, sla)]
    return max(passing, key=lambda point: (point.output_throughput, load_key(point))) if passing else None


def series_key(point) -> tuple[str, str]:
    return point.label, point.workload


def group_series(points: Sequence) -> dict[tuple[str, str], list]:
    """(configuration, workload) -> its points."""
    series: dict[tuple[str, str], list] = {}
    for point in points:
        series.setdefault(series_key(point), []).append(point)
    return series


def sla_summary(points: Sequence, slas: Sequence[Sla], price_per_hour: Callable[[str], float],
                load_key: Callable, cost: Callable[[float, float], Optional[float]]) -> list[dict]:
    """Per (configuration, workload) and SLA: the highest load meeting it, its output tokens/s,
    goodput and $ per 1M output tokens; all None where no point meets the SLA."""
    rows = []
    for (label, workload), members in sorted(group_series(points).items()):
        price = price_per_hour(label)
        for sla in slas:
            best = best_under_sla(members, sla, load_key)
            rows.append(dict(
                label=label, workload=workload, sla=sla.name, price_per_hour=price,
                load=best.load if best else None,
                output_throughput=best.output_throughput if best else None,
                goodput=goodput(best, sla) if best else None,
                usd_per_1m_output_tokens=cost(price, best.output_throughput) if best else None,
            ))
    return rows
