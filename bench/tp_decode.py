"""Tensor-parallel decode on the 8B Llama-3 shape (random bf16 weights, load_format="dummy").

For each tensor_parallel_size and decode batch: the engine's decode step time (multi-step
decoding, CUDA graphs with the all-reduces captured inside them), and the all-reduce time
per step measured apart: on a process group of the same size, the step's all-reduces alone
(two per layer plus the embedding's, each [batch, hidden] bf16), eagerly one by one and as
one captured CUDA graph. Needs as many GPUs as the largest size.

    python -m bench.tp_decode --out bench/results
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch

from bench._machine import describe_machine
from bench._report import section_tables, write_markdown_and_json
from bench.gpu_decode import LLAMA3_8B, count_triton_compiles, random_prompts, timed_decode
from gpu_target.tp_worker import free_port, make_group, make_store
from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine


def bench_engine(model_dir: str, tp: int, batches: list[int], prompt_len: int, new_tokens: int, steps: int) -> list[dict]:
    config = EngineConfig(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                          max_model_len=2048, max_num_seqs=max(batches), gpu_memory_utilization=0.55,
                          tensor_parallel_size=tp, num_scheduler_steps=steps)
    engine = LLMEngine(config)
    rows = [dict(section="startup", tensor_parallel_size=tp, cuda_graph_capture_s=round(engine.cuda_graph_capture_seconds, 1))]
    for batch in batches:
        engine.scheduler.max_num_seqs = batch
        prompts = random_prompts(batch, prompt_len, engine.model_config.vocab_size, seed=batch)
        timed_decode(engine, prompts[:1], 8)  # warm-up
        elapsed, tokens, _ = timed_decode(engine, prompts, new_tokens)
        rows.append(dict(section="decode", tensor_parallel_size=tp, batch=batch, num_scheduler_steps=steps,
                         tokens_per_s=round(tokens / elapsed, 1), step_ms=round(1e3 * elapsed * batch / tokens, 3)))
        print(rows[-1], flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def _all_reduce_rank(rank: int, world: int, port: int, batches: list[int], hidden: int, per_step: int, queue) -> None:
    """Time a step's all-reduces on this rank (rank 0 reports): eager, then replayed as one graph."""
    torch.cuda.set_device(rank)
    group = make_group("nccl", make_store(rank, world, port), rank, world)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for batch in batches:
        x = torch.ones(batch, hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            group.allreduce([x]).wait()
        torch.cuda.synchronize()
        start.record()
        for _ in range(per_step):
            group.allreduce([x]).wait()
        stop.record()
        torch.cuda.synchronize()
        eager_ms = start.elapsed_time(stop)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(per_step):
                group.allreduce([x]).wait()
        replays = []
        for _ in range(20):
            start.record()
            graph.replay()
            stop.record()
            torch.cuda.synchronize()
            replays.append(start.elapsed_time(stop))
        if rank == 0:
            queue.put(dict(section="all_reduce", tensor_parallel_size=world, batch=batch, all_reduces_per_step=per_step,
                           message_kib=round(batch * hidden * 2 / 1024, 1), eager_ms_per_step=round(eager_ms, 3),
                           eager_us_each=round(1e3 * eager_ms / per_step, 1),
                           graph_ms_per_step=round(float(np.median(replays)), 3),
                           graph_us_each=round(1e3 * float(np.median(replays)) / per_step, 1)))


def bench_all_reduce(world: int, batches: list[int], hidden: int, per_step: int) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_all_reduce_rank, args=(r, world, port, batches, hidden, per_step, queue))
                 for r in range(world)]
    for process in processes:
        process.start()
    rows = [queue.get(timeout=300) for _ in batches]
    for process in processes:
        process.join(60)
    for row in rows:
        print(row, flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tensor-parallel-sizes", default="1,2")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--scheduler-steps", type=int, default=8)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.tensor_parallel_sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if max(sizes) > torch.cuda.device_count():
        parser.error(f"--tensor-parallel-sizes {args.tensor_parallel_sizes} needs {max(sizes)} GPUs; "
                     f"{torch.cuda.device_count()} are visible")
    model_dir = tempfile.mkdtemp(prefix="llama3-8b-shape-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(LLAMA3_8B, f)
    count_triton_compiles()
    rows: list[dict] = []
    for tp in sizes:
        rows += bench_engine(model_dir, tp, batches, args.prompt_len, args.new_tokens, args.scheduler_steps)
    per_step = 2 * LLAMA3_8B["num_hidden_layers"] + 1
    for tp in sizes:
        if tp > 1:
            rows += bench_all_reduce(tp, batches, LLAMA3_8B["hidden_size"], per_step)
    write_results(args, rows)


def write_results(args, rows: list[dict]) -> None:
    info = dict(describe_machine(), torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                gpus=torch.cuda.device_count(), python=platform.python_version())
    command = "python -m bench.tp_decode " + " ".join(sys.argv[1:])
    body = section_tables(rows, ("startup", "decode", "all_reduce"))
    stem = os.path.join(args.out, f"tp_decode-{time.strftime('%Y%m%d-%H%M%S')}")
    print(write_markdown_and_json(stem, f"Tensor-parallel decode, 8B Llama-3 shape ({info['gpu']})", command, info, rows, body))


if __name__ == "__main__":
    main()
