"""Prompt prefill of the CPU drafter by forward size: prompt tokens per second and the longest forward.

The draft worker prefills a new request's prompt in forwards of
``DraftModelOptions.prefill_forward_tokens`` tokens (shared among the prompts of a batch) and
looks for the coordinator's next message between them. A larger forward keeps the cores
busier per weight read; a message that arrives meanwhile waits for the forward to end, so the
longest forward is what a proposal can be held up by. Each row prefills ``batch`` random
prompts of ``--prompt-tokens`` tokens from an empty cache (the best of ``--repeats``).

    python -m bench.cpu_draft_prefill --random-shape 576,8,9,3,1536,128256 --draft-vocab 32768 --precisions int8 \\
        --batch-sizes 1 8 --prompt-tokens 128 --forward-tokens 32 64 128 256 --cpus 2-15

Prints a table and writes ``bench/results/cpu_draft_prefill-<hostname>.csv`` with the exact command and the machine.
"""
from __future__ import annotations

import argparse
import itertools
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from bench._machine import describe_machine
from bench._report import write_csv_with_context
from bench.cpu_draft import PRECISIONS, RESULTS_DIR, load_drafter
from cpu_draft.affinity import default_draft_cpus, pin_current_process
from cpu_draft.drafter import Drafter
from hetero.core.config import DraftConfig


def time_prefill(drafter: Drafter, batch_size: int, prompt_tokens: int, repeats: int) -> tuple[float, float]:
    """Seconds to prefill ``batch_size`` fresh prompts, and the longest forward among them (best of ``repeats``)."""
    rng = np.random.default_rng(0)
    best_total, best_longest = float("inf"), float("inf")
    for _ in range(repeats):
        seq_ids = [f"s{b}" for b in range(batch_size)]
        for seq_id in seq_ids:
            drafter.set_context(seq_id, rng.integers(0, drafter.vocab_size, prompt_tokens).tolist())
        stamps = [time.perf_counter()]
        done = drafter.prefill(seq_ids, interrupt=lambda: stamps.append(time.perf_counter()) and False)
        stamps.append(time.perf_counter())
        drafter.release_all()
        if not done:
            raise RuntimeError(f"the drafter had no KV room for {batch_size} prompts of {prompt_tokens} tokens")
        best_total = min(best_total, stamps[-1] - stamps[0])
        best_longest = min(best_longest, float(np.diff(stamps).max()))
    return best_total, best_longest


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_draft_prefill", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="draft checkpoint (HF dir or GGUF)")
    parser.add_argument("--random-shape", default=None, help="random weights of this shape instead (as bench.cpu_draft)")
    parser.add_argument("--draft-vocab", type=int, default=None, help="the draft head's reduced vocabulary")
    parser.add_argument("--precisions", nargs="+", default=["int8"], choices=list(PRECISIONS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--forward-tokens", nargs="+", type=int, default=[32, 64, 128, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpus", default=None, help="cores to pin to, e.g. 2-15 (default: DraftConfig.cpus)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None, help="CSV path, or a directory (default bench/results)")
    args = parser.parse_args(argv)
    args.pack_linears = True  # as bench.cpu_draft's default, which `load_drafter` reads
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    command = shlex.join([Path(sys.executable).name, "-m", "bench.cpu_draft_prefill", *(argv if argv is not None else sys.argv[1:])])
    cpus = default_draft_cpus(args.cpus if args.cpus is not None else DraftConfig().cpus)
    threads = pin_current_process(cpus, args.threads)
    machine = describe_machine()
    print(f"cpus {cpus}, {threads} threads; prompts of {args.prompt_tokens} tokens")
    print(f"{'precision':>9} {'batch':>5} {'forward tokens':>14} {'prefill ms':>10} {'us/token':>8} {'longest forward ms':>18}")
    rows = []
    for precision, forward_tokens in itertools.product(args.precisions, args.forward_tokens):
        dtype, int8 = PRECISIONS[precision]
        drafter = load_drafter(args, dtype, int8, max(args.batch_sizes), "slots", prefill_forward_tokens=forward_tokens)
        for batch_size in args.batch_sizes:
            total, longest = time_prefill(drafter, batch_size, args.prompt_tokens, args.repeats)
            row = {"precision": precision, "batch_size": batch_size, "forward_tokens": forward_tokens,
                   "prompt_tokens": args.prompt_tokens, "prefill_ms": round(1e3 * total, 2),
                   "us_per_token": round(1e6 * total / (batch_size * args.prompt_tokens), 1),
                   "longest_forward_ms": round(1e3 * longest, 2), "native": drafter.kv.native}
            rows.append(row)
            print(f"{precision:>9} {batch_size:>5} {forward_tokens:>14} {row['prefill_ms']:>10.2f} {row['us_per_token']:>8.1f} "
                  f"{row['longest_forward_ms']:>18.2f}")
        del drafter
    extra = {"model": f"random[{args.random_shape}]" if args.random_shape else args.model, "draft_vocab": args.draft_vocab,
             "cpus": ",".join(map(str, cpus)), "threads": threads, "command": command, "hostname": machine["hostname"],
             "cpu_model": machine["cpu_model"], "hetero_commit": machine["hetero_commit"],
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    out = args.out or RESULTS_DIR
    if out.is_dir():
        out = out / f"cpu_draft_prefill-{machine['hostname']}.csv"
    write_csv_with_context(out, rows, extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
