"""Per-layer paged-attention timings: the Triton kernel against the torch reference.

Decode (one new token per sequence) and tree verification (a random token tree of N new
tokens per sequence, root included, so N=1 is a decode step through the tree path), for an
8B Llama-3-shaped layer (32 query heads, 8 KV heads, head_dim 128, bf16) by default.

The kernel is timed by replaying a CUDA graph of ``--iters`` calls (GPU time, no launch
overhead); the reference eagerly, as it runs. Each call reads a different copy of the KV
cache so that small caches are not served from L2 across calls, as in a real model where
every layer has its own. ``kv_GBps`` is the K/V bytes a call must read over its time;
``vs_decode`` a tree row's kernel time over the decode row's at the same batch and context
(issue 7's target: <= 1.15 for 16 nodes at batch 1).

    python -m bench.attention_kernels              # on a CUDA host
    python -m bench.attention_kernels --smoke      # tiny shapes; on CPU via Triton's interpreter

Prints a table and writes ``bench/results/attention_kernels-<hostname>.csv`` with the
command and the device on every row.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from bench._machine import describe_machine
from bench._report import write_csv_with_context
from gpu_target.attention import AttentionMetadata, reference_attention
from hetero.core.protocols import TokenTree

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROTATE_BYTES = 256 << 20  # KV bytes cycled through per timing loop: several times H100's 50 MB L2
MAX_COPIES = 128
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" or "tree"
    batch: int
    context: int  # tokens cached before the step, per sequence
    new_tokens: int  # per sequence: 1 for decode, the tree's size (root included) for tree


@dataclass
class Batch:
    query: torch.Tensor
    k_caches: list[torch.Tensor]  # identical-shape copies, one per call in a timing loop
    v_caches: list[torch.Tensor]
    meta: AttentionMetadata
    kv_bytes: int  # bytes of K and V one call must read


def cases(decode_batches, tree_batches, contexts, tree_sizes) -> list[Case]:
    out = [Case("decode", b, c, 1) for b in decode_batches for c in contexts]
    out += [Case("tree", b, c, n) for b in tree_batches for c in contexts for n in tree_sizes]
    return out


def random_tree_masks(num_tokens: int, gen: np.random.Generator) -> np.ndarray:
    """Ancestor bitmasks of a root (new token 0, bit 0) and num_tokens - 1 random nodes."""
    n = num_tokens - 1
    parents = np.array([gen.integers(-1, i) for i in range(n)], dtype=np.int32)
    nodes = TokenTree(np.zeros(n, np.int64), parents).ancestor_masks()
    return np.concatenate([[1], (nodes << 1) | 1]).astype(np.int64)


def build_batch(case: Case, shape: Shape, device: torch.device, seed: int = 0) -> Batch:
    """Metadata with shuffled block tables over enough KV copies to defeat L2 reuse."""
    gen = np.random.default_rng(seed)
    torch.manual_seed(seed)
    bs = shape.block_size
    seq_len = case.context + case.new_tokens
    blocks_per_seq = math.ceil(seq_len / bs)
    num_blocks = case.batch * blocks_per_seq
    tables = torch.from_numpy(gen.permutation(num_blocks).astype(np.int32)).view(case.batch, blocks_per_seq)
    slots = [
        int(tables[b, p // bs]) * bs + p % bs for b in range(case.batch) for p in range(case.context, seq_len)
    ]
    T = case.batch * case.new_tokens
    tree_mask = None
    if case.kind == "tree":
        masks = np.concatenate([random_tree_masks(case.new_tokens, gen) for _ in range(case.batch)])
        tree_mask = torch.from_numpy(masks).to(device)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(0, T + 1, case.new_tokens, dtype=torch.int32, device=device),
        seq_lens=torch.full((case.batch,), seq_len, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        tree_mask=tree_mask,
        max_query_len=case.new_tokens,
        max_seq_len=seq_len,
        query_lens_host=[case.new_tokens] * case.batch,
        seq_lens_host=[seq_len] * case.batch,
    )
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    elem = torch.finfo(shape.dtype).bits // 8
    cache_bytes = math.prod(cache_shape) * elem
    copies = max(1, min(MAX_COPIES, ROTATE_BYTES // (2 * cache_bytes))) if device.type == "cuda" else 1
    k_caches = [torch.randn(cache_shape, device=device, dtype=shape.dtype) for _ in range(copies)]
    v_caches = [torch.randn(cache_shape, device=device, dtype=shape.dtype) for _ in range(copies)]
    query = torch.randn(T, shape.num_heads, shape.head_dim, device=device, dtype=shape.dtype)
    kv_bytes = 2 * case.batch * seq_len * shape.num_kv_heads * shape.head_dim * elem
    return Batch(query, k_caches, v_caches, meta, kv_bytes)


def time_graph_us(calls: Sequence[Callable[[], object]], repeats: int) -> float:
    """Median GPU microseconds per call, replaying one CUDA graph of all ``calls``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    return _median_us(graph.replay, len(calls), repeats)


