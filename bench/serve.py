"""Serving benchmark for any OpenAI-compatible endpoint (hetero serve, vLLM, SGLang, TGI, ...).

Sends streamed requests at Poisson arrivals (``--request-rate``; ``inf`` = all at once)
and/or with at most ``--max-concurrency`` in flight, after ``--warmup`` requests that
are not measured, and reports TTFT, TPOT, ITL and E2E latency (mean / median / p99),
request and token throughput, goodput under ``--goodput`` SLOs, the failures, and, when
the server's /metrics exposes speculative-decoding counters (see ``bench/_prometheus.py``
for the names), the mean acceptance length over the run.

Prints a table and writes ``<result-dir>/<label>-...-<timestamp>.json`` (command line,
machine, configuration, summary, every request) and a ``.csv`` with one row per request.

    hetero-bench-serve --base-url http://127.0.0.1:8000/v1 --label lookahead \\
        --dataset-name sharegpt --dataset-path ShareGPT_V3.json --num-prompts 200 \\
        --request-rate 4 --goodput ttft:500 tpot:50
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import re
import shlex
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import urlsplit

import httpx
from tqdm import tqdm

from bench._client import RequestSettings, error_message, stream_request
from bench._datasets import (DatasetError, Prompt, load_jsonl, load_sharegpt, sample_prompts,
                             synthetic_prompts)
from bench._machine import describe_machine
from bench._prometheus import (SpecDecodeCounters, acceptance_over_run,
                               find_spec_decode_counters, parse_prometheus_text)
from bench._stats import RequestRecord, arrival_offsets, parse_slos, summarize

RESULT_SCHEMA = "hetero-bench-serve/1"
DEFAULT_OUTPUT_LEN = 128
PROBE_TIMEOUT_S = 10.0


class BenchmarkError(RuntimeError):
    """The benchmark cannot run (endpoint unreachable, key refused, unknown model, ...)."""


@dataclass
class RunOutcome:
    model: str
    records: list[RequestRecord]
    duration_s: float
    spec_decode: Optional[dict]


def endpoint_urls(base_url: str, endpoint: str) -> dict[str, str]:
    """Request, model-list and metrics URLs; /metrics sits at the server root, beside /v1."""
    base = base_url.rstrip("/")
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BenchmarkError(f"--base-url must look like http://HOST:PORT/v1, got {base_url!r}")
    path = "/chat/completions" if endpoint == "chat" else "/completions"
    return {
        "request": base + path,
        "models": base + "/models",
        "metrics": f"{parts.scheme}://{parts.netloc}/metrics",
    }


def build_prompts(args: argparse.Namespace, rng: random.Random) -> list[Prompt]:
    """Prompts for the warm-up followed by the measured run."""
    total = args.warmup + args.num_prompts
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    if args.dataset_name == "synthetic":
        return synthetic_prompts(total, args.input_len, output_len, rng, args.vocab_size)
    if args.dataset_name == "sharegpt":
        pool = load_sharegpt(args.dataset_path, args.output_len)
    else:
        pool = load_jsonl(args.dataset_path, output_len)
    return sample_prompts(pool, total, rng)


async def check_endpoint(client: httpx.AsyncClient, urls: dict[str, str], model: Optional[str]) -> str:
    """Fail fast on an unreachable endpoint, a refused key or an unknown model; returns the
    model to use (the first one listed when ``--model`` is not given)."""
    try:
        response = await client.get(urls["models"], timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise BenchmarkError(
            f"cannot reach {urls['models']} ({type(exc).__name__}: {str(exc) or 'no answer'}); "
            "is the server running and --base-url right?") from None
    if response.status_code in (401, 403):
        raise BenchmarkError(
            f"{urls['models']} refused the API key ({error_message(response.status_code, response.content)}); "
            "pass --api-key or set OPENAI_API_KEY")
    if response.status_code != 200:
        if model is None:
            raise BenchmarkError(f"--model is required: {urls['models']} answered "
                                 f"{error_message(response.status_code, response.content)}")
        return model
    try:
        listing = response.json()
    except ValueError:
        listing = {}
    entries = listing.get("data", []) if isinstance(listing, dict) else []
    served = [entry.get("id") for entry in entries if isinstance(entry, dict)]
    if model is None:
        if not served:
            raise BenchmarkError(f"--model is required: {urls['models']} lists no model")
        return served[0]
    if served and model not in served:
        raise BenchmarkError(f"model {model!r} is not served at {urls['models']}; it serves: {', '.join(served)}")
    return model


async def read_spec_counters(client: httpx.AsyncClient, metrics_url: str) -> Optional[SpecDecodeCounters]:
    """The server's speculative counters, or None where /metrics is absent or has none."""
    try:
        response = await client.get(metrics_url, timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return find_spec_decode_counters(parse_prometheus_text(response.text))


async def send_all(client: httpx.AsyncClient, settings: RequestSettings, prompts: Sequence[Prompt],
                   offsets: Sequence[float], max_concurrency: Optional[int],
                   progress: Optional[tqdm]) -> tuple[list[RequestRecord], float]:
    """Send each prompt at its offset (at most ``max_concurrency`` in flight); returns the
    records in prompt order and the wall time from the first send to the last response."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    run_start = time.perf_counter()

    async def one(prompt: Prompt, offset: float) -> RequestRecord:
        delay = run_start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if semaphore is None:
            record = await stream_request(client, settings, prompt, run_start)
        else:
            async with semaphore:
                record = await stream_request(client, settings, prompt, run_start)
        if progress is not None:
            progress.update(1)
        return record

    records = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets)))
    return list(records), time.perf_counter() - run_start


async def run_benchmark(args: argparse.Namespace, prompts: list[Prompt], offsets: list[float]) -> RunOutcome:
    urls = endpoint_urls(args.base_url, args.endpoint)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    timeout = httpx.Timeout(args.request_timeout, connect=PROBE_TIMEOUT_S)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        model = await check_endpoint(client, urls, args.model)
        settings = RequestSettings(url=urls["request"], endpoint=args.endpoint, model=model,
                                   temperature=args.temperature, ignore_eos=args.ignore_eos,
                                   extra_body=args.extra_body)
        warmup, measured = prompts[: args.warmup], prompts[args.warmup:]
        if warmup:
            records, _ = await send_all(client, settings, warmup, [0.0] * len(warmup),
                                        args.max_concurrency, None)
            failures = [r.error for r in records if not r.success]
            if failures:
                raise BenchmarkError(f"warm-up request to {urls['request']} failed: {failures[0]}")
        before = await read_spec_counters(client, urls["metrics"])
        progress = tqdm(total=len(measured), desc=f"{args.label}", unit="req", disable=args.disable_tqdm)
        try:
            records, duration = await send_all(client, settings, measured, offsets,
                                               args.max_concurrency, progress)
        finally:
            progress.close()
        after = await read_spec_counters(client, urls["metrics"])
    spec = acceptance_over_run(before, after) if before and after else None
    return RunOutcome(model=model, records=records, duration_s=duration, spec_decode=spec)


def _json_rate(rate: float):
    return "inf" if math.isinf(rate) else rate


def build_result(args: argparse.Namespace, command: str, outcome: RunOutcome, slos: dict) -> dict:
    return {
        "schema": RESULT_SCHEMA,
        "label": args.label,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": describe_machine(),
        "config": {
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "model": outcome.model,
            "dataset_name": args.dataset_name,
            "dataset_path": str(args.dataset_path) if args.dataset_path else None,
            "input_len": args.input_len if args.dataset_name == "synthetic" else None,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "warmup": args.warmup,
            "request_rate": _json_rate(args.request_rate),
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "extra_body": args.extra_body,
        },
        "summary": summarize(outcome.records, outcome.duration_s, slos),
        "spec_decode": outcome.spec_decode,
        "requests": [record.to_dict() for record in outcome.records],
    }


def result_stem(result: dict) -> str:
    config = result["config"]
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", result["label"])
    stamp = datetime.fromisoformat(result["timestamp"]).strftime("%Y%m%dT%H%M%SZ")
    return (f"{label}-{config['endpoint']}-rate{config['request_rate']}"
            f"-conc{config['max_concurrency'] or 'inf'}-{stamp}")


def write_results(result: dict, result_dir: Path) -> tuple[Path, Path]:
    """``<stem>.json`` with everything and ``<stem>.csv`` with one row per request."""
    result_dir.mkdir(parents=True, exist_ok=True)
    stem, suffix = result_stem(result), 1
    while (result_dir / f"{stem}.json").exists():
        suffix += 1
        stem = f"{result_stem(result)}-{suffix}"
    json_path, csv_path = result_dir / f"{stem}.json", result_dir / f"{stem}.csv"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["index", "success", "start_s", "ttft_ms", "tpot_ms", "e2e_ms", "prompt_tokens",
                         "output_tokens", "text_chunks", "mean_itl_ms", "error"])
        for index, request in enumerate(result["requests"]):
            itl = request["itl"]
            writer.writerow([
                index, request["success"], _round(request["start"]), _ms(request["ttft"]),
                _ms(request["tpot"]), _ms(request["e2e"]), request["prompt_tokens"],
                request["output_tokens"], len(itl) + 1 if request["ttft"] is not None else 0,
                _ms(sum(itl) / len(itl)) if itl else "", request["error"],
            ])
    return json_path, csv_path


def _ms(seconds: Optional[float]) -> str:
    return "" if seconds is None else f"{1000 * seconds:.3f}"


def _round(value: float) -> str:
    return f"{value:.6f}"


def format_table(result: dict) -> str:
    summary, config, spec = result["summary"], result["config"], result["spec_decode"]

    def value(number, digits=2):
        return "n/a" if number is None else f"{number:.{digits}f}"

    rows = [
        ("Label", result["label"]),
        ("Endpoint", f"{config['base_url']} ({config['endpoint']}, model {config['model']})"),
        ("Request rate (req/s) / max concurrency",
         f"{config['request_rate']} / {config['max_concurrency'] or 'unlimited'}"),
        ("Successful requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Benchmark duration (s)", value(summary["duration_s"])),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total generated tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", value(summary["request_throughput"])),
        ("Output token throughput (tok/s)", value(summary["output_throughput"])),
        ("Total token throughput (tok/s)", value(summary["total_token_throughput"])),
    ]
    if summary["slos_ms"]:
        slos = " ".join(f"{name}<={bound:g}ms" for name, bound in summary["slos_ms"].items())
        rows.append((f"Goodput (req/s) [{slos}]", value(summary["goodput"])))
    if spec:
        rows.append(("Mean acceptance length", value(spec["mean_acceptance_length"])))
        rows.append(("Draft acceptance rate", value(spec["draft_acceptance_rate"], 3)))
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        stats = summary[key]
        rows += [(f"{name} {title} (ms)", value(stats[name.lower()])) for name in ("Mean", "Median", "P99")]
    width = max(len(name) for name, _ in rows) + 2
    lines = ["=" * 20 + " Serving benchmark " + "=" * 20]
    lines += [f"{name + ':':<{width}}{cell}" for name, cell in rows]
    if not summary["token_counts_from_usage"]:
        lines.append("warning: the server sent no usage block; token counts are chunk counts")
    for error, count in summary["errors"].items():
        lines.append(f"error x{count}: {error}")
    lines.append("=" * 59)
    return "\n".join(lines)


def json_object(text: str) -> dict:
    """argparse type for ``--extra-body``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"top_p\": 0.9}'")
    return value


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hetero-bench-serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    target = parser.add_argument_group("endpoint")
    target.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI API root, ending in /v1")
    target.add_argument("--model", help="model name to request (default: the first one /v1/models lists)")
    target.add_argument("--api-key", help="bearer token; when absent, $OPENAI_API_KEY is used if set")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    data = parser.add_argument_group("prompts")
    data.add_argument("--dataset-name", choices=("synthetic", "sharegpt", "jsonl"),
                      help="default: synthetic, or inferred from --dataset-path (.jsonl = jsonl, else sharegpt)")
    data.add_argument("--dataset-path", type=Path, help="ShareGPT JSON or JSONL of {\"prompt\": ...}")
    data.add_argument("--input-len", type=int, default=128, help="synthetic prompt length (words or token ids)")
    data.add_argument("--output-len", type=int,
                      help=f"tokens to generate (default: {DEFAULT_OUTPUT_LEN}; ShareGPT: the reply's estimated length)")
    data.add_argument("--vocab-size", type=int,
                      help="synthetic prompts of random token ids below this (completions only) instead of words")
    data.add_argument("--num-prompts", type=int, default=100)
    data.add_argument("--seed", type=int, default=0)
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="Poisson arrivals per second; inf sends everything at once")
    load.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    load.add_argument("--warmup", type=int, default=2, help="unmeasured requests sent first")
    load.add_argument("--request-timeout", type=float, default=600.0,
                      help="seconds to wait for the response or its next chunk")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/hetero extension)")
    sampling.add_argument("--extra-body", type=json_object, default={}, help="JSON object merged into every request")
    out = parser.add_argument_group("results")
    out.add_argument("--label", default="run", help="configuration name: plain, lookahead, cpu-draft, vllm, ...")
    out.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 e2e:10000")
    out.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    out.add_argument("--disable-tqdm", action="store_true")
    args = parser.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY")
    if args.dataset_name is None:
        args.dataset_name = ("synthetic" if args.dataset_path is None
                             else "jsonl" if args.dataset_path.suffix == ".jsonl" else "sharegpt")
    if args.dataset_name != "synthetic" and args.dataset_path is None:
        parser.error(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "synthetic" and args.dataset_path is not None:
        parser.error("--dataset-path is not used by synthetic prompts; pass --dataset-name sharegpt or jsonl")
    if args.vocab_size is not None and args.endpoint == "chat":
        parser.error("--vocab-size (token-id prompts) works with --endpoint completions only")
    for name in ("num_prompts", "input_len", "output_len", "max_concurrency", "vocab_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        parser.error("--warmup must be zero or more")
    if not args.request_rate > 0:
        parser.error("--request-rate must be positive (inf for all at once)")
    try:
        args.slos = parse_slos(args.goodput)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def redacted_command(argv: Sequence[str]) -> str:
    """The command line as run, with the API key's value hidden (results get shared)."""
    shown, hide_next = [], False
    for arg in argv:
        if hide_next:
            shown.append("***")
            hide_next = False
        elif arg == "--api-key":
            shown.append(arg)
            hide_next = True
        elif arg.startswith("--api-key="):
            shown.append("--api-key=***")
        else:
            shown.append(arg)
    return shlex.join(["hetero-bench-serve", *shown])


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    args = parse_args(argv)
    command = redacted_command(argv)
    rng = random.Random(args.seed)
    try:
        prompts = build_prompts(args, rng)
        offsets = arrival_offsets(args.num_prompts, args.request_rate, rng)
        outcome = asyncio.run(run_benchmark(args, prompts, offsets))
    except (DatasetError, BenchmarkError) as exc:
        print(f"hetero-bench-serve: error: {exc}", file=sys.stderr)
        return 2
    result = build_result(args, command, outcome, args.slos)
    json_path, csv_path = write_results(result, args.result_dir)
    print(format_table(result))
    print(f"results: {json_path} {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
