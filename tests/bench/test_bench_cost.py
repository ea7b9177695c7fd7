"""The cost report on hand-made result files: $/1M tokens and price precedence by hand, which load
points meet an SLA, goodput, the cost at each SLA (a configuration that never meets one
included), the what-if prices, and a whole report (Markdown, CSV, PNGs)."""
from __future__ import annotations

import csv
import json
import math

import pytest

from bench import _cost_report, cost
from bench._cost_sla import Sla, best_under_sla, goodput, meets, parse_sla, sla_summary
from bench.cost import (CostInputError, MachinePrice, PriceScenario, cost_per_million_tokens, cost_rows,
                        load_anchors, load_point, load_price_file, offered_load_key, price_for_label,
                        price_scenarios)
from bench.serve import RESULT_SCHEMA

TIGHT, LOOSE = Sla(30.0, 1000.0), Sla(60.0, 1000.0)


def result(label: str, rate, output_tps: float, total_tps: float, p99_tpot: float, p99_ttft: float = 90.0,
           acceptance=None, concurrency=None, workload=None, requests=(), failed: int = 0,
           duration: float = 10.0) -> dict:
    """A result file; `requests`: (TTFT s, TPOT s) of each successful request."""
    stats = lambda median, p99: {"mean": median, "median": median, "p99": p99}  # noqa: E731
    return {
        "schema": RESULT_SCHEMA, "label": label, "workload": workload, "timestamp": "2026-01-01T00:00:00+00:00",
        "command": f"hetero-bench-serve --label {label} --request-rate {rate}",
        "machine": {"hostname": "box", "cpu_model": "Xeon 8480+", "gpus": ["NVIDIA H100, 81559 MiB"]},
        "config": {"request_rate": rate, "max_concurrency": concurrency, "endpoint": "completions"},
        "summary": {"duration_s": duration, "completed": 10, "failed": failed, "request_throughput": output_tps / 100,
                    "output_throughput": output_tps, "total_token_throughput": total_tps,
                    "ttft_ms": stats(50.0, p99_ttft), "tpot_ms": stats(p99_tpot / 2, p99_tpot),
                    "e2e_ms": stats(900.0, 1500.0), "goodput": None},
        "spec_decode": {"mean_acceptance_length": acceptance} if acceptance else None,
        "requests": [{"success": True, "ttft": ttft, "tpot": tpot} for ttft, tpot in requests],
    }


def point(*args, **kwargs):
    return load_point(result(*args, **kwargs), "fixture")


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


def test_cost_rows_plain_first_the_baseline_last_each_by_workload_and_load():
    points = [point("lookahead", "inf", 2000, 4000, 25, acceptance=2.5, workload="code"),
              point("hf-generate", "inf", 300, 600, 40, concurrency=16),
              point("plain", 4.0, 500, 1500, 30, workload="any"),
              point("lookahead", 2.0, 1000, 2000, 15, acceptance=2.7, workload="code"),
              point("lookahead", 2.0, 900, 1800, 15, acceptance=1.2, workload="chat"),
              point("plain", 1.0, 200, 600, 20, workload="any")]
    rows = cost_rows(points, lambda label: MachinePrice(3.0, 0.6))
    assert [(r["label"], r["workload"], r["load"]) for r in rows] == [
        ("plain", "any", "1 req/s"), ("plain", "any", "4 req/s"), ("lookahead", "chat", "2 req/s"),
        ("lookahead", "code", "2 req/s"), ("lookahead", "code", "inf req/s"), ("hf-generate", "", "static batch 16")]
    assert rows[4]["usd_per_1m_output_tokens"] == pytest.approx(0.5)  # 3.6 / (2000 * 3600) * 1e6
    assert rows[4]["usd_per_1m_total_tokens"] == pytest.approx(0.25)
    assert rows[0]["usd_per_1m_output_tokens"] == pytest.approx(5.0)
    assert rows[4]["mean_acceptance_length"] == 2.5 and rows[0]["mean_acceptance_length"] is None
    assert "requests" not in rows[0]


