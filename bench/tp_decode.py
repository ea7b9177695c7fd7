"""Tensor-parallel decode on a Llama-3 shape (8B or 70B, random bf16 weights, load_format="dummy"), NCCL against the one-shot all-reduce.

Two sections, the cheap one first:

- all_reduce: on a process group of --all-reduce-world ranks, microseconds per all-reduce of one
  bf16 message ([rows, hidden]: at the 8B shape 8 KiB is a batch-1 decode step's, 512 KiB a batch-64 one's), NCCL
  and the one-shot all-reduce over NVLink (gpu_target/custom_all_reduce.py), each issued eagerly
  one by one and replayed as one captured CUDA graph of a step's worth (two per layer and the
  embedding's). The one-shot's sum is checked against the exact one.
- decode: the engine's decode step time (multi-step decoding, CUDA graphs with the all-reduces
  captured inside them) for each of --configs (tensor_parallel_size:all-reduce) and batch, against
  its roofline: the bytes rank 0 reads a step (its weight shard as stored, quantised with
  --quantization, and its KV heads' share of the cache) at the copy bandwidth measured on GPU 0.

Each configuration's engine is built in a process of its own, which ends with it: a
configuration that fails or outlives --config-timeout is a row of the "failed" section, and
the others are measured still. Results are written after each section, so a run cut short
keeps what it measured.

    python -m bench.tp_decode --out bench/results
    python -m bench.tp_decode --shape 70b --configs 4:one-shot --batches 1,8,32,64 --all-reduce-world 1
    python -m bench.tp_decode --shape 70b --quantization fp8 --configs 2:one-shot,4:one-shot --all-reduce-world 1
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import platform
import queue
import sys
import tempfile
import time
from typing import Optional

import numpy as np
import torch

from bench._machine import describe_machine
from bench._report import section_tables, write_markdown_and_json
from bench.gpu_decode import (LLAMA3_8B, LLAMA3_70B, copy_bandwidth, count_triton_compiles, decode_kv_bytes, random_prompts,
                              timed_decode)
from bench.quant_decode import weight_bytes_read
from gpu_target.custom_all_reduce import set_up_one_shot
from gpu_target.tp_worker import free_port, make_group, make_store
from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine

SHAPES = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}
_BUILT: list[LLMEngine] = []  # the engine of this process's configuration, kept past `bench_engine`'s return
ALL_REDUCE_BACKENDS = ("nccl", "one-shot")


def bench_engine(model_dir: str, tp: int, all_reduce: str, batches: list[int], prompt_len: int, new_tokens: int,
                 steps: int, utilization: float, bandwidth: float, quantization: Optional[str] = None) -> list[dict]:
    count_triton_compiles()
    config = EngineConfig(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                          quantization=quantization, max_model_len=2048, max_num_seqs=max(batches), gpu_memory_utilization=utilization,
                          tensor_parallel_size=tp, num_scheduler_steps=steps,
                          disable_custom_all_reduce=all_reduce == "nccl")
    engine = LLMEngine(config)
    label = dict(tensor_parallel_size=tp, all_reduce=all_reduce if tp > 1 else "-", quantization=quantization or "none")
    one_shot_in_use = engine.model.tp.one_shot is not None
    rows = [dict(section="startup", **label, one_shot_in_use=one_shot_in_use,
                 cuda_graph_capture_s=round(engine.cuda_graph_capture_seconds, 1))]
    print(rows[-1], flush=True)
    cfg = engine.model_config
    for batch in batches:
        engine.scheduler.max_num_seqs = batch
        prompts = random_prompts(batch, prompt_len, cfg.vocab_size, seed=batch)
        timed_decode(engine, prompts[:1], 8)  # warm-up
        elapsed, tokens, _ = timed_decode(engine, prompts, new_tokens)
        step_s = elapsed * batch / tokens
        kv_bytes = decode_kv_bytes(cfg, batch, prompt_len, new_tokens)
        roofline_ms = 1e3 * (weight_bytes_read(engine.model, batch) + kv_bytes / tp) / bandwidth
        rows.append(dict(section="decode", **label, batch=batch, num_scheduler_steps=steps,
                         tokens_per_s=round(tokens / elapsed, 1), step_ms=round(1e3 * step_s, 3),
                         roofline_step_ms=round(roofline_ms, 3), fraction_of_roofline=round(roofline_ms / (1e3 * step_s), 3)))
        print(rows[-1], flush=True)
    _BUILT.append(engine)  # torn down when its process exits, after the rows went back (`in_own_process`)
    return rows


def _put_result(results, run, args: tuple) -> None:
    results.put(run(*args))


def in_own_process(run, args: tuple, timeout_s: float):
    """``run(*args)``'s result from a fresh spawned process; None when that process failed or
    had not returned within ``timeout_s`` (then it is killed: a tensor-parallel engine's
    workers end with it). ``run`` and its result must pickle."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_put_result, args=(results, run, args))  # not daemonic: it may start workers
    process.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return None
                if not process.is_alive():  # its result, if it put one, is in the pipe by now
                    try:
                        return results.get(timeout=1.0)
                    except queue.Empty:
                        return None
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(10)


