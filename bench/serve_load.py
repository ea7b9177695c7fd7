"""Load check of `hetero serve`: many concurrent streaming clients on loopback (issue #28).

Starts `hetero serve MODEL` in a subprocess on 127.0.0.1, warms it up, then opens
``--clients`` streaming completions at once (each bounded by ``--max-tokens`` and the run by
``--timeout``) and checks what a server under load must keep: every stream ends with
``data: [DONE]`` and carries no error chunk, the running/waiting gauges on /metrics return
to 0, and the server's resident memory (VmRSS, sampled throughout) before and after each of
``--rounds`` rounds (memory that keeps growing round after round would be a leak; a first
round's growth that later rounds do not repeat is the allocator keeping freed pages).

Prints a table and writes ``<result-dir>/serve_load-<label>-<timestamp>.json`` (command,
machine, settings, summary).

    python -m bench.serve_load --model SmolLM2-135M-Instruct --clients 500 --max-tokens 16 \\
        --label vm -- --max-model-len 512 --kv-cache-space 1
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import httpx

from bench._machine import describe_machine
from bench._prometheus import parse_prometheus_text

GAUGES = ("hetero:num_requests_running", "hetero:num_requests_waiting")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> Optional[float]:
    """The process's resident set (VmRSS) in MiB, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


class RssSampler:
    """Samples a process's VmRSS on a thread every `interval` s and keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.pid, self.interval, self.peak = pid, interval, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib(self.pid) or 0.0)
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def one_stream(http: httpx.AsyncClient, index: int, max_tokens: int) -> dict:
    body = {"prompt": f"Request {index}: write a short line about the sea.", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    first = None
    events, done, errors = 0, False, []
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False, "done": False, "error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        errors.append(chunk["error"]["message"])
                    events += 1
                    first = first or time.perf_counter()
    except httpx.HTTPError as exc:
        return {"ok": False, "done": done, "error": repr(exc)}
    ended = time.perf_counter()
    return {"ok": done and not errors, "done": done, "error": "; ".join(errors) or None, "events": events,
            "ttft_s": (first - started) if first else None, "e2e_s": ended - started}


async def run_clients(base_url: str, clients: int, max_tokens: int, timeout: float) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:
        started = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(one_stream(http, i, max_tokens) for i in range(clients))), timeout=timeout
        )
        return list(results), time.perf_counter() - started


def gauges(base_url: str) -> dict[str, float]:
    values = parse_prometheus_text(httpx.get(base_url + "/metrics", timeout=10).text)
    return {name: values.get(name, 0.0) for name in GAUGES}


def wait_healthy(base_url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"hetero serve exited with code {process.returncode} while starting")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"hetero serve was not healthy within {timeout} s")


def percentile(values: list[float], q: float) -> Optional[float]:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def round_summary(results: list[dict], duration: float, gauges_after: dict[str, float],
                  rss_before: Optional[float], rss_peak: float, rss_after: Optional[float]) -> dict:
    ttfts = [r["ttft_s"] for r in results if r.get("ttft_s") is not None]
    e2es = [r["e2e_s"] for r in results if r.get("e2e_s") is not None]
    return {
        "clients": len(results),
        "completed_with_done": sum(r["ok"] for r in results),
        "failed": [r["error"] for r in results if not r["ok"]][:10],
        "duration_s": round(duration, 2),
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "e2e_p50_s": percentile(e2es, 0.5), "e2e_p99_s": percentile(e2es, 0.99),
        "gauges_after": gauges_after,
        "rss_mib_before": rss_before, "rss_mib_peak": round(rss_peak, 1), "rss_mib_after": rss_after,
    }


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="what `hetero serve` is given")
    parser.add_argument("--clients", type=int, default=500, help="concurrent streaming requests")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of --clients streams, one after another")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one round may take")
    parser.add_argument("--label", default="run")
    parser.add_argument("--result-dir", default="bench/results")
    parser.add_argument("serve_args", nargs="*", help="extra `hetero serve` flags (after --)")
    args = parser.parse_args(argv)

    machine = describe_machine()  # before the server starts: the commit it runs
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "hetero.cli", "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
               "--uvicorn-log-level", "warning", *args.serve_args]
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the server
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        wait_healthy(base_url, process, timeout=600)
        asyncio.run(run_clients(base_url, 4, args.max_tokens, args.timeout))  # warm-up: first-use allocations
        rounds = []
        for _ in range(args.rounds):
            rss_before = rss_mib(process.pid)
            with RssSampler(process.pid) as sampler:
                results, duration = asyncio.run(run_clients(base_url, args.clients, args.max_tokens, args.timeout))
            time.sleep(1.0)
            rounds.append(round_summary(results, duration, gauges(base_url), rss_before, sampler.peak, rss_mib(process.pid)))
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.seek(0)
        stderr = log.read()
        log.close()

    print(f"{'round':>5} {'clients':>8} {'[DONE]':>7} {'failed':>7} {'seconds':>8} {'ttft p50':>9} {'e2e p99':>8} "
          f"{'running':>8} {'waiting':>8} {'RSS MiB before/peak/after':>26}")
    for index, r in enumerate(rounds):
        print(f"{index + 1:>5} {r['clients']:>8} {r['completed_with_done']:>7} {r['clients'] - r['completed_with_done']:>7} "
              f"{r['duration_s']:>8.1f} {r['ttft_p50_s'] or 0:>9.2f} {r['e2e_p99_s'] or 0:>8.2f} "
              f"{r['gauges_after'][GAUGES[0]]:>8g} {r['gauges_after'][GAUGES[1]]:>8g} "
              f"{r['rss_mib_before']:>8.0f} / {r['rss_mib_peak']:.0f} / {r['rss_mib_after']:.0f}")
    record = {
        "command": shlex.join([sys.executable, "-m", "bench.serve_load", *(argv if argv is not None else sys.argv[1:])]),
        "server_command": shlex.join(command[1:]),
        "machine": machine,
        "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rounds": rounds,
        "server_exit_code": process.returncode,
        "server_log_tail": stderr.splitlines()[-20:],
    }
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"serve_load-{args.label}-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    if any(r["completed_with_done"] != args.clients or any(r["gauges_after"].values()) for r in rounds):
        raise SystemExit(1)
    return record


if __name__ == "__main__":
    main()