def test_a_point_meets_an_sla_by_its_p99s_and_only_without_failures():
    assert meets(point("plain", 8.0, 900, 1800, p99_tpot=30.0, p99_ttft=1000.0), TIGHT)  # bounds are inclusive
    assert not meets(point("plain", 8.0, 900, 1800, p99_tpot=30.1, p99_ttft=200.0), TIGHT)
    assert meets(point("plain", 8.0, 900, 1800, p99_tpot=30.1, p99_ttft=200.0), LOOSE)
    assert not meets(point("plain", 8.0, 900, 1800, p99_tpot=10.0, p99_ttft=1000.1), LOOSE)
    assert not meets(point("plain", 8.0, 900, 1800, p99_tpot=10.0, failed=1), LOOSE)


def test_goodput_counts_the_requests_within_both_bounds_each():
    requests = [(0.2, 0.020), (0.9, 0.031), (1.2, 0.010), (0.5, None), (0.1, 0.059)]
    p = point("plain", 8.0, 900, 1800, 50.0, requests=requests, duration=2.0)
    assert goodput(p, TIGHT) == pytest.approx(2 / 2.0)  # 0.2/20 ms and the 1-token request
    assert goodput(p, LOOSE) == pytest.approx(4 / 2.0)  # all but the 1.2 s TTFT
    assert goodput(point("plain", 8.0, 900, 1800, 50.0), TIGHT) is None  # no per-request records


def test_the_cost_at_an_sla_is_that_of_its_best_point_and_none_where_it_is_never_met():
    price = {"plain": 3.6, "lookahead": 3.6, "cpu-draft": 3.6}
    points = [
        point("plain", 8.0, 1000, 2000, 12.0, p99_ttft=300.0, workload="any"),
        point("plain", 32.0, 3000, 6000, 25.0, p99_ttft=800.0, workload="any"),
        point("plain", "inf", 3600, 7200, 28.0, p99_ttft=4000.0, workload="any"),  # queueing: TTFT fails
        point("lookahead", 8.0, 1200, 2400, 9.0, p99_ttft=250.0, workload="code"),
        point("lookahead", 32.0, 2400, 4800, 45.0, p99_ttft=900.0, workload="code"),
        point("cpu-draft", 8.0, 900, 1800, 70.0, p99_ttft=300.0, workload="code"),  # never meets either SLA
        point("cpu-draft", 32.0, 1800, 3600, 95.0, p99_ttft=1500.0, workload="code"),
    ]
    assert best_under_sla(points[:3], TIGHT, offered_load_key).request_rate == 32.0
    summary = {(r["label"], r["workload"], r["sla"]): r
               for r in sla_summary(points, [TIGHT, LOOSE], price.__getitem__, offered_load_key, cost_per_million_tokens)}
    plain = summary["plain", "any", TIGHT.name]
    assert plain["load"] == "32 req/s" and plain["output_throughput"] == 3000
    assert plain["usd_per_1m_output_tokens"] == pytest.approx(3.6 / (3000 * 3600) * 1e6)  # $0.333
    assert summary["lookahead", "code", TIGHT.name]["load"] == "8 req/s"  # 32 req/s breaks the 30 ms TPOT bound
    assert summary["lookahead", "code", TIGHT.name]["usd_per_1m_output_tokens"] == pytest.approx(3.6 / 4.32)
    assert summary["lookahead", "code", LOOSE.name]["usd_per_1m_output_tokens"] == pytest.approx(3.6 / 8.64)
    for sla in (TIGHT, LOOSE):
        never = summary["cpu-draft", "code", sla.name]
        assert never["load"] is None and never["usd_per_1m_output_tokens"] is None and never["goodput"] is None
    table = _cost_report.headline_tables(list(summary.values()), [TIGHT])
    assert "| cpu-draft | never met |" in table
    assert "| plain | $0.333 (32 req/s) |" in table  # plain (any workload) fills the code column
    assert "- code: cheapest is **plain** at $0.333 (lookahead" not in table
    assert "- code: cheapest is **plain** at $0.333" in table


