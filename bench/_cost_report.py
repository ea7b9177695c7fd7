"""The cost report in Markdown: $ per 1M output tokens per configuration and workload at each SLA
(the headline), what-if prices, the published figures quoted (not measured here), every load
point, and the runs behind them. `bench.cost` loads and prices the results; this only writes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from bench._cost_sla import Sla
from bench.cost import (HF_LABEL, NO_WORKLOAD, MachinePrice, PriceScenario, config_order,
                        cost_per_million_tokens)

_TABLE_COLUMNS = (
    ("label", "config", None), ("workload", "workload", None), ("load", "offered load", None),
    ("completed", "ok", None), ("failed", "failed", None),
    ("request_throughput", "req/s", 2), ("output_throughput", "out tok/s", 1),
    ("median_ttft_ms", "median TTFT ms", 1), ("p99_ttft_ms", "p99 TTFT ms", 1),
    ("median_tpot_ms", "median TPOT ms", 2), ("p99_tpot_ms", "p99 TPOT ms", 2),
    ("mean_acceptance_length", "accept len", 2), ("trace_acceptance_length", "trace's accept len", 2),
    ("price_per_hour", "$/h", 2), ("usd_per_1m_output_tokens", "$/1M out", 3),
    ("usd_per_1m_total_tokens", "$/1M total", 3),
)


def _cell(value, digits: Optional[int]) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.{digits}f}" if digits is not None else (str(value) or "-")


def _table(columns: Sequence[tuple], rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |",
             "|" + "|".join("---" if digits is None else "---:" for _, _, digits in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(key), digits) for key, _, digits in columns) + " |")
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict], slas: Sequence[Sla] = ()) -> str:
    """Every load point; with `slas`, goodput (req/s) at each, marked * where the point meets it."""
    columns = list(_TABLE_COLUMNS)
    shown = []
    for row in rows:
        shown.append(dict(row))
        for sla in slas:
            value = row.get(f"goodput {sla.short}")
            shown[-1][f"goodput {sla.short}"] = (None if value is None else
                                                 f"{value:.2f}" + (" *" if row[f"meets {sla.short}"] else ""))
    columns[-3:-3] = [(f"goodput {sla.short}", f"goodput req/s {sla.short}", None) for sla in slas]
    return _table(columns, shown)


def _workload_columns(summary: Sequence[dict]) -> list[str]:
    named = sorted({row["workload"] for row in summary if row["workload"] not in (NO_WORKLOAD, "")})
    return named or ["all"]


def _cost_cell(row: Optional[dict]) -> str:
    if row is None:
        return "not run"
    if row["usd_per_1m_output_tokens"] is None:
        return "never met"
    return f"${row['usd_per_1m_output_tokens']:.3f} ({row['load']})"


def headline_tables(summary: Sequence[dict], slas: Sequence[Sla]) -> str:
    """Per SLA: $ per 1M output tokens of each configuration on each workload, at its point of
    most throughput meeting it; configurations whose speed does not depend on the workload (plain,
    HF generate) fill every column. Then, per workload, the cheapest and what it saves."""
    workloads = _workload_columns(summary)
    labels = sorted({row["label"] for row in summary}, key=config_order)
    sections = []
    for sla in slas:
        cell = {}
        for row in summary:
            if row["sla"] != sla.name:
                continue
            targets = workloads if row["workload"] in (NO_WORKLOAD, "") else [row["workload"]]
            for workload in targets:
                cell[row["label"], workload] = row
        lines = [f"### {sla.name}", "",
                 "| config | " + " | ".join(workloads) + " |", "|---|" + "---:|" * len(workloads)]
        for label in labels:
            lines.append(f"| {label} | " + " | ".join(_cost_cell(cell.get((label, w))) for w in workloads) + " |")
        notes = []
        for workload in workloads:
            priced = [(row["usd_per_1m_output_tokens"], label) for (label, w), row in cell.items()
                      if w == workload and row["usd_per_1m_output_tokens"] is not None]
            if not priced:
                notes.append(f"- {workload}: no configuration meets it")
                continue
            best, best_label = min(priced)
            comparisons = []
            for other in ("plain", HF_LABEL):
                row = cell.get((other, workload))
                if other != best_label and row is not None:
                    comparisons.append(f"{1 - best / row['usd_per_1m_output_tokens']:.0%} less than {other}"
                                       if row["usd_per_1m_output_tokens"] else f"{other} never meets it")
            notes.append(f"- {workload}: cheapest is **{best_label}** at ${best:.3f}"
                         + (f" ({'; '.join(comparisons)})" if comparisons else ""))
        sections.append("\n".join(lines + [""] + notes))
    return "\n\n".join(sections)


def what_if_table(summary: Sequence[dict], sla: Sla, scenarios: Sequence[PriceScenario]) -> str:
    """$ per 1M output tokens at `sla` under other prices: the measured throughput is the same,
    only the price per hour changes (cost scales with it)."""
    columns = [("label", "config", None), ("workload", "workload", None)]
    rows = []
    for row in summary:
        if row["sla"] != sla.name:
            continue
        shown = {"label": row["label"], "workload": row["workload"]}
        for scenario in scenarios:
            shown[scenario.name] = (None if row["output_throughput"] is None else
                                    cost_per_million_tokens(scenario.price(row["label"]), row["output_throughput"]))
        rows.append(shown)
    rows.sort(key=lambda r: (config_order(r["label"]), r["workload"]))
    columns += [(scenario.name, scenario.name, 3) for scenario in scenarios]
    return _table(columns, rows).replace("| n/a ", "| never met ")


def anchors_table(anchors: Sequence[dict]) -> str:
    lines = ["| who | published claim | setting | source |", "|---|---|---|---|"]
    lines += [f"| {a['who']} | {a['claim']} | {a['setting']} | [{a['source']}]({a['url']}) |" for a in anchors]
    return "\n".join(lines)


def run_settings(paths: Sequence[Path]) -> list[str]:
    """What `bench.serve_reference` recorded in its run-*.json beside its results (settings, start-up, gaps)."""
    notes = []
    for manifest in sorted(m for path in paths if path.is_dir() for m in path.glob("run-*.json")):
        run = json.loads(manifest.read_text())
        settings = run.get("settings", {})
        notes.append(f"- `{run.get('command', '')}` ({run.get('total_s', '?')} s): "
                     + ", ".join(f"{key}={value}" for key, value in settings.items()))
        if run.get("skipped"):
            notes.append(f"  - left out by its time budget: {', '.join(run['skipped'])}")
        for name, error in (run.get("errors") or {}).items():
            notes.append(f"  - **{name} failed**: {error}")
        if run.get("startup_s"):
            notes.append("  - engine start-up (s): " + ", ".join(f"{k} {v}" for k, v in run["startup_s"].items()))
    return notes


def markdown_report(rows: Sequence[dict], prices: dict[str, MachinePrice], plots: Sequence[str],
                    slas: Sequence[Sla] = (), summary: Sequence[dict] = (), what_if: str = "",
                    anchors: Sequence[dict] = (), runs: Sequence[str] = ()) -> str:
    sections = [
        "# Cost per token",
        "$ per 1M tokens = price per hour / (tokens per second × 3600) × 10⁶, at the throughput each run "
        "sustained. Latencies are per request; TPOT excludes the first token. A load point meets an SLA when "
        "no request failed and its p99 TPOT and p99 TTFT are within the bounds; the cost at an SLA is that of "
        "the measured point meeting it with the most output tokens per second, normally the highest offered "
        "load that meets it (measured points only, no interpolation). Goodput: "
        "requests per second that met both bounds each. `any`: a configuration whose speed does not depend "
        "on the workload's acceptance. `accept len`: tokens per speculative step measured (bonus included); "
        "`trace's accept len`: what the workload's real-text trace promises at the run's tree depth.",
    ]
    if slas and summary:
        sections += ["## $ per 1M output tokens at each SLA", headline_tables(summary, slas)]
    sections += [
        "## Prices",
        "Each configuration is priced at the machine it runs on, by the hour. Unless a label is priced on its "
        "own, the host's CPU is counted once, for the host that comes with the GPU: the CPU draft uses cores "
        "a GPU server already has. The what-if table charges them again.",
        "\n".join(f"- **{label}**: GPU ${price.gpu_price_per_hour:g}/h + CPU ${price.cpu_price_per_hour:g}/h "
                  f"= ${price.per_hour:g}/h" for label, price in sorted(prices.items(), key=lambda kv: config_order(kv[0]))),
    ]
    if what_if:
        sections += [f"## What if prices differ ({slas[0].name})",
                     "The same measured points at other machine prices: every configuration at the column's "
                     "price (per-label prices of `--prices` do not apply here), the CPU draft charged for its "
                     "cores where the column says so.", what_if]
    if anchors:
        sections += ["## Published figures (not measured here)",
                     "Claims as their authors published them, on their models, hardware and workloads; none was "
                     "measured by this project and none is comparable cell by cell with the tables above.",
                     anchors_table(anchors)]
    if plots:
        sections += ["## Plots", "\n".join(f"![{name}]({name})" for name in plots)]
    sections += ["## Every load point", markdown_table(rows, slas)]
    if runs:
        sections += ["## Run settings", "\n".join(runs)]
    commands = sorted({row["command"] for row in rows})
    machines = sorted({row["machine"] for row in rows})
    sections += ["## Commands and machines",
                 "\n".join(f"- `{command}`" for command in commands) + "\n\n" + "\n".join(f"- {m}" for m in machines)]
    return "\n\n".join(sections) + "\n"
