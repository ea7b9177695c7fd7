"""The reference cost run (GPU host): each configuration served at Poisson request rates up to
saturation, on workloads with real-text acceptance, every request's TTFT / TPOT / latency recorded.

Configurations: plain decoding, the lookahead cache, a draft model on the CPU in its worker
process, the same draft on the GPU, and `NAME+fp8` for any of them on an FP8 target
(`quantization="fp8"`). Weights are random in the real shapes of Llama-3-8B or -70B (vLLM's
load_format="dummy"); the draft is `bench.e2e_speculation`'s 8-layer 576-wide model.

Acceptance is that of real text (`bench.traces`, measured by `bench.acceptance` on the real
Qwen2.5-Coder pair). The target is built to agree with the draft (`bench.agreement.graft_draft_into_target`,
`bench.e2e_speculation`'s construction) and `TraceReplay` cuts each tree to an accepted length
drawn from the workload's trace: the draft models' per-position rates, the lookahead cache's
recorded steps (steps where it proposed nothing included). Workloads: `rewrite` (copy-heavy,
as RAG and editing are), `code` and `chat`. Prompts are random token ids: beside acceptance,
a workload here is only its trace.

The load runs in-process (`bench._poisson_driver`), not through `hetero serve` over HTTP:
the trace replay and the agreement graft live in the engine's process, and one call to the
GPU host has no time for a server start per configuration. Latencies therefore leave out
HTTP, JSON and detokenising (`bench.serve` measures those against any server).

`--hf-generate` adds HF transformers `generate` on the same host (a team without an engine):
one static batch of B requests per batch size, TTFT taken as a 1-token `generate` of the
batch and latency as the full one, so it has no queueing at all.

Each point is a `hetero-bench-serve`-schema JSON file (plus workload and acceptance; each
request's TTFT, TPOT and latency, its inter-token gaps as count and mean) in `--out`, written as
soon as it is measured; `run-<time>.json` lists settings, start-up times and what `--budget-s`
left out (a later call can add those to the same `--out`). `hetero-bench-cost OUT --out-dir OUT
...` makes the report. Plain decoding (and `plain+fp8`) run once, as workload "any".

    python -m bench.serve_reference --out bench/results/cost --hf-generate
    python -m bench.serve_reference --shape llama3-70b --tensor-parallel-size 4 --configs plain,cpu-draft --workloads code
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
import traceback
import zlib
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench._machine import describe_machine
from bench._poisson_driver import drive
from bench._stats import RequestRecord, arrival_offsets, summarize
from bench.agreement import DRAFT_FILE, draft_weights, graft_draft_into_target
from bench.e2e_speculation import DRAFT, TraceReplay, release_engine, write_model_dir
from bench.gpu_decode import LLAMA3_8B, LLAMA3_70B, fresh_controller, random_prompts, time_generate
from bench.serve import RESULT_SCHEMA
from bench.traces import load_trace
from gpu_target.loader import load_config, load_tokenizer
from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine
from hetero.proposers import build_proposer

CONFIGS = ("plain", "lookahead", "cpu-draft", "gpu-draft")
WORKLOADS = ("rewrite", "code", "chat")
LOOKAHEAD_TRACE = "lookahead-hybrid"  # the cache mode lookahead's config below runs (cache_mode 2)
NO_WORKLOAD = "any"  # configurations whose speed does not depend on acceptance

# Shapes: the real 8B and 70B targets with the e2e draft, and a tiny pair for CPU smoke runs.
SHAPES = {
    "llama3-8b": dict(target=LLAMA3_8B, draft=DRAFT, hot_tokens=32768, draft_vocab=32768),
    "llama3-70b": dict(target=LLAMA3_70B, draft=DRAFT, hot_tokens=32768, draft_vocab=32768),
    "tiny": dict(
        target=dict(LLAMA3_8B, vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2),
        draft=dict(LLAMA3_8B, vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2),
        hot_tokens=2048, draft_vocab=None),
}


def parse_rates(text: str) -> list[float]:
    rates = [math.inf if part.strip() == "inf" else float(part) for part in text.split(",")]
    if not rates or any(not rate > 0 for rate in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive numbers or inf, got {text!r}")
    return rates


def parse_configs(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        base, plus, quantization = name.partition("+")
        if base not in CONFIGS or (plus and quantization != "fp8"):
            raise argparse.ArgumentTypeError(f"unknown configuration {name!r}: expected one of {', '.join(CONFIGS)}, "
                                             "optionally with +fp8")
    return names


def speculation_settings(base: str, draft_dir: str, lookahead_dir: str, draft_vocab, k: int, nodes: int,
                         cpu_draft_quantization: str) -> dict:
    draft = dict(speculative_model=draft_dir, num_speculative_tokens=k, speculative_draft_vocab_size=draft_vocab)
    return {
        "plain": {},
        "lookahead": dict(lookahead_cache_config_dir=lookahead_dir, num_speculative_tokens=nodes),
        "cpu-draft": dict(draft, cpu_draft_worker=True,
                          speculative_config={"quantization": None if cpu_draft_quantization == "none" else cpu_draft_quantization}),
        "gpu-draft": dict(draft, cpu_draft_worker=False),
    }[base]


def trace_name(base: str, workload: str) -> str:
    return f"{workload}/{LOOKAHEAD_TRACE}" if base == "lookahead" else workload


class Run:
    """One invocation: the model directories, the settings and the result files written so far."""

    def __init__(self, args: argparse.Namespace, command: str):
        self.args, self.command = args, command
        self.machine = dict(describe_machine(), torch=torch.__version__,
                            gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        self.started = time.monotonic()
        self.manifest_name = f"run-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        shape = SHAPES[args.shape]
        self.shape = shape
        self.target_dir = write_model_dir(shape["target"])
        self.draft_dir = write_model_dir(shape["draft"])
        draft = draft_weights(self.draft_dir, seed=7, hot_tokens=shape["hot_tokens"], cold_scale=args.cold_scale)
        save_file(draft, os.path.join(self.draft_dir, DRAFT_FILE))
        self.lookahead_dir = tempfile.mkdtemp(prefix="lookahead-")
        with open(os.path.join(self.lookahead_dir, "lookahead_cache_config.json"), "w") as f:
            json.dump({"is_debug": False, "cache_mode": 2, "copy_length": args.lookahead_depth}, f)
        self.manifest = dict(command=command, machine=self.machine, settings=_settings(args), startup_s={},
                             skipped=[], errors={}, files=[])

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def over_budget(self) -> bool:
        return self.elapsed() > self.args.budget_s

    def write_point(self, label: str, workload: str, rate: float, concurrency, records, duration: float,
                    spec: dict | None, trace: str | None) -> None:
        args = self.args
        summary = summarize(records, duration, {"tpot": args.tpot_slo_ms, "ttft": args.ttft_slo_ms})
        result = {
            "schema": RESULT_SCHEMA, "label": label, "workload": workload, "trace": trace,
            "driver": "in-process (bench._poisson_driver)" if label != "hf-generate" else "HF generate, one static batch",
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": self.command, "machine": self.machine,
            "config": {"endpoint": "in-process", "model": f"{args.shape} (random weights)", "dataset_name": "random-ids",
                       "input_len": args.input_len, "output_len": args.output_len, "num_prompts": len(records),
                       "request_rate": "inf" if math.isinf(rate) else rate, "max_concurrency": concurrency,
                       "max_num_seqs": args.max_num_seqs, "seed": args.seed, "temperature": 0.0, "ignore_eos": True},
            "summary": summary, "spec_decode": spec,
            "requests": [_request_entry(record) for record in records],
        }
        rate_name = "inf" if math.isinf(rate) else f"{rate:g}"
        name = f"{label}-{workload}-rate{rate_name}" + (f"-conc{concurrency}" if concurrency else "") + ".json"
        (self.out / name).write_text(json.dumps(result, separators=(",", ":")) + "\n")
        self.manifest["files"].append(name)
        ttft, tpot = summary["ttft_ms"], summary["tpot_ms"]
        print(f"{label:>14} {workload:>8} {rate_name:>6}{'' if not concurrency else f' x{concurrency}':>6} "
              f"{summary['output_throughput']:9.1f} tok/s  TTFT p50/p99 {_ms(ttft['median'])}/{_ms(ttft['p99'])} ms  "
              f"TPOT p50/p99 {_ms(tpot['median'])}/{_ms(tpot['p99'])} ms"
              + (f"  accept {spec['mean_acceptance_length']}" if spec and spec.get("mean_acceptance_length") else "")
              + f"  [{self.elapsed():.0f} s]", flush=True)

    def write_manifest(self) -> None:
        self.manifest["total_s"] = round(self.elapsed(), 1)
        (self.out / self.manifest_name).write_text(json.dumps(self.manifest, indent=1) + "\n")


def _request_entry(record: RequestRecord) -> dict:
    """A request's record without its inter-token gaps (a point's file stays small): their count
    and mean instead."""
    entry = {key: value for key, value in record.to_dict().items() if key != "itl"}
    entry.update(chunks=len(record.itl) + (record.ttft is not None),
                 mean_itl=sum(record.itl) / len(record.itl) if record.itl else None)
    return entry


def _ms(value) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _settings(args: argparse.Namespace) -> dict:
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    settings["rates"] = ["inf" if math.isinf(rate) else rate for rate in args.rates]
    return settings


def build_engine(run: Run, name: str) -> LLMEngine:
    args = run.args
    base, _, quantization = name.partition("+")
    speculation = speculation_settings(base, run.draft_dir, run.lookahead_dir, run.shape["draft_vocab"], args.k,
                                       args.lookahead_nodes, args.cpu_draft_quantization)
    config = EngineConfig(model=run.target_dir, load_format="dummy", dtype=args.dtype, device=args.device,
                          quantization=quantization or None, tensor_parallel_size=args.tensor_parallel_size,
                          max_model_len=args.input_len + args.output_len + 64,
                          max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_space=args.kv_cache_space, **speculation)
    proposer = None
    if speculation:
        model_config = load_config(run.target_dir, require_weights=False)
        inner = build_proposer(config, model_config, load_tokenizer(run.target_dir))
        proposer = TraceReplay(inner, load_trace(trace_name(base, args.workloads[0])), model_config.vocab_size,
                               seed=args.seed, recorded_steps=base == "lookahead")
    engine = LLMEngine(config, proposer)
    engine.collective_rpc(graft_draft_into_target, args=(run.draft_dir, 0.0, 1))
    return engine


def spec_counters(engine: LLMEngine) -> tuple[int, int, int]:
    stats = engine.spec_stats
    return stats.num_steps, stats.num_accepted_tokens, stats.num_draft_tokens


def trace_acceptance_length(replay: TraceReplay, args: argparse.Namespace) -> float:
    """Tokens per speculative step the trace promises at this run's tree depth (the draft's k, the
    lookahead's copy length), bonus included: what `mean_acceptance_length` should come near."""
    trace = replay.trace
    if replay.recorded_steps:
        return 1 + sum(min(a, args.lookahead_depth) for a in trace.accepted) / len(trace.accepted)
    return 1 + trace.expected_accepted(args.k)


