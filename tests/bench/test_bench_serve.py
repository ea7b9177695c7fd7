"""The serving benchmark: its maths on hand-made records, its dataset loaders on tiny files,
its errors, and whole runs against a fake OpenAI-compatible server on loopback.

The fake (below) streams exactly ``max_tokens`` tokens, ``tokens_per_chunk`` per SSE chunk
(as a speculative server does when it accepts several tokens in one step), sleeps
``first_token_delay_s`` before the first chunk and ``chunk_delay_s`` between chunks,
reports usage, and exposes hetero's speculative counters on /metrics as if each chunk were
one verification step. Prompts containing ``FAIL`` get an OpenAI-shaped 500, prompts
containing ``BREAK`` an error event after their first chunk, prompts containing ``SILENT``
only empty text (as when a detokenizer holds back an incomplete character).
"""
from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from bench import serve
from bench._datasets import (DatasetError, Prompt, load_jsonl, load_sharegpt, sample_prompts,
                             synthetic_prompts)
from bench._prometheus import (acceptance_over_run, find_spec_decode_counters,
                               parse_prometheus_text)
from bench._stats import (RequestRecord, arrival_offsets, meets_slos, parse_slos, percentile,
                          summarize)

# ---------------------------------------------------------------- the fake server

MODEL = "fake-model"


@dataclass
class FakeBehaviour:
    first_token_delay_s: float = 0.05
    chunk_delay_s: float = 0.01
    tokens_per_chunk: int = 1
    api_key: Optional[str] = None
    draft_tokens_per_step: int = 4


class FakeState:
    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests = 0
        self.steps = 0
        self.accepted = 0
        self.draft_tokens = 0


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "fake", "code": status}}, status_code=status)


def build_app(behaviour: FakeBehaviour, state: FakeState) -> FastAPI:
    app = FastAPI()

    def authorized(request: Request) -> bool:
        return behaviour.api_key is None or request.headers.get("authorization") == f"Bearer {behaviour.api_key}"

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return _error(401, "invalid api key")
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# HELP hetero:spec_decode_num_steps_total verification steps\n"
            "# TYPE hetero:spec_decode_num_steps_total counter\n"
            f'hetero:spec_decode_num_steps_total{{model="{MODEL}"}} {state.steps}\n'
            f'hetero:spec_decode_num_accepted_tokens_total{{model="{MODEL}"}} {state.accepted}\n'
            f'hetero:spec_decode_num_draft_tokens_total{{model="{MODEL}"}} {state.draft_tokens}\n'
            f"hetero:spec_decode_num_steps_created {time.time()}\n"
        )

    async def generate(request: Request, chat: bool):
        if not authorized(request):
            return _error(401, "invalid api key")
        body = await request.json()
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL" in str(prompt):
            return _error(500, "boom")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        max_tokens = body["max_tokens"]
        include_usage = (body.get("stream_options") or {}).get("include_usage", False)

        def chunk(text: Optional[str], usage: Optional[dict] = None) -> str:
            if chat:
                choices = [] if text is None else [{"index": 0, "delta": {"content": text}}]
            else:
                choices = [] if text is None else [{"index": 0, "text": text}]
            return "data: " + json.dumps({"id": "x", "model": MODEL, "choices": choices, "usage": usage}) + "\n\n"

        async def stream():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if chat:
                    yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
                await asyncio.sleep(behaviour.first_token_delay_s)
                sent = 0
                while sent < max_tokens:
                    if sent:
                        await asyncio.sleep(behaviour.chunk_delay_s)
                    count = min(behaviour.tokens_per_chunk, max_tokens - sent)
                    yield chunk("" if "SILENT" in str(prompt) else "".join(f" t{sent + i}" for i in range(count)))
                    sent += count
                    if "BREAK" in str(prompt):
                        yield "data: " + json.dumps({"error": {"message": "engine died", "code": 500}}) + "\n\n"
                        return
                steps = math.ceil(max_tokens / behaviour.tokens_per_chunk)
                state.steps += steps
                state.accepted += max_tokens - steps
                state.draft_tokens += steps * behaviour.draft_tokens_per_step
                state.requests += 1
                if include_usage:
                    yield chunk(None, {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                                       "total_tokens": prompt_tokens + max_tokens})
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


