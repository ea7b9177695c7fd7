"""The cost report's plots: output throughput against p99 TPOT per configuration, and $ per 1M
output tokens against the SLA, one panel per workload.

matplotlib is imported here only, when a report is drawn, so nothing else needs it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

NO_WORKLOAD = "any"  # configurations drawn in every workload's panel


def _panels(items: Sequence[dict]) -> list[str]:
    named = sorted({item["workload"] for item in items if item["workload"] not in (NO_WORKLOAD, "")})
    return named or ["all"]


def _in_panel(item: dict, panel: str) -> bool:
    return item["workload"] == panel or item["workload"] in (NO_WORKLOAD, "")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput_vs_tpot(rows: Sequence[dict], slas, path: Path, colors: dict[str, str]) -> None:
    """Per workload: each configuration's load points, p99 TPOT against output tokens/s, in
    order of offered load; the SLAs' TPOT bounds as vertical lines."""
    plt = _pyplot()
    panels = _panels(rows)
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5), sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        series: dict[str, tuple[list, list]] = {}
        for row in rows:
            if _in_panel(row, panel) and row["p99_tpot_ms"] is not None:
                xs, ys = series.setdefault(row["label"], ([], []))
                xs.append(row["p99_tpot_ms"])
                ys.append(row["output_throughput"])
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label, color=colors[label])
        for sla in slas:
            ax.axvline(sla.p99_tpot_ms, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("p99 TPOT (ms, log)")
        ax.set_title(f"workload: {panel}")
        ax.grid(True, alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("output tokens / s")
    figure.suptitle("Throughput vs p99 TPOT, request rate rising along each line (dotted: SLA bounds)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_cost_vs_sla(summary: Sequence[dict], slas, path: Path, colors: dict[str, str]) -> None:
    """Per workload: $ per 1M output tokens at each SLA (tightest TPOT bound first); a configuration
    that never meets an SLA has no point there."""
    plt = _pyplot()
    panels = _panels(summary)
    order = [sla.name for sla in sorted(slas, key=lambda s: (s.p99_tpot_ms, s.p99_ttft_ms))]
    ticks = [sla.short for sla in sorted(slas, key=lambda s: (s.p99_tpot_ms, s.p99_ttft_ms))]
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5), sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        series: dict[str, tuple[list, list]] = {}
        for row in summary:
            if _in_panel(row, panel) and row["usd_per_1m_output_tokens"] is not None:
                xs, ys = series.setdefault(row["label"], ([], []))
                xs.append(order.index(row["sla"]))
                ys.append(row["usd_per_1m_output_tokens"])
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label, color=colors[label])
        ax.set_xticks(range(len(ticks)), ticks)
        ax.set_xlabel("SLA (p99 TPOT bound; p99 TTFT bound as stated in the report)")
        ax.set_title(f"workload: {panel}")
        ax.grid(True, alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("$ per 1M output tokens")
    figure.suptitle("Cost at the measured point of most throughput meeting each SLA (lower is better)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_plots(rows: Sequence[dict], summary: Sequence[dict], slas, out_dir: Path) -> list[str]:
    """Both PNGs into `out_dir`; their file names."""
    names = ["throughput_vs_p99_tpot.png", "cost_vs_sla.png"]
    labels = list(dict.fromkeys(row["label"] for row in rows))  # the report's order: one colour per configuration
    colors = {label: f"C{index % 10}" for index, label in enumerate(labels)}
    plot_throughput_vs_tpot(rows, slas, out_dir / names[0], colors)
    plot_cost_vs_sla(summary, slas, out_dir / names[1], colors)
    return names
