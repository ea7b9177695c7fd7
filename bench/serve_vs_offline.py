"""`hetero serve` at saturation against the offline engine on the same requests (issue #30).

Starts `hetero serve MODEL` in a subprocess on 127.0.0.1, sends every request at once
through `hetero-bench-serve` (streaming completions of token-id prompts, `ignore_eos`),
stops the server, then generates the same prompts with `LLM.generate` in this process,
with the same engine flags. The ratio of output tokens per second is what serving costs
over the engine itself: HTTP, SSE framing, detokenisation and the asyncio front end. vLLM
users compare `vllm serve` with `benchmark_throughput` the same way.

With no ``--model``, an 8B Llama-3-shaped model directory (config and a word-level
tokenizer, random weights through ``--load-format dummy``) is written to a temp dir.

    python -m bench.serve_vs_offline --num-prompts 512 --max-num-seqs 64     # GPU host, ~2 min
    python -m bench.serve_vs_offline --shape tiny --num-prompts 64 --max-num-seqs 16 --device cpu
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from bench import serve as bench_serve
from bench._machine import describe_machine
from bench.e2e_speculation import write_model_dir
from bench.gpu_decode import LLAMA3_8B
from bench.multi_turn_chat import SMALL_CPU_MODEL
from bench.serve_load import free_port, wait_healthy

SHAPES = {"llama3-8b": LLAMA3_8B, "tiny": SMALL_CPU_MODEL}


ENGINE_SETTINGS = ("load_format", "max_num_seqs", "device", "kv_cache_space", "max_model_len")


def engine_settings(args: argparse.Namespace) -> dict:
    """The engine settings both sides get: `hetero serve` flags and `LLM` keyword arguments alike."""
    return {name: getattr(args, name) for name in ENGINE_SETTINGS if getattr(args, name) is not None}


def serve_flags(settings: dict) -> list[str]:
    return [part for name, value in settings.items() for part in (f"--{name.replace('_', '-')}", str(value))]


def serve_side(model: str, args: argparse.Namespace, load_args: list[str]) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "hetero.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "model", *serve_flags(engine_settings(args))]
    base_url = f"http://127.0.0.1:{port}"
    log = open(Path(args.result_dir) / "serve_vs_offline-server.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(base_url, process, args.startup_timeout)
        argv = ["--base-url", base_url + "/v1", "--model", "model", *load_args, "--result-dir", args.result_dir,
                "--label", "serve", "--disable-tqdm"]
        if bench_serve.main(argv) != 0:
            raise RuntimeError("hetero-bench-serve failed; see its message above")
    finally:
        process.terminate()
        process.wait(60)
        log.close()
    latest = max(Path(args.result_dir).glob("serve-completions-*.json"), key=lambda p: p.stat().st_mtime)
    summary = json.loads(latest.read_text())["summary"]
    return dict(command=shlex.join(command), output_tokens_per_s=summary["output_throughput"], result=str(latest))


def offline_side(model: str, args: argparse.Namespace, load_args: list[str]) -> dict:
    from hetero import LLM, SamplingParams

    bench_args = bench_serve.parse_args(["--base-url", "http://unused/v1", *load_args])
    prompts = bench_serve.build_prompts(bench_args, random.Random(bench_args.seed))
    warmup, measured = prompts[: bench_args.warmup], prompts[bench_args.warmup:]
    llm = LLM(model, **engine_settings(args))
    sampling = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    if warmup:
        llm.generate([{"prompt_token_ids": p.prompt} for p in warmup], sampling, use_tqdm=False)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p.prompt} for p in measured], sampling, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return dict(output_tokens=tokens, seconds=round(seconds, 3), output_tokens_per_s=round(tokens / seconds, 1))


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: one of --shape, random weights)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=64, help="unmeasured requests first, on both sides")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--device", help="where the target runs (default: the engine's)")
    parser.add_argument("--kv-cache-space", type=float, help="GiB of KV cache on the CPU")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--result-dir", default="bench/results")
    args = parser.parse_args(argv)
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    model = args.model or write_model_dir(SHAPES[args.shape])
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    load_args = ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
                 str(args.output_len), "--vocab-size", str(vocab), "--warmup", str(args.warmup), "--ignore-eos",
                 "--request-rate", "inf"]
    served = serve_side(model, args, load_args)
    offline = offline_side(model, args, load_args)
    ratio = served["output_tokens_per_s"] / offline["output_tokens_per_s"]
    print(f"| side | output tokens/s |\n|---|---|\n| hetero serve | {served['output_tokens_per_s']:.1f} |\n"
          f"| LLM.generate | {offline['output_tokens_per_s']:.1f} |\n| serve / offline | {ratio:.3f} |")
    result = dict(command=shlex.join(["python", "-m", "bench.serve_vs_offline", *(argv if argv is not None else sys.argv[1:])]),
                  machine=describe_machine(), settings=vars(args), served=served, offline=offline,
                  serve_over_offline=round(ratio, 3))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = Path(args.result_dir) / f"serve_vs_offline-{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"results: {path}")
    return result


if __name__ == "__main__":
    main()