class FakeServer:
    """Context manager running the fake on 127.0.0.1 at a free port in a thread."""

    def __init__(self, behaviour: Optional[FakeBehaviour] = None) -> None:
        self.behaviour = behaviour or FakeBehaviour()
        self.state = FakeState()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        config = uvicorn.Config(build_app(self.behaviour, self.state), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def free_closed_port() -> int:
    """A loopback port nothing listens on: bound, read, closed."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = serve.main(["--disable-tqdm", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def only_result(result_dir) -> tuple[dict, list[dict]]:
    (json_path,) = result_dir.glob("*.json")
    (csv_path,) = result_dir.glob("*.csv")
    with csv_path.open() as handle:
        rows = list(csv.DictReader(handle))
    return json.loads(json_path.read_text()), rows


# ---------------------------------------------------------------- maths


def test_percentile_interpolates_linearly_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5  # position 1.5 between 2 and 3
    assert percentile(values, 99) == pytest.approx(3.97)  # position 2.97
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_tpot_excludes_the_first_token():
    record = RequestRecord(success=True, output_tokens=11, ttft=0.1, e2e=1.1)
    assert record.tpot == pytest.approx(0.1)
    assert RequestRecord(success=True, output_tokens=1, ttft=0.1, e2e=0.1).tpot is None
    assert RequestRecord(success=False, output_tokens=11, ttft=0.1, e2e=1.1).tpot is None


def hand_made_records() -> list[RequestRecord]:
    return [
        # tpot (0.5-0.1)/4 = 0.1 s
        RequestRecord(success=True, prompt_tokens=10, output_tokens=5, ttft=0.1, itl=[0.1] * 4, e2e=0.5,
                      usage_reported=True),
        # tpot (1.3-0.3)/10 = 0.1 s
        RequestRecord(success=True, prompt_tokens=20, output_tokens=11, ttft=0.3, itl=[0.2] * 5, e2e=1.3,
                      usage_reported=True),
        RequestRecord(success=False, error="HTTP 500: boom", e2e=0.01),
    ]


def test_summary_on_hand_made_records():
    summary = summarize(hand_made_records(), duration_s=2.0, slos_ms={"ttft": 200})
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["errors"] == {"HTTP 500: boom": 1}
    assert summary["total_input_tokens"] == 30 and summary["total_output_tokens"] == 16
    assert summary["request_throughput"] == 1.0
    assert summary["output_throughput"] == 8.0
    assert summary["total_token_throughput"] == 23.0
    assert summary["ttft_ms"]["mean"] == pytest.approx(200)
    assert summary["ttft_ms"]["median"] == pytest.approx(200)
    assert summary["ttft_ms"]["p99"] == pytest.approx(100 + 200 * 0.99)
    assert summary["tpot_ms"]["mean"] == pytest.approx(100)
    assert summary["itl_ms"]["mean"] == pytest.approx((0.4 + 1.0) / 9 * 1000)
    assert summary["itl_ms"]["median"] == pytest.approx(200)  # 4 gaps of 0.1 s, 5 of 0.2 s: the 5th is 0.2
    assert summary["e2e_ms"]["p99"] == pytest.approx(500 + 800 * 0.99)
    assert summary["goodput"] == 0.5  # only the first request has ttft <= 200 ms
    assert summary["token_counts_from_usage"] is True


def test_goodput_needs_every_slo():
    fast, slow, failed = hand_made_records()
    assert meets_slos(fast, {"ttft": 100, "tpot": 100, "e2e": 500})
    assert not meets_slos(fast, {"ttft": 100, "tpot": 99})
    assert meets_slos(slow, {"tpot": 100}) and not meets_slos(slow, {"tpot": 100, "e2e": 1299})
    assert not meets_slos(failed, {})
    summary = summarize(hand_made_records(), duration_s=4.0, slos_ms={"tpot": 100, "e2e": 1300})
    assert summary["goodput"] == 0.5
    assert summarize(hand_made_records(), duration_s=4.0)["goodput"] is None


def test_slo_parsing_names_the_bad_spec():
    assert parse_slos(["ttft:500", "TPOT:50.5", "e2e:9000"]) == {"ttft": 500, "tpot": 50.5, "e2e": 9000}
    for bad in ("latency:5", "ttft", "ttft:fast", "tpot:-1"):
        with pytest.raises(ValueError, match=bad.split(":")[0]):
            parse_slos([bad])


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    assert arrival_offsets(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]
    first = arrival_offsets(20000, 4.0, random.Random(1))
    assert first == arrival_offsets(20000, 4.0, random.Random(1))
    assert first[0] == 0.0 and all(b >= a for a, b in zip(first, first[1:]))
    assert first[-1] / (len(first) - 1) == pytest.approx(0.25, rel=0.03)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, random.Random(0))


def test_acceptance_length_from_hetero_counters():
    text_before = ('# TYPE hetero:spec_decode_num_steps_total counter\n'
                   'hetero:spec_decode_num_steps_total{model="m"} 10\n'
                   'hetero:spec_decode_num_accepted_tokens_total{model="m"} 5\n'
                   'hetero:spec_decode_num_draft_tokens_total{model="m"} 40\n'
                   'hetero:spec_decode_num_steps_created 1.7e9\n')
    text_after = ('hetero:spec_decode_num_steps_total{model="m",rank="0"} 60\n'
                  'hetero:spec_decode_num_steps_total{model="m",rank="1"} 50\n'
                  'hetero:spec_decode_num_accepted_tokens_total{model="m"} 155\n'
                  'hetero:spec_decode_num_draft_tokens_total{model="m"} 440\n')
    before = find_spec_decode_counters(parse_prometheus_text(text_before))
    after = find_spec_decode_counters(parse_prometheus_text(text_after))
    spec = acceptance_over_run(before, after)
    assert (spec["steps"], spec["accepted_tokens"], spec["draft_tokens"]) == (100, 150, 400)
    assert spec["mean_acceptance_length"] == 2.5  # (150 + 100) / 100
    assert spec["draft_acceptance_rate"] == 0.375


def test_acceptance_length_from_vllm_counter_names():
    samples = parse_prometheus_text(
        'vllm:spec_decode_num_drafts_total{engine="0"} 20\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="0"} 60\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 30\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 15\n'
        'vllm:num_requests_running 3\n')
    counters = find_spec_decode_counters(samples)
    assert counters.names["steps"] == "vllm:spec_decode_num_drafts_total"
    zero = type(counters)(accepted=0, draft_tokens=0, steps=0, names={})
    assert acceptance_over_run(zero, counters)["mean_acceptance_length"] == 2.5
    assert find_spec_decode_counters(parse_prometheus_text("vllm:num_requests_running 3\n")) is None


# ---------------------------------------------------------------- datasets


def test_sharegpt_loader_takes_first_exchange(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "hello there"},
                                      {"from": "gpt", "value": "x" * 40}]},
        {"id": "b", "conversations": [{"from": "system", "value": "be nice"},
                                      {"from": "human", "value": "second"},
                                      {"from": "gpt", "value": "yy"}, {"from": "human", "value": "more"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "unanswered"}]},
        {"id": "d"},
    ]))
    assert load_sharegpt(path) == [Prompt("hello there", 10), Prompt("second", 1)]
    assert load_sharegpt(path, output_len=7) == [Prompt("hello there", 7), Prompt("second", 7)]


def test_jsonl_loader_reads_lengths_and_names_bad_lines(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a b c"}\n\n{"prompt": "d", "output_len": 3}\n{"prompt": "e", "max_tokens": 9}\n')
    assert load_jsonl(path, 16) == [Prompt("a b c", 16), Prompt("d", 3), Prompt("e", 9)]
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(DatasetError, match=r"prompts.jsonl:2"):
        load_jsonl(path, 16)
    path.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(DatasetError, match=r"prompts.jsonl:2: not valid JSON"):
        load_jsonl(path, 16)


def test_missing_dataset_file_is_named(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(DatasetError, match="dataset file not found: .*nope.json"):
        load_sharegpt(missing)
    with pytest.raises(DatasetError, match="nope.json"):
        load_jsonl(missing, 4)


def test_synthetic_prompts_have_the_asked_lengths():
    words = synthetic_prompts(3, 12, 5, random.Random(0))
    assert [len(p.prompt.split()) for p in words] == [12, 12, 12]
    assert {p.output_len for p in words} == {5}
    assert words == synthetic_prompts(3, 12, 5, random.Random(0))
    ids = synthetic_prompts(2, 7, 5, random.Random(0), vocab_size=50)
    assert all(len(p.prompt) == 7 and all(0 <= t < 50 for t in p.prompt) for p in ids)


def test_small_datasets_are_reused_round_by_round():
    pool = [Prompt(str(i), 1) for i in range(3)]
    chosen = sample_prompts(pool, 7, random.Random(0))
    assert len(chosen) == 7
    assert sorted(p.prompt for p in chosen[:3]) == ["0", "1", "2"]
    assert sorted(p.prompt for p in chosen[3:6]) == ["0", "1", "2"]


# ---------------------------------------------------------------- errors from the CLI


def test_cli_names_a_missing_dataset(tmp_path, capsys):
    code, _, err = run_cli(capsys, "--dataset-path", str(tmp_path / "absent.jsonl"),
                           "--result-dir", str(tmp_path / "out"))
    assert code == 2
    assert "dataset file not found" in err and "absent.jsonl" in err
    assert not (tmp_path / "out").exists()


def test_cli_fails_fast_on_an_unreachable_endpoint(tmp_path, capsys):
    base_url = f"http://127.0.0.1:{free_closed_port()}/v1"
    started = time.monotonic()
    code, _, err = run_cli(capsys, "--base-url", base_url, "--num-prompts", "2",
                           "--result-dir", str(tmp_path))
    assert code == 2
    assert f"cannot reach {base_url}/models" in err
    assert time.monotonic() - started < 15
    assert list(tmp_path.iterdir()) == []


def test_cli_explains_a_refused_api_key(tmp_path, capsys):
    with FakeServer(FakeBehaviour(api_key="sesame")) as fake:
        code, _, err = run_cli(capsys, "--base-url", fake.base_url, "--api-key", "wrong",
                               "--result-dir", str(tmp_path))
        assert code == 2
        assert "refused the API key (HTTP 401: invalid api key)" in err and "--api-key" in err
        code, out, _ = run_cli(capsys, "--base-url", fake.base_url, "--api-key", "sesame", "--num-prompts", "1",
                               "--output-len", "2", "--warmup", "0", "--result-dir", str(tmp_path))
        assert code == 0 and "Successful requests:" in out
    result, _ = only_result(tmp_path)
    assert "sesame" not in json.dumps(result) and "--api-key '***'" in result["command"]
    assert serve.redacted_command(["--api-key=k", "--label", "x"]) == "hetero-bench-serve '--api-key=***' --label x"


def test_cli_rejects_an_unknown_model_and_bad_slo(tmp_path, capsys):
    with FakeServer() as fake:
        code, _, err = run_cli(capsys, "--base-url", fake.base_url, "--model", "other",
                               "--result-dir", str(tmp_path))
    assert code == 2 and "'other' is not served" in err and "fake-model" in err
    with pytest.raises(SystemExit):
        serve.main(["--goodput", "latency:5"])
    assert "latency:5" in capsys.readouterr().err


# ---------------------------------------------------------------- whole runs on loopback


def test_benchmark_against_a_live_streaming_server(tmp_path, capsys):
    behaviour = FakeBehaviour(first_token_delay_s=0.05, chunk_delay_s=0.01, tokens_per_chunk=2)
    num_prompts, output_len, input_len = 8, 6, 12
    with FakeServer(behaviour) as fake:
        code, out, err = run_cli(
            capsys, "--base-url", fake.base_url, "--label", "lookahead", "--num-prompts", str(num_prompts),
            "--input-len", str(input_len), "--output-len", str(output_len), "--warmup", "2",
            "--result-dir", str(tmp_path))
        assert code == 0, err
        assert fake.state.requests == num_prompts + 2  # the warm-up is sent but not measured
    result, rows = only_result(tmp_path)
    summary, requests = result["summary"], result["requests"]

    assert result["schema"] == serve.RESULT_SCHEMA and result["label"] == "lookahead"
    assert result["command"].startswith("hetero-bench-serve --disable-tqdm --base-url http://127.0.0.1:")
    assert result["machine"]["hostname"] and result["machine"]["cpu_model"]
    assert result["config"]["model"] == "fake-model" and result["config"]["request_rate"] == "inf"
    assert (summary["completed"], summary["failed"]) == (num_prompts, 0)
    chunks = output_len // behaviour.tokens_per_chunk
    for request in requests:
        assert request["success"] and request["usage_reported"]
        assert request["output_tokens"] == output_len  # from the server's usage block
        assert request["prompt_tokens"] == input_len
        assert behaviour.first_token_delay_s <= request["ttft"] < request["e2e"]
        assert len(request["itl"]) == chunks - 1
        # Arrival gaps, not the server's send gaps: a reader that falls behind gets two chunks at once.
        assert all(gap >= 0 for gap in request["itl"])
        assert request["tpot"] == pytest.approx((request["e2e"] - request["ttft"]) / (output_len - 1))
    assert summary["total_output_tokens"] == num_prompts * output_len
    assert summary["total_input_tokens"] == num_prompts * input_len
    duration = summary["duration_s"]
    assert summary["output_throughput"] == pytest.approx(num_prompts * output_len / duration)
    assert summary["total_token_throughput"] == pytest.approx(num_prompts * (output_len + input_len) / duration)
    assert summary["request_throughput"] == pytest.approx(num_prompts / duration)
    # All requests run at once, none can finish before the fake's delays add up.
    fastest_e2e = behaviour.first_token_delay_s + (chunks - 1) * behaviour.chunk_delay_s
    assert duration >= fastest_e2e
    assert summary["output_throughput"] <= num_prompts * output_len / fastest_e2e
    gaps = [gap for request in requests for gap in request["itl"]]
    assert summary["itl_ms"]["mean"] == pytest.approx(1e3 * sum(gaps) / len(gaps))
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[metric]
        assert 0 < stats["median"] <= stats["p99"] and stats["mean"] > 0
    assert summary["ttft_ms"]["p99"] < summary["e2e_ms"]["p99"]
    spec = result["spec_decode"]
    assert spec["steps"] == num_prompts * chunks  # the warm-up's steps are not counted
    assert spec["mean_acceptance_length"] == behaviour.tokens_per_chunk
    assert spec["draft_acceptance_rate"] == pytest.approx(
        (output_len - chunks) / (chunks * behaviour.draft_tokens_per_step))
    assert len(rows) == num_prompts and all(row["success"] == "True" for row in rows)
    assert "Mean acceptance length:" in out and "P99 TPOT (ms):" in out


def test_chat_endpoint_with_bounded_concurrency_and_goodput(tmp_path, capsys):
    with FakeServer(FakeBehaviour(first_token_delay_s=0.02, chunk_delay_s=0.005)) as fake:
        code, _, err = run_cli(
            capsys, "--base-url", fake.base_url, "--endpoint", "chat", "--num-prompts", "6",
            "--max-concurrency", "2", "--request-rate", "50", "--output-len", "4", "--warmup", "0",
            "--goodput", "ttft:1", "--result-dir", str(tmp_path / "strict"))
        assert code == 0, err
        assert fake.state.max_in_flight <= 2
        code, _, err = run_cli(
            capsys, "--base-url", fake.base_url, "--endpoint", "chat", "--num-prompts", "6",
            "--max-concurrency", "2", "--output-len", "4", "--warmup", "0",
            "--goodput", "e2e:60000", "tpot:60000", "--result-dir", str(tmp_path / "loose"))
        assert code == 0, err
    strict, _ = only_result(tmp_path / "strict")
    loose, _ = only_result(tmp_path / "loose")
    assert strict["config"]["max_concurrency"] == 2 and strict["config"]["request_rate"] == 50
    assert strict["summary"]["completed"] == 6
    assert all(r["output_tokens"] == 4 and len(r["itl"]) == 3 for r in strict["requests"])
    assert strict["summary"]["goodput"] == 0  # no TTFT can beat the fake's 20 ms first-token delay
    assert loose["summary"]["goodput"] == pytest.approx(loose["summary"]["request_throughput"])
    offsets = [r["start"] for r in strict["requests"]]
    assert offsets == sorted(offsets)  # Poisson sends go out in order


def test_failed_requests_are_counted_with_their_errors(tmp_path, capsys):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "fine"}\n{"prompt": "please FAIL"}\n{"prompt": "BREAK midway"}\n'
                       '{"prompt": "SILENT"}\n')
    with FakeServer(FakeBehaviour(first_token_delay_s=0.0, chunk_delay_s=0.0)) as fake:
        code, out, err = run_cli(capsys, "--base-url", fake.base_url, "--dataset-path", str(dataset),
                                 "--num-prompts", "8", "--output-len", "3", "--warmup", "0",
                                 "--result-dir", str(tmp_path / "out"))
        assert code == 0, err
        failing = tmp_path / "failing.jsonl"
        failing.write_text('{"prompt": "FAIL"}\n')
        code, _, err = run_cli(capsys, "--base-url", fake.base_url, "--dataset-path", str(failing),
                               "--num-prompts", "4", "--warmup", "1", "--result-dir", str(tmp_path / "warm"))
        assert code == 2 and "warm-up request" in err and "HTTP 500: boom" in err
        assert not (tmp_path / "warm").exists()
    result, rows = only_result(tmp_path / "out")
    assert result["config"]["dataset_name"] == "jsonl"
    silent = "stream ended without any generated text (its usage claims 3 completion tokens)"
    assert (result["summary"]["completed"], result["summary"]["failed"]) == (2, 6)
    assert result["summary"]["errors"] == {"HTTP 500: boom": 2, "error in stream: engine died": 2, silent: 2}
    assert "error x2: HTTP 500: boom" in out and "error x2: error in stream: engine died" in out
    assert sorted(row["error"] for row in rows) == sorted(
        ["", "", "HTTP 500: boom", "HTTP 500: boom", "error in stream: engine died",
         "error in stream: engine died", silent, silent])
    assert result["summary"]["total_output_tokens"] == 2 * 3  # failed requests count for nothing


def test_token_id_prompts_reach_the_server_at_their_exact_length(tmp_path, capsys):
    with FakeServer(FakeBehaviour(first_token_delay_s=0.0, chunk_delay_s=0.0)) as fake:
        code, _, err = run_cli(capsys, "--base-url", fake.base_url, "--vocab-size", "100", "--input-len", "17",
                               "--output-len", "2", "--num-prompts", "3", "--warmup", "0",
                               "--result-dir", str(tmp_path))
        assert code == 0, err
    result, _ = only_result(tmp_path)
    assert [r["prompt_tokens"] for r in result["requests"]] == [17, 17, 17]
    with pytest.raises(SystemExit):
        serve.main(["--endpoint", "chat", "--vocab-size", "100"])
    assert "completions only" in capsys.readouterr().err


# ---------------------------------------------------------------- against `hetero serve`


@pytest.fixture
def hetero_server(tiny_llama_dir):
    """`hetero serve` of the tiny random llama on a loopback port, in its own process."""
    repo = Path(__file__).resolve().parents[2]
    port = free_closed_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "hetero.cli", "serve", str(tiny_llama_dir), "--host", "127.0.0.1",
         "--port", str(port), "--served-model-name", "tiny", "--uvicorn-log-level", "warning"],
        cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                pytest.fail(f"hetero serve exited with {process.returncode}: {process.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{base_url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "hetero serve did not answer /v1/models within 90 s"
            time.sleep(0.2)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_benchmark_against_hetero_serve(hetero_server, tmp_path, capsys):
    code, out, err = run_cli(capsys, "--base-url", hetero_server, "--num-prompts", "4", "--input-len", "16",
                             "--output-len", "8", "--ignore-eos", "--max-concurrency", "2", "--warmup", "1",
                             "--label", "plain", "--result-dir", str(tmp_path))
    assert code == 0, err
    result, rows = only_result(tmp_path)
    summary = result["summary"]
    assert result["config"]["model"] == "tiny"
    assert (summary["completed"], summary["failed"]) == (4, 0), summary["errors"]
    assert summary["token_counts_from_usage"] and summary["total_output_tokens"] == 4 * 8
    for request in result["requests"]:
        assert request["output_tokens"] == 8 and request["prompt_tokens"] > 0
        assert 0 < request["ttft"] < request["e2e"]
    assert result["spec_decode"]["metric_names"]["steps"] == "hetero:spec_decode_num_steps_total"
    assert len(rows) == 4 and "Output token throughput (tok/s):" in out
