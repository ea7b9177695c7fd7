"""Draft step latency of the CPU drafter: BF16 vs FP32 vs INT8 weights, at several batch sizes.

One *draft step* is what the worker does per engine step in steady state: take the
previous chain as accepted plus a bonus token, then draft a chain of ``--draft-tokens``
for every sequence of the batch (one catch-up forward of 2 tokens per sequence, then one
single-token forward per further depth level). ``forward_ms`` is one batched forward
(step / draft tokens); the issue's target is a draft step of <= 2 ms per forward at batch 8.
``roofline_ms`` is what that forward cannot beat: the bytes it must read (every projection
and the logits head at the row's precision, and the batch's cached K/V at the measured
steps' mean context; `bytes_per_forward`) over the memory read bandwidth that the pinned
threads measure at start (``read_bandwidth_GBps`` in the CSV).

    python -m bench.cpu_draft [--model SmolLM2-135M-Instruct | --random-shape 576,30,9,3,1536,49152]
                              [--precisions bf16 fp32 int8] [--batch-sizes 1 8 32]
                              [--context 256] [--draft-tokens 4] [--steps 20] [--cpus 4-15] [--threads 7 14]
                              [--kv-layouts slots paged] [--kernels native lean] [--no-pack-linears]
                              [--kv-dtypes fp32 bf16] [--profile-native] [--amx on off]

``--kv-layouts slots paged`` times the contiguous-slot layout (the CPU default) next to the
paged one it replaced on the CPU (gathers per layer, plain F.linear), in one run.
``--kernels native lean`` times the slots layout's native forward (one C++/OpenMP call per
forward, `cpu_draft.native_model`, the default) next to the lean torch forward, in one run;
the ``kernels`` column says which ran (``torch`` for the paged layout, and ``lean`` where
the native forward was asked for but did not build).

``--kv-dtypes fp32 bf16`` times the slots layout with its K/V stored in float32 and in bfloat16,
in one run (default: the drafter's, float32); the ``kv_dtype`` column says what each row stored. The paged layout keeps
the model's dtype, whatever is asked.

``--amx on off`` times the native forward with the AMX tile kernels (matmuls of 4 rows or more,
where the library was built for AMX and Linux grants the tile data) and without them, in one run;
by default they are on where available (``HETERO_NATIVE_AMX=0`` turns them off). The ``amx_kernels``
column says whether they ran.

``--profile-native`` turns on the native forward's phase timing (as ``HETERO_NATIVE_PROFILE=1``
does) and prints, for each native row, milliseconds per forward in each phase (embed, qkv,
attention, o, gate_up, down, lm_head, top_k (the drafter's read of each level's logits): mean
compute plus the wait at the barrier closing the phase), all barrier waits, the busiest thread's excess over the mean, and the rest of the
call; the same numbers go to ``bench/results/cpu_draft-<hostname>-profile.csv``. Timing
adds a few clock reads per phase, so compare ``forward ms`` from runs without it.

Prints a table and writes ``bench/results/cpu_draft-<hostname>.csv`` with the exact
command and the machine (CPU model, AMX / AVX-512 BF16 flags, IPEX).
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from bench._machine import describe_machine
from bench._report import write_csv_with_context
from cpu_draft import native
from cpu_draft.affinity import default_draft_cpus, pin_current_process
from cpu_draft.drafter import DraftModelOptions, Drafter
from gpu_target.loader import load_config, parameter_shapes, resolve_model_path
from gpu_target.model import build_model
from gpu_target.model_config import ModelConfig
from hetero.core.config import DraftConfig

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PRECISIONS = {"bf16": (torch.bfloat16, False), "fp32": (torch.float32, False), "int8": (torch.bfloat16, True)}
KV_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
SHAPE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def random_config(shape: str) -> ModelConfig:
    """A llama config from `--random-shape`: the SHAPE_FIELDS ints, then optionally `untied` for
    a logits head of its own (llama-68m's 768,2,12,12,3072,32000,untied: 68 M parameters)."""
    fields = shape.split(",")
    untied = fields[-1] == "untied"
    values = [int(v) for v in (fields[:-1] if untied else fields)]
    if len(values) != len(SHAPE_FIELDS):
        raise SystemExit(f"--random-shape takes {len(SHAPE_FIELDS)} ints: {','.join(SHAPE_FIELDS)}[,untied]")
    dims = dict(zip(SHAPE_FIELDS, values))
    return ModelConfig(architecture="llama", head_dim=dims["hidden_size"] // dims["num_heads"], max_position_embeddings=4096,
                       tie_word_embeddings=not untied, **dims)


def load_drafter(args, dtype: torch.dtype, int8: bool, max_num_seqs: int, kv_layout: str, kernels: str = "native",
                 kv_dtype: Optional[str] = None, prefill_forward_tokens: Optional[int] = None) -> Drafter:
    options = DraftModelOptions(dtype=dtype, int8_weights=int8, kv_cache_bytes=int(args.kv_cache_gib * 2**30), max_num_seqs=max_num_seqs,
                                kv_layout=kv_layout, pack_linears=args.pack_linears, native_kernels=kernels == "native",
                                kv_dtype=kv_dtype, draft_vocab_size=args.draft_vocab, prefill_forward_tokens=prefill_forward_tokens)
    if args.random_shape is None:
        return Drafter.load(args.model, options)
    config = random_config(args.random_shape)
    generator = torch.Generator().manual_seed(0)
    state = {name: (torch.randn(shape, generator=generator) * 0.02).to(dtype) for name, shape in parameter_shapes(config).items()}
    model = build_model(config, state, dtype, "cpu")
    return Drafter(model, options)


WEIGHT_BYTES = {"bf16": 2, "fp32": 4, "int8": 1}  # per weight element; int8 adds a float32 scale per row
KV_BYTES = {"fp32": 4, "bf16": 2}


def read_bandwidth(num_bytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes per second that this process's threads read from memory: the best of `repeats`
    sums of a float32 tensor too large for any cache."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return num_bytes / best


def bytes_per_forward(config: ModelConfig, precision: str, kv_dtype: str, batch_size: int, mean_context: float,
                      head_rows: int | None = None) -> float:
    """Bytes one batched single-token forward must read: every projection and the logits head
    (``head_rows`` of it: a reduced draft vocabulary; None: all) once, at the precision's width
    (the embedding: only the batch's rows, left out), and the batch's cached K/V at `mean_context` tokens."""
    width = WEIGHT_BYTES[precision]
    head = [(min(head_rows or config.vocab_size, config.vocab_size), config.hidden_size)]
    matrices = [shape for name, shape in parameter_shapes(config).items()
                if len(shape) == 2 and "embed_tokens" not in name and "lm_head" not in name] + head
    weights = sum(rows * cols * width + (4 * rows if precision == "int8" else 0) for rows, cols in matrices)
    kv = config.num_layers * batch_size * mean_context * 2 * config.kv_size * KV_BYTES[kv_dtype]
    return weights + kv


def time_draft_steps(drafter: Drafter, batch_size: int, context: int, draft_tokens: int, steps: int, warmup: int,
                     on_measure_start=None) -> np.ndarray:
    """Seconds per draft step, each after accepting the previous chain and a bonus token.

    ``on_measure_start`` (if given) is called once, after the warm-up steps.
    """
    rng = np.random.default_rng(0)
    seqs = {f"s{b}": rng.integers(0, drafter.vocab_size, context).tolist() for b in range(batch_size)}
    for seq_id, tokens in seqs.items():
        drafter.set_context(seq_id, tokens)
    drafter.draft([(s, draft_tokens) for s in seqs])
    times = []
    for step in range(warmup + steps):
        if step == warmup and on_measure_start is not None:
            on_measure_start()
        for seq_id in seqs:
            chain = drafter.last_chain(seq_id)
            seqs[seq_id] = seqs[seq_id] + chain + [chain[-1]]
        started = time.perf_counter()
        for seq_id, tokens in seqs.items():
            drafter.set_context(seq_id, tokens)
        drafter.draft([(s, draft_tokens) for s in seqs])
        if step >= warmup:
            times.append(time.perf_counter() - started)
    drafter.release_all()
    return np.asarray(times)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_draft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="draft checkpoint (HF dir or GGUF)")
    parser.add_argument("--random-shape", default=None, help=f"random weights of this shape instead: {','.join(SHAPE_FIELDS)}[,untied]")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256, help="tokens already in each sequence's context")
    parser.add_argument("--draft-tokens", type=int, default=4, help="chain length per draft step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cpus", default=None, help="cores to pin to, e.g. 4-15 (default: DraftConfig.cpus, i.e. $HETERO_DRAFT_CPUS, else up to 16 cores after the first one in eight)")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch threads (default: one per pinned core); several: each batch size timed at each, in turn")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--kv-layouts", nargs="+", default=["slots"], choices=["slots", "paged"],
                        help="draft KV layouts to time (paged: the layout the CPU draft used before slots)")
    parser.add_argument("--kernels", nargs="+", default=["native"], choices=["native", "lean"],
                        help="slots layout: the native forward (C++/OpenMP, one call per forward) and/or the lean torch forward")
    parser.add_argument("--pack-linears", action=argparse.BooleanOptionalAction, default=True,
                        help="slots layout: oneDNN-packed projections and logits head")
    parser.add_argument("--kv-dtypes", nargs="+", default=None, choices=list(KV_DTYPES),
                        help="slots layout: store the draft's K/V in float32 and/or bfloat16 (default: the drafter's choice)")
    parser.add_argument("--profile-native", action="store_true",
                        help="native rows: time each phase of the forward and print ms per forward per phase")
    parser.add_argument("--amx", nargs="+", default=None, choices=["on", "off"],
                        help="native rows: with the AMX kernels and/or without (default: as loaded, on where available)")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="the head over this many of the most frequent tokens (speculative_draft_vocab_size); default: all")
    parser.add_argument("--out", type=Path, default=None, help="CSV path, or a directory for cpu_draft-<hostname>.csv in it (default bench/results)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    command = shlex.join([Path(sys.executable).name, "-m", "bench.cpu_draft", *(argv if argv is not None else sys.argv[1:])])
    cpus = default_draft_cpus(args.cpus if args.cpus is not None else DraftConfig().cpus)
    threads = pin_current_process(cpus, max(args.threads) if args.threads else None)
    thread_counts = args.threads or [threads]
    machine = describe_machine()
    flags = cpu_flags()
    amx = "amx_bf16" in flags and "amx_tile" in flags
    ipex = importlib.util.find_spec("intel_extension_for_pytorch") is not None
    model_name = f"random[{args.random_shape}]" if args.random_shape else str(resolve_model_path(args.model))
    print(f"machine: {machine['hostname']}, {machine['cpu_model']}, AMX: {'yes' if amx else 'no'}, "
          f"AVX-512 BF16: {'yes' if 'avx512_bf16' in flags else 'no'}, IPEX: {'yes' if ipex else 'no'}, torch {torch.__version__}")
    print(f"draft: {model_name}; cpus {cpus}, {threads} threads; context {args.context}, {args.draft_tokens} draft tokens per step")
    config = random_config(args.random_shape) if args.random_shape else load_config(args.model)
    if args.random_shape is None:
        print(f"shape: {config.num_parameters() / 1e6:.0f} M parameters, {config.num_layers} layers, hidden {config.hidden_size}")
    bandwidth = read_bandwidth()
    print(f"memory read bandwidth of these {threads} threads: {bandwidth / 1e9:.1f} GB/s (roofline ms: the bytes a forward "
          "must read at that rate)")
    print(f"{'layout':>6} {'kernels':>7} {'amx':>3} {'precision':>9} {'kv':>4} {'batch':>5} {'threads':>7} {'step p50 ms':>11} {'step p90 ms':>11} "
          f"{'forward ms':>10} {'roofline ms':>11} {'draft tok/s':>11}")
    rows, profile_rows = [], []
    runs = [(layout, kernels, amx, kv) for layout in args.kv_layouts for kernels in (args.kernels if layout == "slots" else ["torch"])
            for amx in ((args.amx or [None]) if kernels == "native" else [None])
            for kv in ((args.kv_dtypes or [None]) if layout == "slots" else [None])]
    for precision, (layout, kernels, amx_setting, kv_setting) in itertools.product(args.precisions, runs):
        dtype, int8 = PRECISIONS[precision]
        drafter = load_drafter(args, dtype, int8, max(args.batch_sizes), layout, kernels, kv_setting and KV_DTYPES[kv_setting])
        kv_dtype = drafter.kv.cache.dtype if layout == "slots" else drafter.kv.pool.storage.dtype
        kv_name = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(kv_dtype, str(kv_dtype).removeprefix("torch."))
        if kernels == "native" and not drafter.kv.native:
            kernels = "lean"  # the native forward did not build (warned): this is the torch forward
        amx_kernels = False
        if kernels == "native":
            if amx_setting is not None:
                native.set_amx(drafter.kv.model.library, amx_setting == "on")
            amx_kernels = native.amx(drafter.kv.model.library)
        library = drafter.kv.model.library if kernels == "native" and args.profile_native else None
        if library is not None:
            native.enable_profile(library)
        for batch_size, num_threads in itertools.product(args.batch_sizes, thread_counts):
            torch.set_num_threads(num_threads)  # the native forward runs as many threads as torch's pool has
            on_start = (lambda: native.reset_profile(library)) if library is not None else None
            times = time_draft_steps(drafter, batch_size, args.context, args.draft_tokens, args.steps, args.warmup, on_start)
            p50, p90 = np.percentile(times, 50) * 1e3, np.percentile(times, 90) * 1e3
            # Each step appends the accepted chain and a bonus token: the measured steps' mean context.
            mean_context = args.context + (args.draft_tokens + 1) * (args.warmup + 1 + args.steps / 2) + args.draft_tokens / 2
            roofline_ms = 1e3 * bytes_per_forward(config, precision, kv_name, batch_size, mean_context, args.draft_vocab) / bandwidth
            row = {
                "kv_layout": layout,
                "kernels": kernels,
                "amx_kernels": amx_kernels,
                "packed_linears": kernels == "lean" and args.pack_linears,
                "precision": precision,
                "kv_dtype": kv_name,
                "batch_size": batch_size,
                "threads": num_threads,
                "step_p50_ms": round(p50, 3),
                "step_p90_ms": round(p90, 3),
                "forward_ms": round(p50 / args.draft_tokens, 3),
                "roofline_ms": round(roofline_ms, 3),
                "draft_tokens_per_s": round(batch_size * args.draft_tokens / (p50 / 1e3), 1),
                "context": args.context,
                "draft_tokens": args.draft_tokens,
                "steps": args.steps,
            }
            rows.append(row)
            print(f"{layout:>6} {kernels:>7} {'yes' if amx_kernels else 'no':>3} {precision:>9} {kv_name:>4} {batch_size:>5} {num_threads:>7} {p50:>11.2f} "
                  f"{p90:>11.2f} {row['forward_ms']:>10.2f} {roofline_ms:>11.2f} {row['draft_tokens_per_s']:>11.0f}")
            if library is not None:
                profile = native.read_profile(library)
                table = native.profile_table(profile)
                profile_rows.append({"precision": precision, "kv_dtype": kv_name, "amx_kernels": amx_kernels, "batch_size": batch_size,
                                     "forwards": profile["calls"],
                                     "threads": profile["threads"], **{f"{k}_ms": round(v, 4) for k, v in table.items()}})
                print("        phases, ms per forward: " + "  ".join(f"{k} {v:.3f}" for k, v in table.items()))
        if library is not None:
            native.enable_profile(library, False)
        del drafter
    extra = {
        "model": model_name,
        "cpus": ",".join(map(str, cpus)),
        "read_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "amx": amx,
        "avx512_bf16": "avx512_bf16" in flags,
        "ipex": ipex,
        "torch": torch.__version__,
        "command": command,
        "hostname": machine["hostname"],
        "cpu_model": machine["cpu_model"],
        "cpu_count": machine["cpu_count"],
        "hetero_commit": machine["hetero_commit"],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out = args.out or RESULTS_DIR
    if out.is_dir():  # a directory, as the other benches take
        out = out / f"cpu_draft-{machine['hostname']}.csv"
    write_csv_with_context(out, rows, extra)
    if profile_rows:
        names = [k for k in profile_rows[0] if k.endswith("_ms")]
        print("native forward phases, ms per forward (phase = mean compute + mean wait at its closing barrier):")
        print(f"{'precision':>9} {'kv':>4} {'amx':>3} {'batch':>5} {'threads':>7} " + " ".join(f"{n[:-3]:>9}" for n in names))
        for r in profile_rows:
            print(f"{r['precision']:>9} {r['kv_dtype']:>4} {'yes' if r['amx_kernels'] else 'no':>3} {r['batch_size']:>5} {r['threads']:>7} "
                  + " ".join(f"{r[n]:>9.3f}" for n in names))
        write_csv_with_context(out.with_name(f"{out.stem}-profile{out.suffix}"), profile_rows, extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
