"""Small-M projections of Llama-3-8B: cuBLAS (F.linear) vs hetero's weight-streaming `linear`.

For each row count M in ``--rows`` (1 = batch-1 decode, 1 + tree nodes = batch-1
verification, 65 = past the streaming kernels, a sanity row where both sides are cuBLAS)
and each projection, times `gpu_target.gemv.linear` (M = 1: the GEMV, 2..64: the skinny
GEMM) against F.linear, and reports microseconds, TB/s of weight bytes and the speed-up.

Each call reads a different copy of the weight (enough copies to exceed L2), inside one
CUDA graph, so the time is the kernel's own HBM streaming plus its in-graph launch.
``--sweep`` also times grids of tiles, to show where the defaults come from: the GEMV's
at M = 1 and the skinny GEMM's at M = 17 and 64 (``--sweep gemv`` or ``--sweep skinny``
for one of them).

    python -m bench.gemv --out bench/results [--rows 1,9,17,33,64,65] [--sweep [gemv|skinny]]
"""
from __future__ import annotations

import argparse
import itertools
import platform
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from bench._cuda_timing import median_replay_ms
from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from gpu_target.gemv import MAX_STREAMING_ROWS, gemv, linear, skinny_block_m, skinny_gemm

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # no Triton: --help still works, and there is nothing to time
    OutOfResources = RuntimeError

SHAPES = dict(qkv_proj=(6144, 4096), o_proj=(4096, 4096), gate_up_proj=(28672, 4096), down_proj=(4096, 14336),
              lm_head=(128256, 4096))
DEFAULT_ROWS = "1,9,17,33,64,65"
GEMV_SWEEP = dict(block_n=[1, 2, 4, 8], block_k=[512, 1024, 2048, 4096], num_warps=[4, 8], num_stages=[1, 3])
SKINNY_SWEEP = [dict(w_first=[False], block_n=[16, 32, 64], block_k=[256, 512, 1024], num_warps=[4], num_stages=[2, 3, 4]),
                dict(w_first=[True], block_n=[64, 128], block_k=[128, 256, 512], num_warps=[4, 8], num_stages=[3, 4, 5])]
SKINNY_SWEEP_ROWS = (17, 64)
SHARED_MEMORY_BYTES = 227 * 1024  # an H100's per-block limit; tiles that cannot fit are not compiled


def time_per_call_us(call: Callable[[int], object], num_copies: int, calls_per_copy: int = 20) -> float:
    """Median over 5 replays of a graph of `calls_per_copy` rounds over the weight copies."""
    call(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls_per_copy * num_copies):
            call(i % num_copies)
    return median_replay_ms(graph, 5) * 1e3 / (calls_per_copy * num_copies)


def path_of(m: int) -> str:
    return "gemv" if m == 1 else "skinny" if m <= MAX_STREAMING_ROWS else "cublas"


def tiles(grid) -> list[dict]:
    """Every tile of a grid {name: [values]}, or of each grid in a list of them."""
    grids = grid if isinstance(grid, list) else [grid]
    return [dict(zip(g, values)) for g in grids for values in itertools.product(*g.values())]


def skinny_tile_fits(m: int, tile: dict) -> bool:
    """False for tiles whose pipelined x and W buffers surely exceed shared memory."""
    per_stage = (skinny_block_m(m) + tile["block_n"]) * tile["block_k"] * 2
    return per_stage * (tile["num_stages"] - 1) <= SHARED_MEMORY_BYTES


