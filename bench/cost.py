"""Cost report: dollars per million tokens at each load point of serving-benchmark runs.

Reads result files of ``hetero-bench-serve`` (files, or directories of them), prices each
run's machine by the hour, and computes at every load point

    $ per 1M tokens = price per hour / (tokens per second * 3600) * 1e6

for output tokens and for total (prompt + output) tokens. Runs are grouped by their
``--label`` (plain, lookahead, cpu-draft, gpu-draft, an external endpoint, ...) so the
configurations compare side by side. Writes ``cost_report.md`` (Markdown table, prices,
the commands and machines behind each point), ``cost_summary.csv``,
``throughput_vs_tpot.png`` and ``cost_vs_p99_tpot.png``.

Prices come from flags or a YAML file; a label's own entry beats the flags, which beat
the file's top level::

    gpu_price_per_hour: 4.00      # the GPU(s) the server holds
    cpu_price_per_hour: 0.40      # the CPU cores it holds
    labels:                       # optional: configurations priced differently
      cpu-draft: {cpu_price_per_hour: 0.90}
      other-cloud-vllm: {gpu_price_per_hour: 2.50, cpu_price_per_hour: 0.20}
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import yaml

from bench._report import write_csv_with_context
from bench.serve import RESULT_SCHEMA

PRICE_KEYS = ("gpu_price_per_hour", "cpu_price_per_hour")


class CostInputError(ValueError):
    """A result or price file is missing or malformed; the message names it."""


@dataclass(frozen=True)
class MachinePrice:
    gpu_price_per_hour: float = 0.0
    cpu_price_per_hour: float = 0.0

    @property
    def per_hour(self) -> float:
        return self.gpu_price_per_hour + self.cpu_price_per_hour


def cost_per_million_tokens(price_per_hour: float, tokens_per_second: float) -> Optional[float]:
    """Dollars per 1M tokens at a sustained rate; None when nothing was produced."""
    if tokens_per_second <= 0:
        return None
    return price_per_hour / (tokens_per_second * 3600) * 1e6


def _check_price_table(table: dict, where: str) -> dict:
    unknown = set(table) - set(PRICE_KEYS)
    if unknown:
        raise CostInputError(f"{where}: unknown price key(s) {', '.join(sorted(unknown))}; "
                             f"expected {', '.join(PRICE_KEYS)}")
    for key, value in table.items():
        if not isinstance(value, (int, float)) or value < 0:
            raise CostInputError(f"{where}: {key} must be a non-negative number, got {value!r}")
    return table


def load_price_file(path: Path) -> dict:
    """The YAML price file, validated: top-level prices and an optional ``labels`` table."""
    if not path.is_file():
        raise CostInputError(f"price file not found: {path}")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise CostInputError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(config, dict):
        raise CostInputError(f"{path}: expected a mapping of prices")
    labels = config.pop("labels", {}) or {}
    if not isinstance(labels, dict):
        raise CostInputError(f"{path}: labels must map a label to its prices")
    _check_price_table(config, str(path))
    for label, table in labels.items():
        if not isinstance(table, dict):
            raise CostInputError(f"{path}: labels.{label} must be a mapping of prices")
        _check_price_table(table, f"{path}: labels.{label}")
    return {**config, "labels": labels}


def price_for_label(label: str, price_file: dict, gpu_flag: Optional[float],
                    cpu_flag: Optional[float]) -> MachinePrice:
    """The label's entry in the price file, else the flags, else the file's top level."""
    flags = {key: value for key, value in zip(PRICE_KEYS, (gpu_flag, cpu_flag)) if value is not None}
    top_level = {key: price_file[key] for key in PRICE_KEYS if key in price_file}
    merged = {**top_level, **flags, **price_file.get("labels", {}).get(label, {})}
    if not merged:
        raise CostInputError(f"no price for label {label!r}: give --gpu-price-per-hour/--cpu-price-per-hour, "
                             "or a top-level or labels entry in --prices")
    return MachinePrice(**merged)


@dataclass(frozen=True)
class LoadPoint:
    """One benchmark run: a configuration (label) at one offered load."""

    label: str
    request_rate: float
    max_concurrency: Optional[int]
    completed: int
    failed: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    median_ttft_ms: Optional[float]
    p99_ttft_ms: Optional[float]
    median_tpot_ms: Optional[float]
    p99_tpot_ms: Optional[float]
    p99_e2e_ms: Optional[float]
    goodput: Optional[float]
    mean_acceptance_length: Optional[float]
    source: str
    command: str
    machine: str

    @property
    def load(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        return f"{rate} req/s" + (f", {self.max_concurrency} conc" if self.max_concurrency else "")


def load_point(result: dict, source: str) -> LoadPoint:
    """Pick out what the report needs from one ``hetero-bench-serve`` result."""
    if result.get("schema") != RESULT_SCHEMA:
        raise CostInputError(f"{source}: not a hetero-bench-serve result (schema {result.get('schema')!r})")
    summary, config, machine = result["summary"], result["config"], result.get("machine", {})
    spec = result.get("spec_decode") or {}
    gpus = ", ".join(machine.get("gpus") or []) or "no GPU"
    return LoadPoint(
        label=result["label"],
        request_rate=float(config["request_rate"]),
        max_concurrency=config.get("max_concurrency"),
        completed=summary["completed"],
        failed=summary["failed"],
        request_throughput=summary["request_throughput"],
        output_throughput=summary["output_throughput"],
        total_token_throughput=summary["total_token_throughput"],
        median_ttft_ms=summary["ttft_ms"]["median"],
        p99_ttft_ms=summary["ttft_ms"]["p99"],
        median_tpot_ms=summary["tpot_ms"]["median"],
        p99_tpot_ms=summary["tpot_ms"]["p99"],
        p99_e2e_ms=summary["e2e_ms"]["p99"],
        goodput=summary.get("goodput"),
        mean_acceptance_length=spec.get("mean_acceptance_length"),
        source=source,
        command=result.get("command", ""),
        machine=f"{machine.get('hostname', '?')}: {machine.get('cpu_model', '?')}; {gpus}",
    )


def load_points(paths: Sequence[Path]) -> list[LoadPoint]:
    """Result files given by name, and every result file directly inside given directories
    (other JSON files there are passed over)."""
    points = []
    for path in paths:
        if path.is_dir():
            for candidate in sorted(path.glob("*.json")):
                result = _read_json(candidate)
                if isinstance(result, dict) and result.get("schema") == RESULT_SCHEMA:
                    points.append(load_point(result, str(candidate)))
        elif path.is_file():
            points.append(load_point(_read_json(path), str(path)))
        else:
            raise CostInputError(f"result file not found: {path}")
    if not points:
        raise CostInputError(f"no hetero-bench-serve results in {', '.join(map(str, paths))}")
    return points


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CostInputError(f"{path}: not valid JSON ({exc})") from None


def offered_load_key(point: LoadPoint) -> tuple:
    """Order of increasing load: by request rate (inf last), then concurrency (unbounded last)."""
    return (point.request_rate, point.max_concurrency or math.inf)


def cost_rows(points: Sequence[LoadPoint], price_of: Callable[[str], MachinePrice]) -> list[dict]:
    """One row per load point, grouped by label and ordered by offered load."""
    rows = []
    for point in sorted(points, key=lambda p: (p.label, offered_load_key(p))):
        price = price_of(point.label)
        rows.append({
            **asdict(point),
            "load": point.load,
            "price_per_hour": price.per_hour,
            "usd_per_1m_output_tokens": cost_per_million_tokens(price.per_hour, point.output_throughput),
            "usd_per_1m_total_tokens": cost_per_million_tokens(price.per_hour, point.total_token_throughput),
        })
    return rows


_TABLE_COLUMNS = (
    ("label", "config", None), ("load", "offered load", None),
    ("completed", "ok", None), ("failed", "failed", None),
    ("request_throughput", "req/s", 2), ("output_throughput", "out tok/s", 1),
    ("total_token_throughput", "total tok/s", 1),
    ("median_ttft_ms", "median TTFT ms", 1), ("p99_ttft_ms", "p99 TTFT ms", 1),
    ("median_tpot_ms", "median TPOT ms", 2), ("p99_tpot_ms", "p99 TPOT ms", 2),
    ("goodput", "goodput req/s", 2), ("mean_acceptance_length", "accept len", 2),
    ("price_per_hour", "$/h", 2), ("usd_per_1m_output_tokens", "$/1M out", 3),
    ("usd_per_1m_total_tokens", "$/1M total", 3),
)


def _cell(value, digits: Optional[int]) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if digits is not None else str(value)


def markdown_table(rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in _TABLE_COLUMNS) + " |",
             "|" + "|".join("---" if digits is None else "---:" for _, _, digits in _TABLE_COLUMNS) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[key], digits) for key, _, digits in _TABLE_COLUMNS) + " |")
    return "\n".join(lines)


def markdown_report(rows: Sequence[dict], prices: dict[str, MachinePrice], plots: Sequence[str]) -> str:
    sections = [
        "# Cost per token",
        "$ per 1M tokens = price per hour / (tokens per second × 3600) × 10⁶, at the throughput "
        "each run sustained. Latencies are per request; TPOT excludes the first token.",
        markdown_table(rows),
        "## Prices",
        "\n".join(f"- **{label}**: GPU ${price.gpu_price_per_hour:g}/h + CPU ${price.cpu_price_per_hour:g}/h "
                  f"= ${price.per_hour:g}/h" for label, price in sorted(prices.items())),
    ]
    if plots:
        sections += ["## Plots", "\n".join(f"![{name}]({name})" for name in plots)]
    sections += ["## Runs", "\n".join(
        f"- **{row['label']}** at {row['load']}: `{row['command']}` on {row['machine']} ({row['source']})"
        for row in rows)]
    return "\n\n".join(sections) + "\n"


def _series(rows: Sequence[dict], x_key: str, y_key: str) -> dict[str, tuple[list, list, list]]:
    """Per label, the points that have both values, in row (offered-load) order."""
    series: dict[str, tuple[list, list, list]] = {}
    for row in rows:
        if row[x_key] is None or row[y_key] is None:
            continue
        xs, ys, loads = series.setdefault(row["label"], ([], [], []))
        xs.append(row[x_key])
        ys.append(row[y_key])
        loads.append(row["load"])
    return series


def _draw(axes, series: dict, annotate: bool) -> None:
    for label, (xs, ys, loads) in series.items():
        axes.plot(xs, ys, marker="o", label=label)
        if annotate:
            for x, y, load in zip(xs, ys, loads):
                axes.annotate(load, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    axes.grid(True, alpha=0.3)
    if series:
        axes.legend()


def plot_throughput_vs_tpot(rows: Sequence[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    for ax, key, title in ((axes[0], "median_tpot_ms", "median"), (axes[1], "p99_tpot_ms", "p99")):
        _draw(ax, _series(rows, key, "output_throughput"), annotate=True)
        ax.set_xlabel(f"{title} TPOT (ms)")
        ax.set_title(f"Output throughput vs {title} TPOT")
    axes[0].set_ylabel("output tokens / s")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_cost_vs_tpot(rows: Sequence[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(7, 5))
    _draw(ax, _series(rows, "p99_tpot_ms", "usd_per_1m_output_tokens"), annotate=True)
    ax.set_xlabel("p99 TPOT (ms)")
    ax.set_ylabel("$ per 1M output tokens")
    ax.set_title("Cost vs latency (lower left is better)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hetero-bench-cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="result JSON files or directories of them")
    parser.add_argument("--gpu-price-per-hour", type=float, help="$ per hour for the GPU(s)")
    parser.add_argument("--cpu-price-per-hour", type=float, help="$ per hour for the CPU cores")
    parser.add_argument("--prices", type=Path, help="YAML prices, optionally per label (see the module doc)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"), help="where the report goes")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    args = parser.parse_args(argv)
    for name in ("gpu_price_per_hour", "cpu_price_per_hour"):
        value = getattr(args, name)
        if value is not None and value < 0:
            parser.error(f"--{name.replace('_', '-')} must be zero or more")
    if args.gpu_price_per_hour is None and args.cpu_price_per_hour is None and args.prices is None:
        parser.error("give the machine's price: --gpu-price-per-hour and/or --cpu-price-per-hour, or --prices FILE")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        price_file = load_price_file(args.prices) if args.prices else {}
        points = load_points(args.results)
        prices = {point.label: price_for_label(point.label, price_file, args.gpu_price_per_hour,
                                               args.cpu_price_per_hour) for point in points}
    except CostInputError as exc:
        print(f"hetero-bench-cost: error: {exc}", file=sys.stderr)
        return 2
    rows = cost_rows(points, prices.__getitem__)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    if not args.no_plots:
        plot_throughput_vs_tpot(rows, args.out_dir / "throughput_vs_tpot.png")
        plot_cost_vs_tpot(rows, args.out_dir / "cost_vs_p99_tpot.png")
        plots = ["throughput_vs_tpot.png", "cost_vs_p99_tpot.png"]
    (args.out_dir / "cost_report.md").write_text(markdown_report(rows, prices, plots))
    write_csv_with_context(args.out_dir / "cost_summary.csv", rows, {})
    print(markdown_table(rows))
    print(f"report: {args.out_dir / 'cost_report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