def sweep(run: Run, engine: LLMEngine, label: str, workload: str, trace: str | None) -> None:
    """Warm up, then every rate of `--rates` with `--num-prompts` fresh requests."""
    args = run.args
    vocab = run.shape["target"]["vocab_size"]
    warmup = random_prompts(args.warmup, args.input_len, vocab, seed=args.seed + 1)
    drive(engine, warmup, args.warmup_output_len, [0.0] * len(warmup), tag=f"warm-{label}-{workload}")
    for index, rate in enumerate(args.rates):
        # fresh prompts per workload and rate (the prefix cache must not serve one sweep from another's),
        # the same ones for every configuration
        prompts = random_prompts(args.num_prompts, args.input_len, vocab,
                                 seed=zlib.crc32(f"{args.seed}-{workload}-{index}".encode()))
        offsets = arrival_offsets(len(prompts), rate, random.Random(args.seed + index))
        before = spec_counters(engine)
        records, duration = drive(engine, prompts, args.output_len, offsets, tag=f"{label}-{workload}-{index}")
        steps, accepted, drafted = (after - b for after, b in zip(spec_counters(engine), before))
        spec = None
        if engine.proposer is not None:
            spec = dict(mean_acceptance_length=round((accepted + steps) / steps, 3) if steps else None,
                        trace_acceptance_length=round(trace_acceptance_length(engine.proposer, args), 3),
                        spec_sequence_steps=steps, draft_tokens=drafted,
                        share_of_tokens_from_speculative_steps=round((accepted + steps) / sum(
                            r.output_tokens for r in records), 3) if records else None)
        run.write_point(label, workload, rate, None, records, duration, spec, trace)


