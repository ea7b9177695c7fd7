"""Acceptance on real text: how many drafted tokens greedy verification accepts per step, for
each proposer, on the project's workloads (bench/data/workloads: code completion, code
rewrite, open chat, summarisation of a given passage).

The target's greedy continuation of each prompt is generated once with hetero's engine on the
CPU and cached (bench/data/reference). The draft model runs once over prompt + continuation
(one prefill, `prompt_logprobs=2`): its top-2 at every position give every draft chain and
top-2 tree exactly (see `bench._acceptance_sim`). The lookahead cache (raw / turbo / hybrid,
`lookahead/`) is replayed on the same continuations, and side by side with the draft chain
("draft + lookahead": each step the longer of the two). SmolLM2-135M is measured with the
lookahead cache on its own greedy continuations.

Prints a table, writes bench/results/acceptance-<label>.md/.json and the per-workload traces
bench/data/traces/<workload>.json that `bench.traces` replays.

    python -m bench.acceptance --num-prompts 8 --new-tokens 128
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import time
from typing import Any

from bench import _acceptance_sim as sim
from bench import _workloads
from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from bench.traces import TRACE_DIR
from lookahead import LookaheadCache, LookaheadConfig

LOOKAHEAD_MODES = {"raw": 0, "turbo": 1, "hybrid": 2}
CHAIN_DEPTHS = (2, 4, 8, 16)
TREE_DEPTHS = (4, 8)
TRACE_POSITIONS = 16


def draft_top2(draft: str, target: str, workload: str, references: list[dict], dtype: str) -> list[dict]:
    """Per reference: the draft's greedy token and its second choice after prompt + out[:j], every j.

    Cached beside the references (bench/data/reference/<draft>-on-<target>/<workload>.json).
    """
    path = _workloads.reference_path(f"{draft}-on-{target}", workload)
    ids = [r["id"] for r in references]
    if path.is_file():
        data = json.loads(path.read_text())
        by_id = {item["id"]: item for item in data["items"]}
        if data["dtype"] == dtype and all(i in by_id and len(by_id[i]["top1"]) == len(r["output_ids"])
                                          for i, r in zip(ids, references)):
            return [by_id[i] for i in ids]
    from hetero import LLM, SamplingParams

    llm = LLM(model=draft, device="cpu", dtype=dtype, max_model_len=4096, kv_cache_space=1, skip_tokenizer_init=True,
              max_num_batched_tokens=512)  # each chunk scores all its positions over the whole vocabulary
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": r["prompt_ids"] + r["output_ids"]} for r in references], params,
                           use_tqdm=False)
    items = []
    for reference, output in zip(references, outputs):
        start = len(reference["prompt_ids"])
        ranked = [_by_rank(entry) for entry in output.prompt_logprobs[start:]]
        items.append({"id": reference["id"], "top1": [r[0] for r in ranked], "top2": [r[1] for r in ranked]})
    del llm
    gc.collect()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"draft": draft, "target": target, "dtype": dtype, "items": items}, separators=(",", ":")))
    return items


def _by_rank(entry: dict) -> tuple[int, int]:
    ranked = sorted(((lp.rank, token) for token, lp in entry.items() if lp.rank in (1, 2)))
    return ranked[0][1], ranked[1][1]


def lookahead_cache(mode: str, copy_length: int, eos: list[int]) -> LookaheadCache:
    config = LookaheadConfig(cache_mode=LOOKAHEAD_MODES[mode], copy_length=copy_length, is_debug=False,
                             eos_token_id=eos[0] if eos else None)
    return LookaheadCache(config, memory_budget_bytes=1 << 30)


def measure_draft(references: list[dict], tops: list[dict]) -> dict[str, sim.StepLog]:
    logs: dict[str, sim.StepLog] = {}
    for reference, top in zip(references, tops):
        out = reference["output_ids"]
        proposers = {f"draft-chain-{k}": (sim.chain_steps(top["top1"], out, k), k) for k in CHAIN_DEPTHS}
        proposers.update({f"draft-tree2-{k}": (sim.chain_steps(top["top1"], out, k, top["top2"], 1), k) for k in TREE_DEPTHS})
        for name, (step, depth) in proposers.items():
            logs.setdefault(name, sim.StepLog()).extend(sim.replay(len(out), step, depth))
    return logs


def measure_lookahead(references: list[dict], copy_length: int, max_nodes: int, eos: list[int],
                      tops: list[dict] | None = None, prefix: str = "lookahead") -> dict[str, sim.StepLog]:
    """Each mode's cache replayed over the workload's requests in order (its global history grows
    across them, as a server's does); with `tops`, also hybrid side by side with the draft chain."""
    logs: dict[str, sim.StepLog] = {}
    runs = [(f"{prefix}-{mode}", mode, None) for mode in LOOKAHEAD_MODES]
    if tops is not None:
        runs.append((f"draft-chain-{copy_length}+lookahead-hybrid", "hybrid", copy_length))
    for name, mode, chain_depth in runs:
        cache = lookahead_cache(mode, copy_length, eos)
        log = logs.setdefault(name, sim.StepLog())
        for index, reference in enumerate(references):
            other = None
            if chain_depth is not None:
                other = sim.chain_steps(tops[index]["top1"], reference["output_ids"], chain_depth)
            log.extend(sim.replay_lookahead(cache, reference["id"], reference["prompt_ids"], reference["output_ids"],
                                            max_nodes, other, chain_depth or 0))
    return logs


def summary_row(model: str, workload: str, proposer: str, log: sim.StepLog, positions: int) -> dict[str, Any]:
    rates = log.per_position_acceptance(positions)
    return dict(model=model, workload=workload, proposer=proposer, steps=len(log.accepted),
                mean_accepted_length=round(log.mean_accepted_length(), 3),
                per_position=" ".join(f"{r:.2f}" for r in rates[:8]))


def trace_entry(log: sim.StepLog) -> dict[str, Any]:
    return dict(mean_accepted_length=round(log.mean_accepted_length(), 4),
                per_position=[round(r, 4) for r in log.per_position_acceptance(TRACE_POSITIONS)],
                accepted=log.accepted)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--draft", default="Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--lookahead-model", default="SmolLM2-135M-Instruct",
                        help="a second model measured with the lookahead cache alone ('' to skip)")
    parser.add_argument("--workloads", default=",".join(_workloads.WORKLOADS))
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per workload, evenly spread (default: all)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", help="of the target's and the draft's forwards on the CPU")
    parser.add_argument("--copy-length", type=int, default=8, help="lookahead tree depth")
    parser.add_argument("--max-nodes", type=int, default=32, help="lookahead tree nodes per step")
    parser.add_argument("--label", default="qwen2.5-coder")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)

    from hetero import LLM

    started = time.perf_counter()
    rows: list[dict] = []
    traces: dict[str, dict] = {}
    workloads = args.workloads.split(",")
    references = {}
    for model in [args.target] + ([args.lookahead_model] if args.lookahead_model else []):
        holder: dict[str, LLM] = {}

        def factory(model=model, holder=holder):
            if "llm" not in holder:
                holder["llm"] = LLM(model=model, device="cpu", dtype=args.dtype, max_model_len=4096, kv_cache_space=2)
            return holder["llm"]

        items = {w: _workloads.spread(_workloads.load_workload(w), args.num_prompts) for w in workloads}
        for workload, refs in _workloads.greedy_references_of_workloads(model, items, args.new_tokens, args.dtype,
                                                                         factory).items():
            references[model, workload] = refs
        holder.clear()
        gc.collect()

    from gpu_target import loader

    for workload in workloads:
        refs = references[args.target, workload]
        tops = draft_top2(args.draft, args.target, workload, refs, args.dtype)
        eos = list(loader.load_config(args.target).eos_token_ids)
        logs = {**measure_draft(refs, tops), **measure_lookahead(refs, args.copy_length, args.max_nodes, eos, tops)}
        if args.lookahead_model:
            small_eos = list(loader.load_config(args.lookahead_model).eos_token_ids)
            small = measure_lookahead(references[args.lookahead_model, workload], args.copy_length, args.max_nodes,
                                      small_eos, prefix=f"{args.lookahead_model}-lookahead")
        else:
            small = {}
        for name, log in logs.items():
            rows.append(summary_row(args.target, workload, name, log, TRACE_POSITIONS))
        for name, log in small.items():
            rows.append(summary_row(args.lookahead_model, workload, name, log, TRACE_POSITIONS))
        traces[workload] = dict(
            target=args.target, draft=args.draft, num_prompts=len(refs), new_tokens=args.new_tokens, dtype=args.dtype,
            proposers={name: trace_entry(log) for name, log in {**logs, **small}.items()},
        )
        for row in rows[-len(logs) - len(small):]:
            print(row, flush=True)
    write(args, rows, traces, time.perf_counter() - started)


