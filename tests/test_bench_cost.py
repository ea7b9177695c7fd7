"""The cost report: $/1M tokens on hand-checked numbers, price precedence, and a whole
report (Markdown, CSV, PNGs) from hand-made result files of two configurations."""
from __future__ import annotations

import csv
import json

import pytest

from bench import cost
from bench.cost import (CostInputError, MachinePrice, cost_per_million_tokens, cost_rows,
                        load_point, load_price_file, price_for_label)
from bench.serve import RESULT_SCHEMA


def result(label: str, rate, output_tps: float, total_tps: float, p99_tpot: float,
           acceptance=None, concurrency=None) -> dict:
    stats = lambda median, p99: {"mean": median, "median": median, "p99": p99}  # noqa: E731
    return {
        "schema": RESULT_SCHEMA, "label": label, "timestamp": "2026-01-01T00:00:00+00:00",
        "command": f"hetero-bench-serve --label {label} --request-rate {rate}",
        "machine": {"hostname": "box", "cpu_model": "Xeon 8480+", "gpus": ["NVIDIA H100, 81559 MiB"]},
        "config": {"request_rate": rate, "max_concurrency": concurrency, "endpoint": "completions"},
        "summary": {"completed": 10, "failed": 0, "request_throughput": output_tps / 100,
                    "output_throughput": output_tps, "total_token_throughput": total_tps,
                    "ttft_ms": stats(50.0, 90.0), "tpot_ms": stats(p99_tpot / 2, p99_tpot),
                    "e2e_ms": stats(900.0, 1500.0), "goodput": None},
        "spec_decode": {"mean_acceptance_length": acceptance} if acceptance else None,
        "requests": [],
    }


def test_cost_per_million_tokens_by_hand():
    # $3.60/h at 1000 tok/s: 3.6e6 tokens an hour cost $3.60, so 1M cost $1.00.
    assert cost_per_million_tokens(3.6, 1000) == pytest.approx(1.0)
    # $2/h at 250 tok/s = 900k tokens/h: 2 / 0.9 = $2.222... per 1M.
    assert cost_per_million_tokens(2.0, 250) == pytest.approx(2 / 0.9)
    assert cost_per_million_tokens(5.0, 0) is None
    assert MachinePrice(3.0, 0.6).per_hour == pytest.approx(3.6)