def run_config(run: Run, name: str) -> None:
    args = run.args
    base = name.partition("+")[0]
    workloads = args.workloads if base != "plain" else [NO_WORKLOAD]
    started = time.monotonic()
    engine = build_engine(run, name)
    run.manifest["startup_s"][name] = round(time.monotonic() - started, 1)
    print(f"{name}: engine ready in {run.manifest['startup_s'][name]} s", flush=True)
    try:
        for workload in workloads:
            if run.over_budget():
                run.manifest["skipped"].append(f"{name}/{workload}")
                continue
            trace = None
            if engine.proposer is not None:
                trace = trace_name(base, workload)
                engine.proposer.trace = load_trace(trace)
                engine.spec_control = fresh_controller(engine, engine.spec_control.max_nodes_per_seq,
                                                       engine.spec_control.target_parallelism)
            sweep(run, engine, name, workload, trace)
    finally:
        release_engine(engine)


def run_hf_generate(run: Run) -> None:
    """HF transformers `generate`, one static batch per batch size (random weights, the same shape)."""
    import transformers

    args = run.args
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    config = transformers.AutoConfig.from_pretrained(run.target_dir)
    dtype = getattr(torch, args.dtype)
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.eval()
    for batch in args.hf_batches:
        prompts = random_prompts(batch, args.input_len, config.vocab_size, seed=args.seed + batch)
        ids = torch.tensor([p["prompt_token_ids"] for p in prompts], device=device)
        time_generate(model, ids, 2)  # warm-up
        first = time_generate(model, ids, 1)
        full = time_generate(model, ids, args.output_len)
        records = [RequestRecord(success=True, output_tokens=args.output_len, prompt_tokens=args.input_len,
                                 ttft=first, e2e=full, usage_reported=True) for _ in range(batch)]
        run.write_point("hf-generate", NO_WORKLOAD, math.inf, batch, records, full, None, None)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_reference", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="bench/results/cost")
    parser.add_argument("--configs", type=parse_configs, default=list(CONFIGS) + ["plain+fp8"],
                        help=f"comma-separated: {', '.join(CONFIGS)}, each optionally +fp8 (an FP8 target)")
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS),
                        help="acceptance traces under bench/data/traces")
    parser.add_argument("--rates", type=parse_rates, default=parse_rates("24,48,96,inf"),
                        help="Poisson request rates (requests/s); inf sends every request at once")
    parser.add_argument("--num-prompts", type=int, default=256, help="requests per rate")
    parser.add_argument("--warmup", type=int, default=64,
                        help="unmeasured requests sent at once per configuration and workload (first-use compiles, the "
                             "controller's first verdicts)")
    parser.add_argument("--warmup-output-len", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step (the draft's tree node budget)")
    parser.add_argument("--cpu-draft-quantization", choices=["none", "int8"], default="int8",
                        help="the CPU worker's draft weights; the GPU draft stays in the target's dtype")
    parser.add_argument("--lookahead-depth", type=int, default=8, help="lookahead copy_length (as its traces measured)")
    parser.add_argument("--lookahead-nodes", type=int, default=16, help="lookahead tree node budget")
    parser.add_argument("--cold-scale", type=float, default=0.8, help="see bench.e2e_speculation")
    parser.add_argument("--hf-generate", action="store_true", help="also time HF transformers generate")
    parser.add_argument("--hf-batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16, 64, 128])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="tiny: CPU smoke runs")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="the target over this many GPUs")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="as bench.e2e_speculation: ample KV for 128 x 320 tokens, room for the next engine")
    parser.add_argument("--kv-cache-space", type=float, default=None, help="GiB of KV cache on the CPU")
    parser.add_argument("--tpot-slo-ms", type=float, default=30.0, help="the per-request SLO behind summary.goodput")
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="no new (configuration, workload) sweep starts after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "warmup_output_len", "max_num_seqs", "k"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    run = Run(args, shlex.join(["python", "-m", "bench.serve_reference", *argv]))
    order = [name for name in args.configs if name == "plain"] + (["hf-generate"] if args.hf_generate else []) + [
        name for name in args.configs if name != "plain"]
    for name in order:
        if run.over_budget():
            run.manifest["skipped"].append(name)
            continue
        try:
            run_hf_generate(run) if name == "hf-generate" else run_config(run, name)
        except Exception as exc:  # one configuration's failure must not lose the others' results
            traceback.print_exc()
            run.manifest["errors"][name] = f"{type(exc).__name__}: {exc}"
        run.write_manifest()
    run.write_manifest()
    if run.manifest["skipped"]:
        print(f"left out by --budget-s {args.budget_s:g}: {', '.join(run.manifest['skipped'])}")
    print(f"results in {run.out} ({run.elapsed():.0f} s); report: hetero-bench-cost {run.out} --out-dir {run.out} "
          "--gpu-price-per-hour 3 --cpu-price-per-hour 0.5")
    return 1 if run.manifest["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