def time_eager_us(calls: Sequence[Callable[[], object]], repeats: int) -> float:
    """Median microseconds per call, launching each call from Python."""
    def run_all() -> None:
        for call in calls:
            call()

    run_all()
    return _median_us(run_all, len(calls), repeats)


def _median_us(run: Callable[[], None], calls_per_run: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / calls_per_run)
        else:
            t0 = time.perf_counter()
            run()
            samples.append((time.perf_counter() - t0) * 1e6 / calls_per_run)
    return statistics.median(samples)


def measure(case: Case, shape: Shape, device: torch.device, iters: int, repeats: int) -> dict:
    from gpu_target.triton_attention import paged_attention, plan_launch  # after TRITON_INTERPRET is set

    batch = build_batch(case, shape, device)
    meta, query = batch.meta, batch.query
    scale = shape.head_dim**-0.5
    copies = len(batch.k_caches)

    def kernel_call(i: int) -> Callable[[], torch.Tensor]:
        return lambda: paged_attention(query, batch.k_caches[i % copies], batch.v_caches[i % copies], meta, scale)

    def reference_call(i: int) -> Callable[[], torch.Tensor]:
        return lambda: reference_attention(query, batch.k_caches[i % copies], batch.v_caches[i % copies], meta, scale)

    error = (kernel_call(0)().float() - reference_call(0)().float()).abs().max().item()
    calls_per_run = max(iters, copies)  # every copy is read once per timed run
    kernel_calls = [kernel_call(i) for i in range(calls_per_run)]
    reference_calls = [reference_call(i) for i in range(calls_per_run)]
    if device.type == "cuda":
        kernel_us = time_graph_us(kernel_calls, repeats)
    else:
        kernel_us = time_eager_us(kernel_calls, repeats)
    reference_us = time_eager_us(reference_calls, repeats)
    plan = plan_launch(
        meta.num_tokens, meta.num_seqs, shape.num_heads, shape.num_kv_heads, shape.head_dim,
        meta.max_query_len, meta.max_seq_len,
        torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1,
    )
    return {
        **asdict(case),
        "splits": plan.num_splits,
        "kernel_us": round(kernel_us, 2),
        "reference_us": round(reference_us, 2),
        "speedup": round(reference_us / kernel_us, 2),
        "kv_GBps": round(batch.kv_bytes / kernel_us / 1e3, 1),
        "max_abs_err": float(f"{error:.3g}"),
    }


def add_vs_decode(rows: list[dict]) -> None:
    decode = {(r["batch"], r["context"]): r["kernel_us"] for r in rows if r["kind"] == "decode"}
    for r in rows:
        base = decode.get((r["batch"], r["context"]))
        r["vs_decode"] = round(r["kernel_us"] / base, 3) if base else ""


def format_table(rows: list[dict]) -> str:
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(str(r[c]).rjust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few iterations (runs on CPU through the Triton interpreter)")
    parser.add_argument("--decode-batches", type=int_list, default=[1, 16, 64])
    parser.add_argument("--tree-batches", type=int_list, default=[1, 16])
    parser.add_argument("--contexts", type=int_list, default=[512, 4096], help="cached tokens per sequence")
    parser.add_argument("--tree-sizes", type=int_list, default=[1, 4, 8, 16, 32, 64], help="new tokens per tree, root included (<= 64)")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=20, help="calls per timed graph replay / eager loop (at least one per KV copy)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs; the median is reported")
    parser.add_argument("--out", type=Path, default=None, help="CSV path (default bench/results/attention_kernels-<hostname>.csv)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.decode_batches, args.tree_batches, args.contexts, args.tree_sizes = [1, 3], [3], [40], [1, 5]
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.iters, args.repeats = 2, 1
    if max(args.tree_sizes) > 64:
        parser.error("--tree-sizes: a tree's ancestor mask holds at most 64 tokens")
    if args.num_heads % args.num_kv_heads:
        parser.error("--num-heads must be a multiple of --num-kv-heads")
    if not torch.cuda.is_available():
        if not args.smoke:
            parser.error("no CUDA device: only --smoke runs here (through Triton's CPU interpreter)")
        os.environ["TRITON_INTERPRET"] = "1"  # before gpu_target.triton_attention defines its kernels
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)"
    shape = Shape(args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, DTYPES[args.dtype])

    rows = [measure(case, shape, device, args.iters, args.repeats)
            for case in cases(args.decode_batches, args.tree_batches, args.contexts, args.tree_sizes)]
    add_vs_decode(rows)
    print(f"paged attention per layer: {shape.num_heads} q heads, {shape.num_kv_heads} kv heads, "
          f"head_dim {shape.head_dim}, {args.dtype}, block_size {shape.block_size}; device: {device_name}")
    print(format_table(rows))

    machine = describe_machine()
    command = shlex.join(["python", "-m", "bench.attention_kernels", *(argv if argv is not None else sys.argv[1:])])
    extra = {
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "block_size": shape.block_size,
        "dtype": args.dtype,
        "device": device_name,
        "command": command,
        "hostname": machine["hostname"],
        "hetero_commit": machine["hetero_commit"],
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out = args.out or RESULTS_DIR / f"attention_kernels-{machine['hostname']}.csv"
    write_csv_with_context(out, rows, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
