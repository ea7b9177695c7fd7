"""Batch-1 projections of Llama-3-8B: cuBLAS (F.linear) vs hetero's Triton GEMV, side by side.

Each call reads a different copy of the weight (enough copies to exceed L2), inside one
CUDA graph, so the time is the kernel's own HBM streaming plus its in-graph launch.
``--sweep`` also times a grid of GEMV tiles, to show where the default tile comes from.

    python -m bench.gemv --out bench/results [--sweep]
"""
from __future__ import annotations

import argparse
import itertools
import platform
import sys
import time

import torch
import torch.nn.functional as F

from bench._cuda_timing import median_replay_ms
from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from gpu_target.gemv import gemv

SHAPES = dict(qkv_proj=(6144, 4096), o_proj=(4096, 4096), gate_up_proj=(28672, 4096), down_proj=(4096, 14336),
              lm_head=(128256, 4096))
SWEEP = dict(block_n=[1, 2, 4, 8], block_k=[512, 1024, 2048, 4096], num_warps=[4, 8], num_stages=[1, 3])


def time_per_call_us(call, num_copies: int, calls_per_copy: int = 20) -> float:
    """Median over 5 replays of a graph of `calls_per_copy` rounds over the weight copies."""
    call(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls_per_copy * num_copies):
            call(i % num_copies)
    return median_replay_ms(graph, 5) * 1e3 / (calls_per_copy * num_copies)


def bench_shape(name: str, n: int, k: int, dtype: torch.dtype, sweep: bool) -> list[dict]:
    copies = max(2, int(2e9 // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    gigabytes = n * k * x.element_size() / 1e9
    reference = F.linear(x, weights[0]).float()
    cublas_us = time_per_call_us(lambda i: F.linear(x, weights[i]), copies)
    tiles = [dict(zip(SWEEP, values)) for values in itertools.product(*SWEEP.values())] if sweep else [{}]
    rows = []
    for tile in tiles:
        if tile.get("block_n", 1) * tile.get("block_k", 1) > 8192:
            continue
        out = gemv(x, weights[0], **tile).float()
        gemv_us = time_per_call_us(lambda i: gemv(x, weights[i], **tile), copies)
        rows.append(dict(shape=name, n=n, k=k, tile=" ".join(f"{key}={v}" for key, v in tile.items()) or "default",
                         cublas_us=round(cublas_us, 2), cublas_TBps=round(gigabytes / cublas_us * 1e3, 2),
                         gemv_us=round(gemv_us, 2), gemv_TBps=round(gigabytes / gemv_us * 1e3, 2),
                         speedup=round(cublas_us / gemv_us, 3),
                         max_rel_err=f"{((out - reference).abs().max() / reference.abs().max()).item():.1e}"))
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of GEMV tiles")
    args = parser.parse_args(argv)
    rows = []
    for name, (n, k) in SHAPES.items():
        rows += bench_shape(name, n, k, torch.bfloat16, sweep=False)
    body = ["## default tile, bf16", "", *markdown_table(rows), ""]
    if args.sweep:
        best = []
        for name, (n, k) in SHAPES.items():
            swept = bench_shape(name, n, k, torch.bfloat16, sweep=True)
            best += sorted(swept, key=lambda r: r["gemv_us"])[:3]
        body += ["## sweep: the three fastest tiles per shape", "", *markdown_table(best), ""]
    info = dict(describe_machine(), torch=torch.__version__, gpu=torch.cuda.get_device_name(), python=platform.python_version())
    command = "python -m bench.gemv " + " ".join(sys.argv[1:])
    stem = f"{args.out}/gemv-{time.strftime('%Y%m%d-%H%M%S')}"
    print(write_markdown_and_json(stem, "Batch-1 GEMV vs cuBLAS", command, info, rows, body))


if __name__ == "__main__":
    main()