def test_price_precedence_label_then_flags_then_file(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("gpu_price_per_hour: 4\ncpu_price_per_hour: 0.5\n"
                    "labels:\n  cpu-draft: {cpu_price_per_hour: 1.5}\n")
    prices = load_price_file(path)
    assert price_for_label("plain", prices, None, None) == MachinePrice(4, 0.5)
    assert price_for_label("plain", prices, 3.0, None) == MachinePrice(3.0, 0.5)
    assert price_for_label("cpu-draft", prices, 3.0, 0.2) == MachinePrice(3.0, 1.5)
    assert price_for_label("x", {}, None, 0.25) == MachinePrice(0.0, 0.25)
    with pytest.raises(CostInputError, match="no price for label 'x'"):
        price_for_label("x", {}, None, None)


def test_bad_price_files_are_named(tmp_path):
    with pytest.raises(CostInputError, match="price file not found: .*absent.yaml"):
        load_price_file(tmp_path / "absent.yaml")
    path = tmp_path / "prices.yaml"
    path.write_text("gpu_price: 4\n")
    with pytest.raises(CostInputError, match="unknown price key.*gpu_price"):
        load_price_file(path)
    path.write_text("labels:\n  plain: {gpu_price_per_hour: -1}\n")
    with pytest.raises(CostInputError, match="labels.plain: gpu_price_per_hour must be a non-negative"):
        load_price_file(path)


def test_cost_rows_group_by_label_in_order_of_load():
    points = [load_point(result("plain", 4.0, 500, 1500, 30), "a"),
              load_point(result("lookahead", "inf", 2000, 4000, 25, acceptance=2.5), "b"),
              load_point(result("plain", 1.0, 200, 600, 20), "c"),
              load_point(result("lookahead", 2.0, 1000, 2000, 15, acceptance=2.7), "d")]
    rows = cost_rows(points, lambda label: MachinePrice(3.0, 0.6))
    assert [(r["label"], r["load"]) for r in rows] == [
        ("lookahead", "2 req/s"), ("lookahead", "inf req/s"), ("plain", "1 req/s"), ("plain", "4 req/s")]
    by_source = {r["source"]: r for r in rows}
    assert by_source["b"]["usd_per_1m_output_tokens"] == pytest.approx(0.5)  # 3.6 / (2000 * 3600) * 1e6
    assert by_source["b"]["usd_per_1m_total_tokens"] == pytest.approx(0.25)
    assert by_source["c"]["usd_per_1m_output_tokens"] == pytest.approx(5.0)
    assert by_source["b"]["mean_acceptance_length"] == 2.5 and by_source["c"]["mean_acceptance_length"] is None


def test_load_point_rejects_foreign_json():
    with pytest.raises(CostInputError, match="not a hetero-bench-serve result"):
        load_point({"some": "json"}, "other.json")


def test_report_from_result_files(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    for name, payload in {
        "plain-1.json": result("plain", 1.0, 200, 600, 20),
        "plain-4.json": result("plain", 4.0, 500, 1500, 30),
        "cpu-draft-1.json": result("cpu-draft", 1.0, 450, 850, 12, acceptance=2.4, concurrency=8),
        "cpu-draft-4.json": result("cpu-draft", 4.0, 1200, 2200, 18, acceptance=2.2, concurrency=8),
    }.items():
        (results / name).write_text(json.dumps(payload))
    (results / "unrelated.json").write_text('{"not": "a result"}')
    prices = tmp_path / "prices.yaml"
    prices.write_text("labels:\n  cpu-draft: {cpu_price_per_hour: 1.2}\n")
    out = tmp_path / "report"
    code = cost.main([str(results), "--gpu-price-per-hour", "2.4", "--cpu-price-per-hour", "0",
                      "--prices", str(prices), "--out-dir", str(out)])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "| cpu-draft | 1 req/s, 8 conc |" in stdout

    with (out / "cost_summary.csv").open() as handle:
        rows = {(r["label"], r["request_rate"]): r for r in csv.DictReader(handle)}
    assert len(rows) == 4
    # plain: $2.40/h at 200 tok/s -> 2.4 / 720000 * 1e6 = $3.333 per 1M output tokens
    assert float(rows["plain", "1.0"]["usd_per_1m_output_tokens"]) == pytest.approx(2.4 / 0.72)
    # cpu-draft: $3.60/h at 1200 tok/s -> $0.8333; total 2200 tok/s -> $0.4545
    assert float(rows["cpu-draft", "4.0"]["usd_per_1m_output_tokens"]) == pytest.approx(3.6 / 4.32)
    assert float(rows["cpu-draft", "4.0"]["usd_per_1m_total_tokens"]) == pytest.approx(3.6 / 7.92)

    report = (out / "cost_report.md").read_text()
    assert "| plain | 1 req/s | 10 | 0 |" in report and "3.333 |" in report
    assert "**cpu-draft**: GPU $2.4/h + CPU $1.2/h = $3.6/h" in report
    assert "`hetero-bench-serve --label plain --request-rate 4.0`" in report
    assert "Xeon 8480+; NVIDIA H100" in report
    for png in ("throughput_vs_tpot.png", "cost_vs_p99_tpot.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![{png}]({png})" in report


def test_cli_errors_are_clear(tmp_path, capsys):
    assert cost.main([str(tmp_path / "missing.json"), "--gpu-price-per-hour", "1"]) == 2
    assert "result file not found: " in capsys.readouterr().err
    assert cost.main([str(tmp_path), "--gpu-price-per-hour", "1"]) == 2
    assert "no hetero-bench-serve results in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cost.main([str(tmp_path)])
    assert "--gpu-price-per-hour" in capsys.readouterr().err