def _time_ms(run, repeats: int) -> float:
    """Median milliseconds of `run()` over `repeats` timings with CUDA events."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        run()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))


def _per_call_us(reduce, x: torch.Tensor, calls: int) -> tuple[float, float]:
    """(eager, graph) microseconds per call of `reduce(x)`: `calls` issued one by one from
    Python, and the same `calls` captured in one CUDA graph and replayed."""
    def eager():
        for _ in range(calls):
            reduce(x)

    for _ in range(3):  # warm-up (and NCCL's communicator before its capture)
        eager()
    eager_ms = _time_ms(eager, 5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()
    graph_ms = _time_ms(graph.replay, 20)
    return 1e3 * eager_ms / calls, 1e3 * graph_ms / calls


def _all_reduce_rank(rank: int, world: int, port: int, sizes_kib: list[int], hidden: int, calls: int, queue) -> None:
    """Time one message size after another on this rank (rank 0 reports); every rank runs the
    same collectives in the same order."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = make_store(rank, world, port)
    group = make_group("nccl", store, rank, world)
    one_shot = set_up_one_shot(True, group, store, f"bench-tp-{port}", rank, world, device, torch.bfloat16)
    backends = {"nccl": lambda x: group.allreduce([x]).wait()}
    if one_shot is not None:
        backends["one-shot"] = one_shot
    for kib in sizes_kib:
        rows = kib * 1024 // (2 * hidden)
        row = dict(section="all_reduce", tensor_parallel_size=world, message_kib=kib, shape=f"[{rows}, {hidden}]")
        for name in ALL_REDUCE_BACKENDS:
            reduce = backends.get(name)
            if reduce is None:
                row.update({f"{name}_eager_us": None, f"{name}_graph_us": None})
                continue
            x = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device)
            eager_us, graph_us = _per_call_us(reduce, x, calls)
            row.update({f"{name}_eager_us": round(eager_us, 1), f"{name}_graph_us": round(graph_us, 1)})
        if one_shot is not None:
            x = torch.full((rows, hidden), rank + 1.0, dtype=torch.bfloat16, device=device)
            row["one_shot_sum_exact"] = bool((one_shot(x) == world * (world + 1) / 2).all())
        if rank == 0:
            queue.put(row)
    torch.cuda.synchronize()


def bench_all_reduce(world: int, sizes_kib: list[int], hidden: int, calls: int) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_all_reduce_rank, args=(r, world, port, sizes_kib, hidden, calls, queue))
                 for r in range(world)]
    for process in processes:
        process.start()
    rows = []
    try:
        for _ in sizes_kib:
            rows.append(queue.get(timeout=180))
            print(rows[-1], flush=True)
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
    return rows


