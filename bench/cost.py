"""Cost report: dollars per million tokens at each load point of serving-benchmark runs, and at
the latency SLAs a buyer sets.

Reads result files of ``hetero-bench-serve`` or ``bench.serve_reference`` (files, or
directories of them), prices each run's machine by the hour, and computes at every load point

    $ per 1M tokens = price per hour / (tokens per second * 3600) * 1e6

for output tokens and for total (prompt + output) tokens. Points are grouped by their label
(plain, lookahead, cpu-draft, gpu-draft, hf-generate, an external endpoint, ...) and
workload. For each SLA (``--sla tpot:MS,ttft:MS`` on p99s; `bench._cost_sla`) it finds each
group's best point meeting it, its goodput, and its $ per 1M output tokens, with a what-if
table at other prices and the published figures of ``--anchors`` quoted beside them (not
measured here). Writes ``cost_report.md`` (`bench._cost_report`), ``cost_summary.csv``
(every point), ``cost_at_sla.csv`` and two PNGs (`bench._cost_plots`).

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import yaml

from bench._cost_sla import DEFAULT_SLAS, Sla, goodput, meets, parse_sla, sla_summary
from bench._report import write_csv_with_context
from bench.serve import RESULT_SCHEMA

PRICE_KEYS = ("gpu_price_per_hour", "cpu_price_per_hour")
HF_LABEL = "hf-generate"  # bench.serve_reference's HF transformers `generate` baseline
NO_WORKLOAD = "any"  # a configuration whose speed does not depend on the workload's acceptance
CPU_DRAFT_LABELS = ("cpu-draft",)  # configurations that draft on the host's cores (what-if: charged again)
ANCHORS_PATH = Path(__file__).parent / "data" / "published_anchors.yaml"


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
    workload: str  # the acceptance trace it ran under; "any" where speed does not depend on it, "" if unknown
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
    trace_acceptance_length: Optional[float]  # what the replayed real-text trace promises (bench.serve_reference)
    source: str
    command: str
    machine: str
    duration_s: Optional[float] = None
    # (TTFT, TPOT) in seconds of every successful request, for goodput; empty if not recorded
    requests: tuple = field(default=(), repr=False)

    @property
    def load(self) -> str:
        if self.label == HF_LABEL and self.max_concurrency:
            return f"static batch {self.max_concurrency}"
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        return f"{rate} req/s" + (f", {self.max_concurrency} conc" if self.max_concurrency else "")


def load_point(result: dict, source: str) -> LoadPoint:
    """Pick out what the report needs from one ``hetero-bench-serve`` result."""
    if result.get("schema") != RESULT_SCHEMA:
        raise CostInputError(f"{source}: not a hetero-bench-serve result (schema {result.get('schema')!r})")
    summary, config, machine = result["summary"], result["config"], result.get("machine", {})
    spec = result.get("spec_decode") or {}
    gpus = ", ".join(machine.get("gpus") or []) or "no GPU"
    requests = tuple((r.get("ttft"), r.get("tpot")) for r in result.get("requests") or () if r.get("success"))
    return LoadPoint(
        label=result["label"],
        workload=result.get("workload") or "",
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
        trace_acceptance_length=spec.get("trace_acceptance_length"),
        source=source,
        command=result.get("command", ""),
        machine=f"{machine.get('hostname', '?')}: {machine.get('cpu_model', '?')}; {gpus}",
        duration_s=summary.get("duration_s"),
        requests=requests,
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


def cost_rows(points: Sequence[LoadPoint], price_of: Callable[[str], MachinePrice],
              slas: Sequence[Sla] = ()) -> list[dict]:
    """One row per load point, grouped by label and workload and ordered by offered load; with
    `slas`, each row also says whether the point meets each SLA and its goodput there."""
    rows = []
    for point in sorted(points, key=lambda p: (config_order(p.label), p.workload, offered_load_key(p))):
        price = price_of(point.label)
        row = {key: value for key, value in asdict(point).items() if key != "requests"}
        row.update({
            "load": point.load,
            "price_per_hour": price.per_hour,
            "usd_per_1m_output_tokens": cost_per_million_tokens(price.per_hour, point.output_throughput),
            "usd_per_1m_total_tokens": cost_per_million_tokens(price.per_hour, point.total_token_throughput),
        })
        for sla in slas:
            row[f"meets {sla.short}"] = meets(point, sla)
            row[f"goodput {sla.short}"] = goodput(point, sla)
        rows.append(row)
    return rows


def config_order(label: str) -> tuple:
    """Plain decoding first, HF generate (the baseline without an engine) last, the rest by name."""
    base = label.partition("+")[0]
    return (0 if base == "plain" else 2 if label == HF_LABEL else 1, label)


@dataclass(frozen=True)
class PriceScenario:
    """A what-if price: GPU and host CPU by the hour, plus what configurations that draft on the
    CPU pay for their cores again (0: the cores come with the GPU host, counted once)."""

    gpu_price_per_hour: float
    cpu_price_per_hour: float
    cpu_draft_extra_per_hour: float = 0.0

    @property
    def name(self) -> str:
        extra = f" + CPU draft ${self.cpu_draft_extra_per_hour:g}/h" if self.cpu_draft_extra_per_hour else ""
        return f"GPU ${self.gpu_price_per_hour:g}/h, CPU ${self.cpu_price_per_hour:g}/h{extra}"

    def price(self, label: str) -> float:
        extra = self.cpu_draft_extra_per_hour if label.partition("+")[0] in CPU_DRAFT_LABELS else 0.0
        return self.gpu_price_per_hour + self.cpu_price_per_hour + extra


def price_scenarios(base: MachinePrice, gpu_prices: Sequence[float], cpu_draft_extras: Sequence[float]) -> list[PriceScenario]:
    scenarios = [PriceScenario(base.gpu_price_per_hour, base.cpu_price_per_hour)]
    scenarios += [PriceScenario(gpu, base.cpu_price_per_hour) for gpu in gpu_prices if gpu != base.gpu_price_per_hour]
    scenarios += [PriceScenario(base.gpu_price_per_hour, base.cpu_price_per_hour, extra) for extra in cpu_draft_extras if extra]
    return scenarios


def load_anchors(path: Path) -> list[dict]:
    """Published figures (bench/data/published_anchors.yaml): each with its source and URL."""
    if not path.is_file():
        raise CostInputError(f"anchors file not found: {path}")
    anchors = yaml.safe_load(path.read_text()) or []
    for index, anchor in enumerate(anchors):
        missing = {"who", "claim", "setting", "source", "url"} - set(anchor)
        if missing:
            raise CostInputError(f"{path}: entry {index} lacks {', '.join(sorted(missing))}")
    return anchors


def _floats(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"prices must be zero or more, got {text!r}")
    return values


def _sla(text: str) -> Sla:
    try:
        return parse_sla(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hetero-bench-cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="result JSON files or directories of them")
    parser.add_argument("--gpu-price-per-hour", type=float, help="$ per hour for the GPU(s)")
    parser.add_argument("--cpu-price-per-hour", type=float, help="$ per hour for the host's CPU cores")
    parser.add_argument("--prices", type=Path, help="YAML prices, optionally per label (see the module doc)")
    parser.add_argument("--sla", type=_sla, action="append", metavar="tpot:MS,ttft:MS",
                        help="an SLA on p99 TPOT and p99 TTFT (repeatable; default: "
                             + "; ".join(f"tpot:{s.p99_tpot_ms:g},ttft:{s.p99_ttft_ms:g}" for s in DEFAULT_SLAS) + ")")
    parser.add_argument("--what-if-gpu-prices", type=_floats, default=[2.0, 4.0],
                        help="other GPU $/h for the what-if table")
    parser.add_argument("--what-if-cpu-draft-extra", type=_floats, default=[0.5],
                        help="$/h charged again to CPU-draft configurations for their cores, in the what-if table")
    parser.add_argument("--anchors", type=Path, default=ANCHORS_PATH, help="published figures to quote ('' for none)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"), help="where the report goes")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    args = parser.parse_args(argv)
    for name in ("gpu_price_per_hour", "cpu_price_per_hour"):
        value = getattr(args, name)
        if value is not None and value < 0:
            parser.error(f"--{name.replace('_', '-')} must be zero or more")
    if args.gpu_price_per_hour is None and args.cpu_price_per_hour is None and args.prices is None:
        parser.error("give the machine's price: --gpu-price-per-hour and/or --cpu-price-per-hour, or --prices FILE")
    args.sla = args.sla or list(DEFAULT_SLAS)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        price_file = load_price_file(args.prices) if args.prices else {}
        points = load_points(args.results)
        prices = {point.label: price_for_label(point.label, price_file, args.gpu_price_per_hour,
                                               args.cpu_price_per_hour) for point in points}
        anchors = load_anchors(args.anchors) if str(args.anchors) not in ("", ".") else []
    except CostInputError as exc:
        print(f"hetero-bench-cost: error: {exc}", file=sys.stderr)
        return 2
    from bench import _cost_report

    rows = cost_rows(points, prices.__getitem__, args.sla)
    summary = sla_summary(points, args.sla, lambda label: prices[label].per_hour, offered_load_key,
                          cost_per_million_tokens)
    try:
        base = price_for_label("", price_file, args.gpu_price_per_hour, args.cpu_price_per_hour)
    except CostInputError:  # prices per label only: no common machine price to vary
        base = None
    what_if = "" if base is None else _cost_report.what_if_table(
        summary, args.sla[0], price_scenarios(base, args.what_if_gpu_prices, args.what_if_cpu_draft_extra))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    if not args.no_plots:
        from bench import _cost_plots

        try:
            plots = _cost_plots.write_plots(rows, summary, args.sla, args.out_dir)
        except ModuleNotFoundError as exc:
            if exc.name != "matplotlib":
                raise
            print("hetero-bench-cost: error: the plots need matplotlib (pip install 'hetero[bench]'); "
                  "or pass --no-plots", file=sys.stderr)
            return 2
    report = _cost_report.markdown_report(rows, prices, plots, args.sla, summary, what_if, anchors,
                                          _cost_report.run_settings(args.results))
    (args.out_dir / "cost_report.md").write_text(report)
    write_csv_with_context(args.out_dir / "cost_summary.csv", rows, {})
    write_csv_with_context(args.out_dir / "cost_at_sla.csv", summary, {})
    print(_cost_report.headline_tables(summary, args.sla))
    print(f"report: {args.out_dir / 'cost_report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