def test_what_if_prices_scale_the_cost_and_charge_the_cpu_draft_when_asked():
    scenarios = price_scenarios(MachinePrice(3.0, 0.5), gpu_prices=[2.0, 3.0], cpu_draft_extras=[0.0, 1.0])
    assert [s.name for s in scenarios] == ["GPU $3/h, CPU $0.5/h", "GPU $2/h, CPU $0.5/h",
                                           "GPU $3/h, CPU $0.5/h + CPU draft $1/h"]
    assert scenarios[2].price("cpu-draft") == 4.5 and scenarios[2].price("cpu-draft+fp8") == 4.5
    assert scenarios[2].price("gpu-draft") == 3.5 and PriceScenario(2.0, 0.5).price("cpu-draft") == 2.5
    summary = [dict(label="cpu-draft", workload="code", sla=TIGHT.name, output_throughput=1000.0),
               dict(label="plain", workload="any", sla=TIGHT.name, output_throughput=None)]
    table = _cost_report.what_if_table(summary, TIGHT, scenarios)
    # cpu-draft at 1000 tok/s: $3.5/h -> 0.972, $2.5/h -> 0.694, $4.5/h -> 1.250 per 1M
    assert "| cpu-draft | code | 0.972 | 0.694 | 1.250 |" in table
    assert "| plain | any | never met | never met | never met |" in table


def test_sla_specs_parse_and_bad_ones_are_named():
    assert parse_sla("tpot:30,ttft:1000") == TIGHT
    for bad, message in (("tpot:30", "give both"), ("tpot:x,ttft:1", "not a number"), ("e2e:5,ttft:1", "expected"),
                         ("tpot:0,ttft:1", "positive")):
        with pytest.raises(ValueError, match=message):
            parse_sla(bad)


def test_load_point_rejects_foreign_json():
    with pytest.raises(CostInputError, match="not a hetero-bench-serve result"):
        load_point({"some": "json"}, "other.json")


def test_anchors_need_their_source(tmp_path):
    anchors = load_anchors(cost.ANCHORS_PATH)
    assert anchors and all(a["url"].startswith("https://") for a in anchors)
    path = tmp_path / "anchors.yaml"
    path.write_text("- {who: x, claim: fast}\n")
    with pytest.raises(CostInputError, match="entry 0 lacks setting, source, url"):
        load_anchors(path)


