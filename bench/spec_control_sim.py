"""Closed batches through the real speculation controller, on a clock fitted to the GPU host.

`bench.gpu_decode` measures the controller on the GPU host, one run per point; its closed
batches end with their slowest sequence, so a point's outcome swings with a few sequences'
luck (batch 8 at p = 0.3: 0.91x to 1.15x between calls). This replays the same runs many
times over on a CPU: the `SpeculationController` (with its `TreeSizer` and each sequence's
`DraftBackoff`) decides every step as in `LLMEngine.step`, a chain oracle's drafts are right
with probability p, and each step costs what the GPU host measured for Llama-3-8B shapes
(bench/results/gpu_decode-20261123-164321: plain token-steps in windows of 8, a speculative
step's fixed host cost and its cost per query row). The model of the engine is kept small:
a plain window's steps, trees cut to each sequence's room, steps cut short left unrecorded.

Each point runs `--repeats` closed batches of plain and speculative decoding, alternating,
with one controller learning across them (as `bench.gpu_decode`'s spec section does), over
`--seeds` seeds; it reports the median and worst speedup over the seeds, and the speedup of
speculating at every step for reference. ``--mixed SHARE,FACTOR``: that share of the
sequences draft worse, right with probability p * FACTOR (prompts unlike their drafter).

    python -m bench.spec_control_sim --out bench/results
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from hetero.spec.controller import cut_short
from hetero.spec.backoff import DraftBackoff
from hetero.spec.controller import SpeculationController
from hetero.spec.draining import DrainingBatch

QUERY_BUCKETS = (1, 2, 4, 8, 9)  # the engine's CUDA-graph query ladder at 8 nodes per sequence
MAX_NODES = 8
TARGET_PARALLELISM = 512
SCHEDULER_STEPS = 8
# GPU host, Llama-3-8B shapes (gpu_decode-20261123-164321): ms per plain token-step by batch size
# (windows of 8), and a speculative step's host cost beyond its forward (proposing, verifying).
BATCHES = (1, 8, 32, 64)
PLAIN_STEP_MS = (5.81, 6.15, 6.56, 7.41)
SPEC_HOST_MS = (0.73, 0.76, 2.5, 2.45)
WINDOW_HOST_MS = 0.3
JITTER = 0.02  # step times vary uniformly by this share


def plain_step_ms(batch: int) -> float:
    return float(np.interp(batch, BATCHES, PLAIN_STEP_MS))


def spec_step_ms(batch: int, nodes: int) -> float:
    """A token-step plus each further query row's cost (the `TreeSizer`'s fit) plus the host's share."""
    rows = next((q for q in QUERY_BUCKETS if q > nodes), nodes + 1)
    row_cost = min(batch * 0.004, 0.05)
    return plain_step_ms(batch) * (1 + row_cost * (rows - 1)) + float(np.interp(batch, BATCHES, SPEC_HOST_MS))


class AlwaysSpeculate(SpeculationController):
    """Speculates at every step with the trees the controller would size: the reference."""

    def _speculates(self, num_seqs: int, explore: bool, draining: bool) -> bool:
        return True


@dataclass
class Workload:
    p: float  # each draft token right with this probability
    mixed_share: float = 0.0  # share of the sequences whose drafts are right with probability p * mixed_factor
    mixed_factor: float = 1.0


