"""A multi-turn chat workload against the prefix cache, with and without its CPU offload tier.

Conversations share one system prompt; each turn's prompt is the whole history so far
(system, earlier user turns and replies) plus a new user message. Replies in the history
are a fixed script (a replayed chat), so every configuration serves the same prompts and
the generated tokens can be compared. All conversations take their turn before any takes
the next, `--concurrency` at a time, and there are enough of them that the distinct
tokens of the last turn's prompts (the working set) are `--working-set-ratio` times what
the device's KV cache holds: a conversation's history is evicted from device memory
before its next turn. Without the offload tier that history is recomputed; with it, it is
copied back from the CPU pool (TACO-LLM's prefix cache offload).

Reports, per configuration, the median time to first token (all requests, the first turn,
and turns after the first), its mean and 90th percentile, the prompt tokens prefilled
(prompt minus tokens found in the cache), where the cached tokens came from, the stalls
the offload tier still caused, and whether the outputs equal the first configuration's.

    python -m bench.multi_turn_chat                   # on the CPU: a small random model, float32
    python -m bench.multi_turn_chat --device cuda     # an 8B Llama-3-shaped target, random bf16 weights
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from bench.gpu_decode import LLAMA3_8B
from gpu_target.kv_cache import KVCachePool
from gpu_target.loader import load_config
from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine
from hetero.core.sampling_params import RequestOutputKind, SamplingParams

SMALL_CPU_MODEL = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=2048, hidden_size=256,
    intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
)
CONFIGS = {
    "no prefix cache": dict(enable_prefix_caching=False),
    "prefix cache": dict(enable_prefix_caching=True),
    "prefix cache + CPU offload": dict(enable_prefix_caching=True, enable_prefix_cache_offload=True),
}
# Per device: the model, dtype and workload shape run by default.
DEFAULTS = {
    "cpu": dict(model=SMALL_CPU_MODEL, dtype="float32", kv_blocks=48, system_tokens=128, user_tokens=48,
                reply_tokens=16, turns=4, concurrency=2, max_model_len=512),
    "cuda": dict(model=LLAMA3_8B, dtype="bfloat16", kv_blocks=1024, system_tokens=512, user_tokens=256,
                 reply_tokens=64, turns=4, concurrency=8, max_model_len=2048),
}


@dataclass
class Workload:
    """Every conversation's prompt at every turn, as token ids, and the reply length asked for."""

    prompts: list[list[list[int]]]  # [conversation][turn]
    reply_tokens: int
    system_tokens: int

    @property
    def working_set_tokens(self) -> int:
        """Distinct tokens of the last turn's prompts: the system prompt once, then each history."""
        return self.system_tokens + sum(len(chat[-1]) - self.system_tokens for chat in self.prompts)


