"""Lookahead-cache speculation vs plain decoding with the real small model on the CPU.

Three workloads, each generated greedily at batch 1 by a plain engine and by one with the
lookahead cache, side by side in one run: a rewrite task whose answer copies the prompt,
code completion, and open chat. Reports tokens/s, the speedup, mean tokens per
verification step, and whether both engines produced the same tokens (they must).

    python -m bench.cpu_lookahead --out bench/results
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from hetero import LLM, SamplingParams

REWRITE_TEXT = (
    "The lookahead cache keeps a trie of the tokens it has seen in prompts and outputs. When the "
    "model is about to generate text that already appeared, the cache proposes the continuation, "
    "and the target model verifies all of it in a single forward pass. Summaries, rewrites and "
    "retrieval-augmented answers copy long spans of their prompt, so they gain the most."
)
WORKLOADS = {
    "rewrite": [{"role": "user", "content": "Repeat the following paragraph exactly, word for word:\n\n" + REWRITE_TEXT}],
    "code": [{"role": "user", "content": "Complete this Python class with the same pattern for subtract, multiply and divide:\n\n"
              "class Calculator:\n    def add(self, a, b):\n        \"\"\"Return a + b.\"\"\"\n        return a + b\n"}],
    "chat": [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}],
}


def run(llm: LLM, messages, max_tokens: int) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    out = llm.chat(messages, params, use_tqdm=False)[0]
    return time.perf_counter() - start, out.outputs[0].token_ids


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--copy-length", type=int, default=8, help="lookahead tree depth")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per engine and workload (best is kept)")
    parser.add_argument("--dtype", default="float32", help="float32 makes both engines round alike, so outputs must match")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    config_dir = tempfile.mkdtemp(prefix="lookahead-")
    with open(os.path.join(config_dir, "lookahead_cache_config.json"), "w") as f:
        # No global history: a repeat would otherwise be drafted from its own earlier answer.
        json.dump({"is_debug": False, "copy_length": args.copy_length, "global_cache_switch": False}, f)
    common = dict(model=args.model, max_model_len=2048, max_num_seqs=1, dtype=args.dtype)
    plain = LLM(**common)
    lookahead = LLM(**common, lookahead_cache_config_dir=config_dir, num_speculative_tokens=32)
    rows = []
    for name, messages in WORKLOADS.items():
        run(plain, messages, 8)
        plain_s, plain_tokens = min((run(plain, messages, args.max_tokens) for _ in range(args.repeats)), key=lambda r: r[0])
        stats = lookahead.llm_engine.spec_stats
        before = (stats.num_steps, stats.num_accepted_tokens)
        spec_s, spec_tokens = min((run(lookahead, messages, args.max_tokens) for _ in range(args.repeats)), key=lambda r: r[0])
        steps = stats.num_steps - before[0]
        accepted = stats.num_accepted_tokens - before[1]
        rows.append(dict(
            workload=name, tokens=len(plain_tokens), identical=plain_tokens == spec_tokens,
            plain_tokens_per_s=round(len(plain_tokens) / plain_s, 1),
            lookahead_tokens_per_s=round(len(spec_tokens) / spec_s, 1),
            speedup=round(plain_s / spec_s * len(spec_tokens) / max(len(plain_tokens), 1), 2),
            tokens_per_verification=round((accepted + steps) / steps, 2) if steps else "",
        ))
        print(rows[-1], flush=True)
    write(args, rows)


def write(args, rows) -> None:
    info = dict(describe_machine(), torch=torch.__version__, torch_threads=torch.get_num_threads(), dtype=args.dtype)
    command = "python -m bench.cpu_lookahead " + " ".join(sys.argv[1:])
    body = ["Timings are the best of the repeats; `speedup` compares the two engines run side by side.", "",
            *markdown_table(rows)]
    print(write_markdown_and_json(os.path.join(args.out, f"cpu_lookahead-{info['hostname']}"),
                                  "Lookahead cache vs plain decoding, SmolLM2-135M-Instruct on the CPU",
                                  command, info, rows, body))


if __name__ == "__main__":
    main()
