"""Plain vs speculative decoding with a real draft/target pair, everything on the CPU.

The target decodes a few of the project's workload prompts greedily at batch 1, first plainly,
then with the draft in the CPU draft worker (`cpu_draft_worker=True`); the engines are built
one after the other, so only one target is in memory at a time. Reports wall time, tokens/s,
mean accepted length, and whether both gave the same tokens (in float32 they must).

    python -m bench.cpu_pair --out bench/results
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

from bench import _workloads
from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from hetero import LLM, SamplingParams


def timed(llm: LLM, prompts: list[dict], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    seconds, tokens = [], []
    for prompt in prompts:
        start = time.perf_counter()
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        tokens.append(list(output.outputs[0].token_ids))
    return seconds, tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--draft", default="Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--workloads", default="code,rewrite,chat")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--label", default="vm")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    common = dict(model=args.target, device="cpu", dtype=args.dtype, max_model_len=2048, kv_cache_space=0.5)
    workloads = args.workloads.split(",")

    plain = LLM(**common)
    tokenizer = plain.get_tokenizer()
    prompts = [{"prompt_token_ids": _workloads.prompt_token_ids(tokenizer, _workloads.load_workload(w)[0])} for w in workloads]
    timed(plain, prompts[:1], 4)  # warm-up
    plain_s, plain_tokens = timed(plain, prompts, args.max_tokens)
    del plain
    gc.collect()

    spec = LLM(**common, speculative_model=args.draft, num_speculative_tokens=args.num_speculative_tokens,
               cpu_draft_worker=True)
    spec.llm_engine.spec_control.always_speculate = True  # measure speculation itself, not the controller's choice
    try:
        timed(spec, prompts[:1], 4)
        stats = spec.llm_engine.spec_stats
        rows = []
        for workload, prompt, seconds, tokens in zip(workloads, prompts, plain_s, plain_tokens):
            before = (stats.num_steps, stats.num_accepted_tokens)
            (spec_seconds,), (spec_tokens,) = timed(spec, [prompt], args.max_tokens)
            steps, accepted = stats.num_steps - before[0], stats.num_accepted_tokens - before[1]
            rows.append(dict(workload=workload, tokens=len(tokens), identical=tokens == spec_tokens,
                             plain_s=round(seconds, 2), speculative_s=round(spec_seconds, 2),
                             plain_tokens_per_s=round(len(tokens) / seconds, 2),
                             speculative_tokens_per_s=round(len(spec_tokens) / spec_seconds, 2),
                             speedup=round(seconds / spec_seconds * len(spec_tokens) / max(len(tokens), 1), 2),
                             mean_accepted_length=round((accepted + steps) / steps, 2) if steps else ""))
            print(rows[-1], flush=True)
    finally:
        spec.llm_engine.proposer.close()
    command = "python -m bench.cpu_pair " + " ".join(sys.argv[1:])
    body = [f"target {args.target}, draft {args.draft} in the CPU draft worker, k = {args.num_speculative_tokens}, "
            f"{args.dtype}, batch 1, greedy, {args.max_tokens} new tokens; the first prompt of each workload", "",
            *markdown_table(rows)]
    print(write_markdown_and_json(f"{args.out}/cpu_pair-{args.label}", "Real pair on the CPU: plain vs speculative",
                                  command, describe_machine(), rows, body))


if __name__ == "__main__":
    main()