def test_report_from_result_files(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    fast = [(0.1, 0.010)] * 10
    for name, payload in {
        "plain-1.json": result("plain", 1.0, 200, 600, 20, workload="any", requests=fast),
        "plain-4.json": result("plain", 4.0, 500, 1500, 28, workload="any", requests=fast),
        "cpu-draft-1.json": result("cpu-draft", 1.0, 450, 850, 12, acceptance=2.4, workload="code", requests=fast),
        "cpu-draft-4.json": result("cpu-draft", 4.0, 1200, 2200, 18, acceptance=2.2, workload="code", requests=fast),
        "gpu-draft-1.json": result("gpu-draft", 1.0, 150, 300, 80, acceptance=2.0, workload="code"),
        "hf-16.json": result("hf-generate", "inf", 100, 200, 45, concurrency=16),
    }.items():
        (results / name).write_text(json.dumps(payload))
    (results / "unrelated.json").write_text('{"not": "a result"}')
    (results / "run-20260101T000000Z.json").write_text(json.dumps({"command": "python -m bench.serve_reference", "total_s": 420,
                                                  "settings": {"num_prompts": 256}, "skipped": ["plain+fp8"],
                                                  "errors": {}, "startup_s": {"plain": 20.5}}))
    prices = tmp_path / "prices.yaml"
    prices.write_text("labels:\n  cpu-draft: {cpu_price_per_hour: 1.2}\n")
    out = tmp_path / "report"
    code = cost.main([str(results), "--gpu-price-per-hour", "2.4", "--cpu-price-per-hour", "0",
                      "--prices", str(prices), "--out-dir", str(out)])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "| gpu-draft | never met |" in stdout

    with (out / "cost_summary.csv").open() as handle:
        rows = {(r["label"], r["request_rate"]): r for r in csv.DictReader(handle)}
    assert len(rows) == 6
    # plain: $2.40/h at 200 tok/s -> 2.4 / 720000 * 1e6 = $3.333 per 1M output tokens
    assert float(rows["plain", "1.0"]["usd_per_1m_output_tokens"]) == pytest.approx(2.4 / 0.72)
    # cpu-draft: $3.60/h at 1200 tok/s -> $0.8333; total 2200 tok/s -> $0.4545
    assert float(rows["cpu-draft", "4.0"]["usd_per_1m_output_tokens"]) == pytest.approx(3.6 / 4.32)
    assert float(rows["cpu-draft", "4.0"]["usd_per_1m_total_tokens"]) == pytest.approx(3.6 / 7.92)
    with (out / "cost_at_sla.csv").open() as handle:
        at_sla = {(r["label"], r["sla"]): r for r in csv.DictReader(handle)}
    assert float(at_sla["cpu-draft", TIGHT.name]["usd_per_1m_output_tokens"]) == pytest.approx(3.6 / 4.32)
    assert at_sla["gpu-draft", LOOSE.name]["usd_per_1m_output_tokens"] == ""  # 80 ms p99 TPOT: never met
    assert at_sla["hf-generate", TIGHT.name]["usd_per_1m_output_tokens"] == ""  # 45 ms
    assert float(at_sla["hf-generate", LOOSE.name]["usd_per_1m_output_tokens"]) == pytest.approx(2.4 / 0.36)

    report = (out / "cost_report.md").read_text()
    assert "| cpu-draft | $0.833 (4 req/s) |" in report
    assert "| hf-generate | never met |" in report and "| hf-generate | $6.667 (static batch 16) |" in report
    # plain at 4 req/s: 2.4 / (500 * 3600) * 1e6 = $1.333; 1 - 0.833 / 1.333 = 37.5 %
    assert "- code: cheapest is **cpu-draft** at $0.833 (38% less than plain; hf-generate never meets it)" in report
    assert "**cpu-draft**: GPU $2.4/h + CPU $1.2/h = $3.6/h" in report
    assert "## Published figures (not measured here)" in report and "blog.vllm.ai" in report
    assert "GPU $2/h, CPU $0/h" in report and "+ CPU draft $0.5/h" in report
    assert "left out by its time budget: plain+fp8" in report and "plain 20.5" in report
    assert "`hetero-bench-serve --label plain --request-rate 4.0`" in report
    assert "Xeon 8480+; NVIDIA H100" in report
    assert "| plain | any | 1 req/s | 10 | 0 |" in report and "| 1.00 * |" in report  # goodput, meets the SLA
    for png in ("throughput_vs_p99_tpot.png", "cost_vs_sla.png"):
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
    with pytest.raises(SystemExit):
        cost.main([str(tmp_path), "--gpu-price-per-hour", "1", "--sla", "tpot:30"])
    assert "give both tpot and ttft" in capsys.readouterr().err
    assert math.isinf(offered_load_key(point("x", "inf", 1, 1, 1))[0])


def test_prices_per_label_only_leave_the_what_if_out(tmp_path):
    (tmp_path / "plain.json").write_text(json.dumps(result("plain", 1.0, 200, 600, 20, workload="any")))
    prices = tmp_path / "prices.yaml"
    prices.write_text("labels:\n  plain: {gpu_price_per_hour: 2.0}\n")
    out = tmp_path / "report"
    assert cost.main([str(tmp_path), "--prices", str(prices), "--out-dir", str(out), "--no-plots"]) == 0
    report = (out / "cost_report.md").read_text()
    assert "What if" not in report and "| plain | $2.778 (1 req/s) |" in report  # 2 / 0.72


def test_without_matplotlib_the_plots_are_refused_clearly(tmp_path, capsys, monkeypatch):
    import sys

    (tmp_path / "plain.json").write_text(json.dumps(result("plain", 1.0, 200, 600, 20, workload="any")))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    assert cost.main([str(tmp_path), "--gpu-price-per-hour", "1", "--out-dir", str(tmp_path / "out")]) == 2
    assert "the plots need matplotlib" in capsys.readouterr().err
    assert cost.main([str(tmp_path), "--gpu-price-per-hour", "1", "--out-dir", str(tmp_path / "out"), "--no-plots"]) == 0
