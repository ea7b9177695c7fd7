"""GPU benchmark of quantised targets side by side: decode speed, tree verification, roofline.

For each `--quantization` value (none = bf16) an engine with random weights in a Llama-3
shape (`load_format="dummy"`, quantised as drawn) is timed on:
  decode   tokens/s at each batch size (num_scheduler_steps 8, CUDA graphs), the batch's
           CUDA-graph replay ms, and the fraction of the roofline: the bytes a step reads
           (every projection's quantised bytes, the LM head, the B embedding rows and the
           KV cache) over the measured device copy bandwidth;
  verify   step ms of verifying a 16-node chain per sequence at batch 1 over a plain step;
  profile  (with --profile) the kernel-time table of each batch's decode graph's replays;
  prefill  ms from adding one prompt of each `--prefill-lens` length to its first token, the
           prompt in one engine step (a fresh prompt each time: the prefix cache stays cold);
`speedup_vs_none` divides each format's tokens/s (prefill: prompt tokens/s) by bf16's from the same run.

`--shape 70b` times Llama-3-70B's shape instead (FP8 only fits one 80 GB GPU): it also
reports the KV cache's capacity in tokens left next to the weights. Speculation on a
quantised target (plain against the CPU draft, agreement built in) is `bench.e2e_speculation`'s
`--shape` and `--quantization`.

    python -m bench.quant_decode --quantization none,fp8,int4 --out bench/results
    python -m bench.quant_decode --shape 70b --quantization fp8 --batches 1 --sections decode --out bench/results
    python -m bench.quant_decode --quantization none,fp8,int4 --sections prefill --prefill-lens 128,512,1536
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch

from bench._machine import describe_machine
from bench._report import section_tables, write_markdown_and_json
from bench.gpu_decode import (LLAMA3_8B, LLAMA3_70B, ChainOracle, copy_bandwidth, decode_kv_bytes, graph_replay_ms, greedy,
                              profile_decode_step, random_prompts, timed_decode, timed_steps)
from gpu_target.quantization.linear import QuantizedLinear
from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine

SHAPES = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}


def engine_for(model_dir: str, quantization: str | None, max_num_seqs: int, utilization: float, max_model_len: int,
               proposer=None, num_speculative_tokens=None, max_num_batched_tokens: int = 512) -> LLMEngine:
    config = EngineConfig(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                          quantization=quantization, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs), gpu_memory_utilization=utilization,
                          num_speculative_tokens=num_speculative_tokens)
    return LLMEngine(config, proposer=proposer)


def weight_bytes_read(model, batch: int) -> int:
    """Bytes one decode step reads from the weights: every projection (quantised bytes), norms,
    the LM head, and `batch` rows of the embedding table."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.quantized.nbytes
    for name, parameter in model.named_parameters():
        if name == "embed_tokens.weight":
            total += batch * parameter.shape[1] * parameter.element_size()
            if model.lm_head is None:  # tied: the LM head reads the whole table
                total += parameter.nbytes
        else:
            total += parameter.nbytes
    return total


def bench_decode(model_dir, quantization, batches, prompt_len, new_tokens, bandwidth, utilization, max_model_len, rows,
                 profile=False):
    engine = engine_for(model_dir, quantization, max(batches), utilization, max_model_len)
    cfg = engine.model_config
    kv_tokens = (engine.kv_pool.num_blocks - 1) * engine.config.block_size
    rows.append(dict(section="memory", quantization=quantization or "none",
                     weights_GiB=round(torch.cuda.memory_allocated() / 2**30 - engine.kv_pool.storage.nbytes / 2**30, 2),
                     kv_cache_tokens=kv_tokens, cuda_graph_capture_s=round(engine.cuda_graph_capture_seconds, 1)))
    print(rows[-1], flush=True)
    for batch in batches:
        engine.scheduler.max_num_seqs = batch
        prompts = random_prompts(batch, prompt_len, cfg.vocab_size, seed=batch)
        timed_decode(engine, prompts[:1], 8)  # warm-up
        elapsed, tokens, _ = timed_decode(engine, prompts, new_tokens)
        steps_s = tokens / elapsed / batch
        kv_bytes = decode_kv_bytes(cfg, batch, prompt_len, new_tokens)
        step_bytes = weight_bytes_read(engine.model, batch) + kv_bytes
        replay_ms = graph_replay_ms(engine, batch)
        rows.append(dict(section="decode", quantization=quantization or "none", batch=batch,
                         tokens_per_s=round(tokens / elapsed, 1), step_ms=round(1e3 / steps_s, 3),
                         graph_replay_ms=round(replay_ms, 3) if replay_ms else "", GB_read_per_step=round(step_bytes / 1e9, 2),
                         roofline_steps_per_s=round(bandwidth / step_bytes, 1),
                         fraction_of_roofline=round(steps_s * step_bytes / bandwidth, 3),
                         graph_fraction_of_roofline=round(step_bytes / bandwidth / (replay_ms / 1e3), 3) if replay_ms else ""))
        print(rows[-1], flush=True)
        if profile and replay_ms:  # (a graph to replay)
            rows.append(dict(section="profile", quantization=quantization or "none", batch=batch,
                             text=profile_decode_step(engine, batch)))
    del engine