def build_workload(num_conversations: int, turns: int, system_tokens: int, user_tokens: int, reply_tokens: int,
                   vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    system = tokens(system_tokens)
    prompts = []
    for _ in range(num_conversations):
        history, chat = list(system), []
        for turn in range(turns):
            history += tokens(rng.randint(user_tokens // 2, user_tokens))
            chat.append(list(history))
            history += tokens(reply_tokens)  # the scripted reply
        prompts.append(chat)
    return Workload(prompts, reply_tokens, system_tokens)


def conversations_for(capacity_tokens: int, ratio: float, turns: int, system_tokens: int, user_tokens: int,
                      reply_tokens: int) -> int:
    """Conversations whose last prompts hold `ratio` x `capacity_tokens` distinct tokens (user turns at their mean)."""
    per_conversation = turns * (0.75 * user_tokens) + (turns - 1) * reply_tokens
    return max(1, math.ceil((ratio * capacity_tokens - system_tokens) / per_conversation))


def write_model_dir(config: dict) -> str:
    """A config.json-only model directory: weights are random (load_format="dummy"), prompts token ids."""
    directory = tempfile.mkdtemp(prefix="multi-turn-")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def serve_workload(engine: LLMEngine, workload: Workload, concurrency: int) -> list[dict]:
    """Run every conversation's turns, `concurrency` requests at a time; one record per request."""
    params = SamplingParams(temperature=0.0, max_tokens=workload.reply_tokens, ignore_eos=True, detokenize=False)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    records = []
    for turn in range(len(workload.prompts[0])):
        for start in range(0, len(workload.prompts), concurrency):
            wave = range(start, min(start + concurrency, len(workload.prompts)))
            arrival = time.time()
            for chat in wave:
                engine.add_request(f"c{chat}t{turn}", {"prompt_token_ids": workload.prompts[chat][turn]}, params, arrival)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished:
                        continue
                    metrics = output.metrics
                    records.append(dict(
                        request=output.request_id, turn=turn, prompt_tokens=len(output.prompt_token_ids),
                        cached_tokens=output.num_cached_tokens, ttft_s=metrics.first_token_time - metrics.arrival_time,
                        tokens=output.outputs[0].token_ids,
                    ))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return records


def run_config(name: str, flags: dict, base: dict, workload: Workload, concurrency: int, warmup: list[int]) -> dict:
    engine = LLMEngine(EngineConfig(**base, **flags))
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False)
    engine.add_request("warmup", {"prompt_token_ids": warmup}, warm)
    while engine.has_unfinished_requests():
        engine.step()
    allocator = engine.scheduler.allocator
    stats_before = (allocator.stats.hits, allocator.stats.external_hits)
    started = time.perf_counter()
    records = serve_workload(engine, workload, concurrency)
    wall = time.perf_counter() - started
    offload = allocator.offload
    row = dict(
        config=name,
        requests=len(records),
        device_kv_blocks=engine.kv_pool.num_blocks,
        median_ttft_ms=round(1000 * statistics.median(r["ttft_s"] for r in records), 2),
        median_ttft_first_turn_ms=round(1000 * statistics.median(r["ttft_s"] for r in records if r["turn"] == 0), 2),
        median_ttft_later_turns_ms=round(1000 * statistics.median(r["ttft_s"] for r in records if r["turn"] > 0), 2),
        mean_ttft_ms=round(1000 * statistics.fmean(r["ttft_s"] for r in records), 2),
        p90_ttft_ms=round(1000 * _quantile([r["ttft_s"] for r in records], 0.9), 2),
        prompt_tokens=sum(r["prompt_tokens"] for r in records),
        prefill_tokens_computed=sum(r["prompt_tokens"] - r["cached_tokens"] for r in records),
        device_hit_tokens=allocator.stats.hits - stats_before[0],
        cpu_restored_tokens=allocator.stats.external_hits - stats_before[1],
        blocks_offloaded=offload.num_offloaded if offload is not None else 0,
        blocks_restored=offload.num_restored if offload is not None else 0,
        # Stalls the offload tier can still cause: a device block reused before its copy was
        # done (the compute stream waits), and steps held back because every admitted
        # request was waiting for its restore (the host waits).
        reuse_waits=offload.num_reuse_waits if offload is not None else 0,
        restore_waits=engine.scheduler.num_restore_waits,
        wall_s=round(wall, 2),
    )
    tokens = {r["request"]: r["tokens"] for r in records}
    del engine, allocator, offload
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dict(row=row, tokens=tokens)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--kv-blocks", type=int, help="device KV cache size in blocks, the same for every "
                        "configuration (num_gpu_blocks_override)")
    parser.add_argument("--working-set-ratio", type=float, default=3.0,
                        help="distinct tokens of the last turns' prompts over the device KV cache's tokens")
    parser.add_argument("--conversations", type=int, help="default: as many as --working-set-ratio needs")
    for name in ("system_tokens", "user_tokens", "reply_tokens", "turns", "concurrency", "max_model_len"):
        parser.add_argument("--" + name.replace("_", "-"), type=int)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="the engine's prefill token budget per step (default: the engine's, 2048)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but PyTorch sees no CUDA GPU")
    chosen = [name.strip() for name in args.configs.split(",")]
    unknown = [name for name in chosen if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown --configs {unknown}; known: {list(CONFIGS)}")
    shape = {**DEFAULTS[args.device], **{k: v for k, v in vars(args).items() if k in DEFAULTS[args.device] and v is not None}}
    model_dir = write_model_dir(shape["model"])
    base = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=shape["dtype"], device=args.device,
                seed=args.seed, max_model_len=shape["max_model_len"], max_num_seqs=shape["concurrency"],
                block_size=args.block_size, num_gpu_blocks_override=shape["kv_blocks"],
                max_num_batched_tokens=args.max_num_batched_tokens)
    capacity_tokens = shape["kv_blocks"] * args.block_size
    num_conversations = args.conversations or conversations_for(
        capacity_tokens, args.working_set_ratio, shape["turns"], shape["system_tokens"], shape["user_tokens"], shape["reply_tokens"],
    )
    workload = build_workload(num_conversations, shape["turns"], shape["system_tokens"], shape["user_tokens"],
                              shape["reply_tokens"], shape["model"]["vocab_size"], args.seed)
    longest = max(len(chat[-1]) for chat in workload.prompts) + shape["reply_tokens"]
    if longest > shape["max_model_len"]:
        parser.error(f"the last turn needs {longest} tokens, more than --max-model-len {shape['max_model_len']}")
    block_bytes = KVCachePool.bytes_per_block(load_config(model_dir, require_weights=False), args.block_size,
                                              getattr(torch, shape["dtype"]))
    cpu_offload_gib = 1.25 * workload.working_set_tokens / args.block_size * block_bytes / 2**30 + 0.01
    warmup = [random.Random(-1).randrange(shape["model"]["vocab_size"]) for _ in range(3 * args.block_size)]
    results = {}
    for name in chosen:
        flags = dict(CONFIGS[name])
        if flags.get("enable_prefix_cache_offload"):
            flags["cpu_offload_gib"] = cpu_offload_gib
        results[name] = run_config(name, flags, base, workload, shape["concurrency"], warmup)
        print(json.dumps(results[name]["row"]), flush=True)
    reference = results[chosen[0]]["tokens"]
    rows = []
    for name in chosen:
        row = results[name]["row"]
        same = sum(results[name]["tokens"][request] == tokens for request, tokens in reference.items())
        row["outputs_equal_to_first"] = f"{same}/{len(reference)}"
        row["working_set_over_device_kv"] = round(workload.working_set_tokens / (row["device_kv_blocks"] * args.block_size), 2)
        rows.append(row)
    offload_row = results.get("prefix cache + CPU offload", {}).get("row")
    cache_row = results.get("prefix cache", {}).get("row")
    summary = []
    if offload_row and cache_row:
        summary.append(
            f"median TTFT with offload / without: {offload_row['median_ttft_ms'] / cache_row['median_ttft_ms']:.2f}x "
            f"(later turns {offload_row['median_ttft_later_turns_ms'] / cache_row['median_ttft_later_turns_ms']:.2f}x); "
            f"prefill tokens computed {offload_row['prefill_tokens_computed']} vs {cache_row['prefill_tokens_computed']}"
        )
    workload_line = (
        f"{num_conversations} conversations x {shape['turns']} turns, system prompt {shape['system_tokens']} tokens, "
        f"user turns {shape['user_tokens'] // 2}-{shape['user_tokens']} tokens, replies {shape['reply_tokens']} tokens, "
        f"{shape['concurrency']} requests at a time; working set {workload.working_set_tokens} tokens; "
        f"model {shape['model']['hidden_size']}-wide x {shape['model']['num_hidden_layers']} layers, {shape['dtype']}; "
        f"max_num_batched_tokens {args.max_num_batched_tokens or 'the engine default'}"
    )
    table = markdown_table(rows)
    print("\n".join([workload_line, *table, *summary]))
    command = "python -m bench.multi_turn_chat " + " ".join(sys.argv[1:] if argv is None else argv)
    write_markdown_and_json(
        os.path.join(args.out, f"multi-turn-chat-{args.device}"), "Multi-turn chat: prefix cache and its CPU offload tier",
        command.strip(), describe_machine(), rows, [workload_line, "", *table, "", *summary],
    )


if __name__ == "__main__":
    main()
