"""The reference serving run: `hetero serve` in each configuration, the load generator at
several request rates against each, then the cost report over all of them.

Weights are random (vLLM's load_format="dummy") in the real shapes of Llama-3-8B; the
draft is a random ~170M model with the target's vocabulary. Random weights rarely agree,
so speculative configurations run at near-zero acceptance here: the run shows what they
cost when they do not help, which is what the speculation controller must bound.

    python -m bench.serve_reference --out bench/results/serve-reference
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
from safetensors.torch import save_file

from bench import cost, serve
from bench.e2e_speculation import DRAFT, draft_weights, write_model_dir
from bench.gpu_decode import LLAMA3_8B


def start_server(model_dir: str, port: int, extra: list[str], log_path: str) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "hetero.cli", "serve", model_dir, "--load-format", "dummy", "--dtype", "bfloat16",
        "--max-model-len", "1024", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.6",
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "llama3-8b-shape", *extra,
    ]
    log = open(log_path, "w")
    log.write(" ".join(command) + "\n")
    log.flush()
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(process: subprocess.Popen, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}; see its log")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server on port {port} was not healthy within {timeout_s:.0f} s")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/serve-reference")
    parser.add_argument("--configs", default="plain,lookahead,cpu-draft,gpu-draft")
    parser.add_argument("--rates", default="4,16,64", help="Poisson request rates (requests/s)")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--gpu-price-per-hour", type=float, default=3.0, help="example on-demand price of one H100")
    parser.add_argument("--cpu-price-per-hour", type=float, default=0.5, help="example price of the host's 16 cores")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    target_dir = write_model_dir(LLAMA3_8B)
    draft_dir = write_model_dir(DRAFT)
    save_file(draft_weights(draft_dir, seed=7), os.path.join(draft_dir, "model.safetensors"))
    lookahead_dir = tempfile.mkdtemp(prefix="lookahead-")
    with open(os.path.join(lookahead_dir, "lookahead_cache_config.json"), "w") as f:
        json.dump({"is_debug": False}, f)
    flags = {
        "plain": [],
        "lookahead": ["--lookahead-cache-config-dir", lookahead_dir, "--num-speculative-tokens", "8"],
        "cpu-draft": ["--speculative-model", draft_dir, "--num-speculative-tokens", "4", "--cpu-draft-worker"],
        "gpu-draft": ["--speculative-model", draft_dir, "--num-speculative-tokens", "4"],
    }
    for name in args.configs.split(","):
        process = start_server(target_dir, args.port, flags[name], os.path.join(args.out, f"server-{name}.log"))
        try:
            wait_healthy(process, args.port, timeout_s=300)
            for rate in args.rates.split(","):
                status = serve.main([
                    "--base-url", f"http://127.0.0.1:{args.port}/v1", "--model", "llama3-8b-shape",
                    "--label", name, "--request-rate", rate, "--num-prompts", str(args.num_prompts),
                    "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                    "--vocab-size", str(LLAMA3_8B["vocab_size"]), "--ignore-eos", "--warmup", "2",
                    "--result-dir", args.out, "--disable-tqdm",
                ])
                if status:
                    raise RuntimeError(f"the benchmark of {name} at {rate} requests/s failed (status {status})")
        finally:
            stop_server(process)
    cost.main([args.out, "--gpu-price-per-hour", str(args.gpu_price_per_hour),
               "--cpu-price-per-hour", str(args.cpu_price_per_hour), "--out-dir", args.out])


if __name__ == "__main__":
    main()