def bench_verify(model_dir, quantization, tree_nodes, prompt_len, utilization, max_model_len, rows, repeats=3):
    oracle = ChainOracle([], k=tree_nodes, p=0.0, vocab=LLAMA3_8B["vocab_size"], target_parallelism=64)
    engine = engine_for(model_dir, quantization, 1, utilization, max_model_len, oracle, num_speculative_tokens=tree_nodes)
    engine.spec_control.always_speculate = True  # this measures the cost of verifying
    prompts = random_prompts(1, prompt_len, engine.model_config.vocab_size, seed=7)
    runs: dict[int, list[float]] = {0: [], tree_nodes: []}
    for _ in range(repeats):
        for nodes in (0, tree_nodes):
            oracle.k = nodes
            engine.spec_control.max_nodes_per_seq = max(nodes, 1)
            runs[nodes].append(1e3 * timed_steps(engine, prompts, steps=32, headroom=64 + tree_nodes))
    plain, tree = float(np.median(runs[0])), float(np.median(runs[tree_nodes]))
    rows.append(dict(section="verify", quantization=quantization or "none", batch=1, tree_nodes=tree_nodes,
                     step_ms=round(tree, 3), plain_step_ms=round(plain, 3), ratio_to_plain=round(tree / plain, 3)))
    print(rows[-1], flush=True)
    del engine


def bench_prefill(model_dir, quantization, prompt_lens, utilization, max_model_len, rows, repeats=5):
    engine = engine_for(model_dir, quantization, 1, utilization, max_model_len, max_num_batched_tokens=max(prompt_lens))
    vocab = engine.model_config.vocab_size
    for length in prompt_lens:
        times = []
        for repeat in range(repeats + 1):  # the first one warms up
            prompt = random_prompts(1, length, vocab, seed=length * 100 + repeat)[0]
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.add_request(f"p{time.monotonic_ns()}", prompt, greedy(1))
            while engine.has_unfinished_requests():
                engine.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = float(np.median(times[1:]))
        rows.append(dict(section="prefill", quantization=quantization or "none", prompt_tokens=length,
                         ms=round(1e3 * seconds, 2), tokens_per_s=round(length / seconds, 1)))
        print(rows[-1], flush=True)
    del engine


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_none on each decode (prefill) row, against bf16's row of the same batch (prompt length)."""
    for section, key in (("decode", "batch"), ("prefill", "prompt_tokens")):
        base = {r[key]: r["tokens_per_s"] for r in rows if r.get("section") == section and r["quantization"] == "none"}
        for row in rows:
            if row.get("section") == section and row[key] in base:
                row["speedup_vs_none"] = round(row["tokens_per_s"] / base[row[key]], 2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="none,fp8,int4", help="comma-separated: none (bf16), fp8, int4")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--sections", default="decode,verify")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--tree-nodes", type=int, default=16)
    parser.add_argument("--prefill-lens", default="128,512,1536", help="prompt lengths the prefill section times")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="default: 0.55 for 8b (as bench.gpu_decode), 0.97 for 70b")
    parser.add_argument("--profile", action="store_true", help="each batch's decode graph's kernel times, per format")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    formats = [None if q == "none" else q for q in args.quantization.split(",")]
    sections = set(args.sections.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    utilization = args.gpu_memory_utilization or (0.97 if args.shape == "70b" else 0.55)
    model_dir = tempfile.mkdtemp(prefix=f"llama3-{args.shape}-shape-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(SHAPES[args.shape], f)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    torch.cuda.empty_cache()  # the copy's 4 GiB go back before a 70B target's weights are drawn
    rows: list[dict] = [dict(section="machine", copy_bandwidth_TBps=round(bandwidth / 1e12, 3))]
    for quantization in formats:
        if "decode" in sections:
            bench_decode(model_dir, quantization, batches, args.prompt_len, args.new_tokens, bandwidth, utilization,
                         args.max_model_len, rows, args.profile)
            gc.collect()
            torch.cuda.empty_cache()
        if "verify" in sections:
            bench_verify(model_dir, quantization, args.tree_nodes, args.prompt_len, utilization, args.max_model_len, rows)
            gc.collect()
            torch.cuda.empty_cache()
        if "prefill" in sections:
            bench_prefill(model_dir, quantization, [int(n) for n in args.prefill_lens.split(",")], utilization,
                          args.max_model_len, rows)
            gc.collect()
            torch.cuda.empty_cache()
    add_speedups(rows)
    info = dict(describe_machine(), torch=torch.__version__, gpu=torch.cuda.get_device_name(), python=platform.python_version())
    command = "python -m bench.quant_decode " + " ".join(sys.argv[1:] if argv is None else argv)
    body = section_tables(rows, ("machine", "memory", "decode", "verify", "prefill"))
    for row in rows:
        if row.get("section") == "profile":
            body += [f"## profile ({row['quantization']}, batch-{row['batch']} decode step)", "", "```", row["text"], "```", ""]
    stem = os.path.join(args.out, f"quant_decode-{args.shape}-{time.strftime('%Y%m%d-%H%M%S')}")
    print(write_markdown_and_json(stem, f"Quantised target decode ({args.shape}, {info['gpu']})", command, info, rows, body))


if __name__ == "__main__":
    main()