class Shape:
    """One projection's weight copies (allocated once) and its cuBLAS times per M."""

    def __init__(self, name: str, n: int, k: int, dtype: torch.dtype):
        self.name, self.n, self.k = name, n, k
        self.copies = max(2, int(2e9 // (n * k * 2)))
        self.weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(self.copies)]
        self.gigabytes = n * k * self.weights[0].element_size() / 1e9
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def inputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """x [m, k], F.linear's output in fp32, and cuBLAS's microseconds per call."""
        if m not in self._inputs:
            x = torch.randn(m, self.k, device="cuda", dtype=self.weights[0].dtype)
            reference = F.linear(x, self.weights[0]).float()
            cublas_us = time_per_call_us(lambda i: F.linear(x, self.weights[i]), self.copies)
            self._inputs[m] = (x, reference, cublas_us)
        return self._inputs[m]

    def row(self, m: int, path: str, tile: str, fn: Callable, calls_per_copy: int = 20) -> Optional[dict]:
        """Time `fn(x, weight)` against cuBLAS at `m` rows; None if the tile does not fit the GPU."""
        x, reference, cublas_us = self.inputs(m)
        try:
            out = fn(x, self.weights[0]).float()
            us = time_per_call_us(lambda i: fn(x, self.weights[i]), self.copies, calls_per_copy)
        except OutOfResources as e:  # a tile too large for shared memory
            print(f"skip {self.name} m={m} {tile}: {type(e).__name__}: {e}", flush=True)
            return None
        row = dict(shape=self.name, n=self.n, k=self.k, m=m, path=path, tile=tile,
                   cublas_us=round(cublas_us, 2), cublas_TBps=round(self.gigabytes / cublas_us * 1e3, 2),
                   hetero_us=round(us, 2), hetero_TBps=round(self.gigabytes / us * 1e3, 2),
                   speedup=round(cublas_us / us, 3),
                   max_rel_err=f"{((out - reference).abs().max() / reference.abs().max()).item():.1e}")
        print(row, flush=True)
        return row


def tile_label(tile: dict) -> str:
    return " ".join(f"{key}={v}" for key, v in tile.items()) or "default"


def fastest(rows: list[dict], count: int = 3) -> list[dict]:
    return sorted(rows, key=lambda r: r["hetero_us"])[:count]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--rows", default=DEFAULT_ROWS,
                        help=f"comma-separated row counts M to time linear() vs F.linear at (default {DEFAULT_ROWS})")
    parser.add_argument("--sweep", nargs="?", const="all", choices=["all", "gemv", "skinny"],
                        help="also time grids of tiles: the GEMV's at M=1, the skinny GEMM's at M=17 and 64 "
                             "(bare --sweep: both)")
    args = parser.parse_args(argv)
    try:
        row_counts = [int(m) for m in args.rows.split(",") if m.strip()]
    except ValueError:
        parser.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if not row_counts or min(row_counts) < 1:
        parser.error(f"--rows must name at least one row count >= 1, got {args.rows!r}")
    if not torch.cuda.is_available():
        sys.exit("bench.gemv times CUDA kernels and needs a CUDA GPU")

    rows, gemv_best, skinny_best = [], [], []
    for name, (n, k) in SHAPES.items():
        shape = Shape(name, n, k, torch.bfloat16)
        rows += [shape.row(m, path_of(m), "default", linear) for m in row_counts]
        if args.sweep in ("all", "gemv"):
            swept = [shape.row(1, "gemv", tile_label(t), lambda x, w, t=t: gemv(x, w, **t), calls_per_copy=5)
                     for t in tiles(GEMV_SWEEP) if t["block_n"] * t["block_k"] <= 8192]
            gemv_best += fastest([r for r in swept if r])
        if args.sweep in ("all", "skinny"):
            for m in SKINNY_SWEEP_ROWS:
                swept = [shape.row(m, "skinny", tile_label(t), lambda x, w, t=t: skinny_gemm(x, w, **t), calls_per_copy=5)
                         for t in tiles(SKINNY_SWEEP) if skinny_tile_fits(m, t)]
                skinny_best += fastest([r for r in swept if r])
        del shape
        torch.cuda.empty_cache()

    rows = sorted((r for r in rows if r), key=lambda r: (r["m"], list(SHAPES).index(r["shape"])))
    body = ["## linear() vs cuBLAS (F.linear), default tiles, bf16", "",
            "path: gemv (M = 1), skinny (2 <= M <= 64), cublas (both sides are F.linear)", "",
            *markdown_table(rows), ""]
    if gemv_best:
        body += ["## sweep: the three fastest GEMV tiles per shape, M = 1", "", *markdown_table(gemv_best), ""]
    if skinny_best:
        body += [f"## sweep: the three fastest skinny-GEMM tiles per shape, M = {' and '.join(map(str, SKINNY_SWEEP_ROWS))}",
                 "", *markdown_table(skinny_best), ""]
    info = dict(describe_machine(), torch=torch.__version__, gpu=torch.cuda.get_device_name(), python=platform.python_version())
    command = "python -m bench.gemv " + " ".join(sys.argv[1:] if argv is None else argv)
    stem = f"{args.out}/gemv-{time.strftime('%Y%m%d-%H%M%S')}"
    print(write_markdown_and_json(stem, "Small-M linear layers: hetero's weight-streaming kernels vs cuBLAS", command,
                                  info, rows + gemv_best + skinny_best, body))


if __name__ == "__main__":
    main()