def parse_configs(text: str) -> list[tuple[int, str]]:
    """"1:nccl,2:nccl,2:one-shot" -> [(1, "nccl"), (2, "nccl"), (2, "one-shot")]."""
    configs = []
    for item in text.split(","):
        size, _, all_reduce = item.partition(":")
        if all_reduce not in ALL_REDUCE_BACKENDS:
            raise ValueError(f"--configs item {item!r}: the all-reduce must be one of {ALL_REDUCE_BACKENDS}")
        configs.append((int(size), all_reduce))
    return configs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="the target's Llama-3 shape")
    parser.add_argument("--quantization", default=None, help="the target's weights quantised at load (fp8, int4; default bf16)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="default: 0.55 for 8b, 0.9 for 70b")
    parser.add_argument("--configs", default="1:nccl,2:nccl,2:one-shot", help="tensor_parallel_size:all-reduce, ...")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--scheduler-steps", type=int, default=8)
    parser.add_argument("--all-reduce-world", type=int, default=2, help="ranks of the all-reduce section; 1 skips it")
    parser.add_argument("--message-kib", default="8,16,64,256,512,1024")
    parser.add_argument("--config-timeout", type=float, default=300.0,
                        help="seconds a configuration's process may take (build and decode) before it is stopped")
    args = parser.parse_args(argv)
    try:
        configs = parse_configs(args.configs)
    except ValueError as error:
        parser.error(str(error))
    batches = [int(b) for b in args.batches.split(",")]
    needed = max([tp for tp, _ in configs] + [args.all_reduce_world])
    if needed > torch.cuda.device_count():
        parser.error(f"--configs {args.configs} / --all-reduce-world {args.all_reduce_world} need {needed} GPUs; "
                     f"{torch.cuda.device_count()} are visible")
    shape = SHAPES[args.shape]
    model_dir = tempfile.mkdtemp(prefix=f"llama3-{args.shape}-shape-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(shape, f)
    stem = os.path.join(args.out, f"tp_decode-{time.strftime('%Y%m%d-%H%M%S')}")
    write = functools.partial(write_results, stem, args.shape)
    rows: list[dict] = []
    if args.all_reduce_world > 1:
        rows += bench_all_reduce(args.all_reduce_world, [int(k) for k in args.message_kib.split(",")],
                                 shape["hidden_size"], 2 * shape["num_hidden_layers"] + 1)
        write(rows)
    bandwidth = copy_bandwidth(torch.device("cuda", 0))
    torch.cuda.empty_cache()  # the copy's buffers: the engines' processes size their KV caches from free memory
    utilization = args.gpu_memory_utilization or (0.9 if args.shape == "70b" else 0.55)
    for tp, all_reduce in configs:
        started = time.monotonic()
        measured = in_own_process(bench_engine, (model_dir, tp, all_reduce, batches, args.prompt_len, args.new_tokens,
                                                 args.scheduler_steps, utilization, bandwidth, args.quantization),
                                  args.config_timeout)
        if measured is None:
            measured = [dict(section="failed", tensor_parallel_size=tp, all_reduce=all_reduce,
                             seconds=round(time.monotonic() - started, 1), what="the process failed or ran out of time")]
            print(measured[0], flush=True)
        rows += measured
        write(rows)
    print(write(rows))


def write_results(stem: str, shape: str, rows: list[dict]) -> str:
    info = dict(describe_machine(), torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                gpus=torch.cuda.device_count(), python=platform.python_version())
    command = "python -m bench.tp_decode " + " ".join(sys.argv[1:])
    body = section_tables(rows, ("all_reduce", "startup", "decode", "failed"))
    return write_markdown_and_json(stem, f"Tensor-parallel decode, {shape.upper()} Llama-3 shape ({info['gpu']})", command, info,
                                   rows, body)


if __name__ == "__main__":
    main()
