"""Round-trip latency of one small message over an ``ipc.Channel`` between two processes.

The owner sends a token tree's worth of arrays (64 int64 token ids + 64 int32 parents) to
an echo worker in its own (spawned) process, which sends them straight back; one sample is
the time from before ``send`` to after ``recv`` returns. Each ``--spin-us`` value is one
run: both sides spin that long before sleeping on their ZeroMQ doorbell, so 0 measures the
doorbell path alone. Target on the GPU host: p99 <= 50 us with spin-then-sleep.

It also times one ``send`` and one ``recv`` of the same message with both ends in this
process, where nothing ever waits: the Python work per message, which a round trip pays
four times.

    python -m bench.ipc_latency [--iterations 20000] [--spin-us 200 0] [--pin 0,1]

Prints a table and writes ``bench/results/ipc_latency-<hostname>.csv`` (one row per run,
with the exact command and the machine).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from bench._machine import describe_machine
from bench._report import write_csv_with_context
from ipc import Channel

STOP = -1
TREE_NODES = 64
TARGET_P99_US = 50.0
RESULTS_DIR = Path(__file__).resolve().parent / "results"
PERCENTILES = {"p50_us": 50, "p90_us": 90, "p99_us": 99, "p99.9_us": 99.9}


def tree_message() -> dict[str, np.ndarray]:
    return {
        "tokens": np.arange(TREE_NODES, dtype=np.int64),
        "parents": np.arange(-1, TREE_NODES - 1, dtype=np.int32),
    }


def echo_worker(spec, cpu: Optional[int]) -> None:
    """Peer process: send every message straight back until STOP."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    with Channel.attach(spec) as channel:
        while True:
            msg = channel.recv(timeout=60)
            if msg.kind == STOP:
                return
            channel.send(msg.kind, msg.arrays, timeout=60)


def measure_round_trips(spin_s: float, iterations: int, warmup: int, cpus: Optional[tuple[int, int]]) -> np.ndarray:
    """Round-trip times in nanoseconds of ``iterations`` messages after ``warmup`` unrecorded ones."""
    if cpus is not None:
        os.sched_setaffinity(0, {cpus[0]})
    channel = Channel.create("hetero-bench", num_slots=4, slot_bytes=4096, spin_s=spin_s)
    worker = multiprocessing.get_context("spawn").Process(target=echo_worker, args=(channel.spec, cpus and cpus[1]))
    worker.start()
    try:
        arrays = tree_message()
        samples = np.empty(iterations, dtype=np.int64)
        for i in range(warmup + iterations):
            started = time.perf_counter_ns()
            channel.send(i, arrays, timeout=60)
            channel.recv(timeout=60)
            if i >= warmup:
                samples[i - warmup] = time.perf_counter_ns() - started
        channel.send(STOP, {}, timeout=60)
        worker.join(timeout=60)
        return samples
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()
        channel.close()


def measure_message_costs(iterations: int, warmup: int) -> dict[str, float]:
    """Median microseconds of one ``send`` and one ``recv`` (each with one clock read) with both ends in this process."""
    owner = Channel.create("hetero-bench", num_slots=4, slot_bytes=4096)
    peer = Channel.attach(owner.spec)
    try:
        arrays = tree_message()
        send_ns = np.empty(iterations, dtype=np.int64)
        recv_ns = np.empty(iterations, dtype=np.int64)
        for i in range(warmup + iterations):
            started = time.perf_counter_ns()
            owner.send(i, arrays)
            sent = time.perf_counter_ns()
            peer.recv()
            if i >= warmup:
                send_ns[i - warmup] = sent - started
                recv_ns[i - warmup] = time.perf_counter_ns() - sent
    finally:
        peer.close()
        owner.close()
    return {"send_median_us": float(np.median(send_ns)) / 1e3, "recv_median_us": float(np.median(recv_ns)) / 1e3}


def summarize(samples_ns: np.ndarray) -> dict[str, float]:
    """Latency percentiles, mean and max in microseconds."""
    us = samples_ns / 1e3
    summary = {name: float(np.percentile(us, q)) for name, q in PERCENTILES.items()}
    summary.update(mean_us=float(us.mean()), max_us=float(us.max()))
    return summary


def format_table(rows: Sequence[dict]) -> str:
    columns = ["spin_us", *PERCENTILES, "mean_us", "max_us"]
    lines = ["  ".join(f"{c:>9}" for c in columns) + "  p99<=50us"]
    for row in rows:
        cells = [f"{row[c]:>9.1f}" for c in columns]
        lines.append("  ".join(cells) + ("  yes" if row["p99_us"] <= TARGET_P99_US else "  no"))
    return "\n".join(lines)


def parse_cpus(text: Optional[str]) -> Optional[tuple[int, int]]:
    if text is None:
        return None
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"--pin takes two CPU numbers like 0,1, got {text!r}")
    return int(parts[0]), int(parts[1])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20000, help="measured round trips per run")
    parser.add_argument("--warmup", type=int, default=2000, help="unrecorded round trips before measuring")
    parser.add_argument("--spin-us", type=float, nargs="+", default=[200.0, 0.0], help="spin time before sleeping; one run each")
    parser.add_argument("--pin", type=parse_cpus, default=None, help="pin owner and worker to these CPUs, e.g. 0,1")
    parser.add_argument("--out", type=Path, default=None, help="CSV path (default bench/results/ipc_latency-<hostname>.csv)")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0 or any(s < 0 for s in args.spin_us):
        parser.error("--iterations must be >= 1, --warmup and --spin-us >= 0")

    machine = describe_machine()
    command = shlex.join([Path(sys.executable).name, "-m", "bench.ipc_latency", *(argv if argv is not None else sys.argv[1:])])
    rows = []
    for spin_us in args.spin_us:
        samples = measure_round_trips(spin_us / 1e6, args.iterations, args.warmup, args.pin)
        rows.append({"spin_us": spin_us, **summarize(samples)})
    costs = measure_message_costs(args.iterations, args.warmup)
    print(f"ipc round trip, {TREE_NODES} int64 tokens + {TREE_NODES} int32 parents, {args.iterations} samples each")
    print(f"machine: {machine['hostname']}, {machine['cpu_model']}, {machine['cpu_count']} CPUs, pinned: {args.pin}")
    print(format_table(rows))
    print(f"per message in one process, nothing waiting (median): send {costs['send_median_us']:.2f} us, recv {costs['recv_median_us']:.2f} us")

    out = args.out or RESULTS_DIR / f"ipc_latency-{machine['hostname']}.csv"
    extra = {
        "iterations": args.iterations,
        "warmup": args.warmup,
        "pinned": "" if args.pin is None else f"{args.pin[0]},{args.pin[1]}",
        **costs,
        "command": command,
        "hostname": machine["hostname"],
        "cpu_model": machine["cpu_model"],
        "cpu_count": machine["cpu_count"],
        "python": machine["python"],
        "hetero_commit": machine["hetero_commit"],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_csv_with_context(out, rows, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