def pivot(rows: list[dict]) -> list[dict]:
    """Mean accepted length: one row per (model, proposer), one column per workload."""
    table: dict[tuple[str, str], dict] = {}
    for row in rows:
        key = (row["model"], row["proposer"])
        table.setdefault(key, dict(model=row["model"], proposer=row["proposer"]))[row["workload"]] = row["mean_accepted_length"]
    return list(table.values())


def write(args, rows: list[dict], traces: dict[str, dict], seconds: float) -> None:
    TRACE_DIR.mkdir(parents=True, exist_ok=True)
    for workload, trace in traces.items():
        (TRACE_DIR / f"{workload}.json").write_text(json.dumps(trace, separators=(",", ":")))
    command = "python -m bench.acceptance " + " ".join(sys.argv[1:])
    machine = describe_machine()
    settings = (f"{args.num_prompts or 'all'} prompts per workload, up to {args.new_tokens} new tokens (greedy, "
                f"stopping at EOS), {args.dtype} forwards on the CPU; lookahead trees up to {args.copy_length} deep "
                f"and {args.max_nodes} nodes; {seconds:.0f} s")
    body = [settings, "", "## mean accepted length (tokens per verification step, bonus included)", "",
            *markdown_table(pivot(rows)), "", "## per workload and proposer (per-position acceptance, positions 1-8)", "",
            *markdown_table(rows)]
    stem = str(pathlib.Path(args.out) / f"acceptance-{args.label}")
    print(write_markdown_and_json(stem, "Acceptance on real text", command, machine, rows, body))


if __name__ == "__main__":
    main()