def closed_batch_ms(controller, batch: int, new_tokens: int, workload: Workload, rng: random.Random,
                    speculate: bool = True) -> float:
    """Milliseconds to decode one closed batch (every sequence `new_tokens` long, the first from prefill)."""
    rooms = [new_tokens - 1] * batch
    trees, accepted, squared = [0] * batch, [0] * batch, [0] * batch
    backoffs = [DraftBackoff() for _ in range(batch)]
    right = [workload.p * (workload.mixed_factor if rng.random() < workload.mixed_share else 1.0) for _ in range(batch)]
    elapsed = 0.0
    while True:
        active = [i for i in range(batch) if rooms[i] > 0]
        if not active:
            return elapsed
        room = [rooms[i] for i in active]
        nodes = 0
        if speculate:
            draining = DrainingBatch(room, [trees[i] for i in active], [accepted[i] for i in active],
                                     [squared[i] for i in active])
            nodes = controller.nodes_per_sequence(len(active), draining=draining)
        budgets = {}
        for i in active if nodes else ():
            budget = max(0, min(nodes, rooms[i] - 1))
            if budget and backoffs[i].grants_tree():
                budgets[i] = budget
        jitter = rng.uniform(1 - JITTER, 1 + JITTER)
        if budgets:
            emitted, sizes, counts = 0, [], []
            for i in active:
                took = 0
                while took < budgets.get(i, 0) and rng.random() < right[i]:
                    took += 1
                if i in budgets:
                    sizes.append(budgets[i])
                    counts.append(took)
                    backoffs[i].record(took)
                    trees[i] += 1
                    accepted[i] += took
                    squared[i] += took * took
                rooms[i] -= 1 + took
                emitted += 1 + took
            controller.record_acceptance(sizes, counts)
            step = spec_step_ms(len(active), nodes) * jitter
            if not cut_short(room, nodes + 1):
                controller.record_step(len(active), True, emitted, step / 1e3)
        else:
            steps = min(SCHEDULER_STEPS, max(room))
            emitted = sum(min(steps, r) for r in room)
            for i in active:
                rooms[i] -= min(steps, rooms[i])
            step = steps * plain_step_ms(len(active)) * jitter + WINDOW_HOST_MS
            if speculate and not cut_short(room, SCHEDULER_STEPS):
                controller.record_step(len(active), False, emitted, step / 1e3)
        elapsed += step


def speedups(controller_class, batch: int, workload: Workload, seed: int, new_tokens: int, repeats: int) -> float:
    """Median over `repeats` alternating plain and speculative runs of plain's time over speculation's."""
    rng = random.Random(seed)
    controller = controller_class(MAX_NODES, TARGET_PARALLELISM, query_buckets=QUERY_BUCKETS)
    ratios = []
    for _ in range(repeats):
        plain = closed_batch_ms(controller, batch, new_tokens, workload, rng, speculate=False)
        ratios.append(plain / closed_batch_ms(controller, batch, new_tokens, workload, rng))
    return statistics.median(ratios)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--batches", default="1,4,8,16,32,64")
    parser.add_argument("--draft-p", default="0.0,0.2,0.3,0.4,0.6,0.9")
    parser.add_argument("--mixed", default="0,1;0.25,0.3", help="SHARE,FACTOR workloads, ';'-separated")
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    rows = []
    for mixed in args.mixed.split(";"):
        share, factor = (float(x) for x in mixed.split(","))
        for batch in (int(b) for b in args.batches.split(",")):
            for p in (float(x) for x in args.draft_p.split(",")):
                workload = Workload(p, share, factor)
                runs = sorted(speedups(SpeculationController, batch, workload, seed, args.new_tokens, args.repeats)
                              for seed in range(args.seeds))
                always = statistics.median(speedups(AlwaysSpeculate, batch, workload, seed, args.new_tokens, args.repeats)
                                           for seed in range(args.seeds))
                rows.append(dict(mixed=f"{share:g} at {factor:g}p", batch=batch, draft_p=p,
                                 speedup=round(statistics.median(runs), 3), worst=round(runs[0], 3),
                                 always_speculating=round(always, 3)))
                print(rows[-1], flush=True)
    command = "python -m bench.spec_control_sim " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = dict(describe_machine(), python=platform.python_version())
    stem = os.path.join(args.out, f"spec_control_sim-{time.strftime('%Y%m%d-%H%M%S')}")
    body = ["speedup: median over the seeds of each seed's median closed-batch speedup; worst: the lowest seed.",
            "", *markdown_table(rows)]
    print(write_markdown_and_json(stem, "Speculation controller in closed batches, GPU host clock", command, machine, rows, body))


if __name__ == "__main__":
    main()
