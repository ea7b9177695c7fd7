"""End-to-end decode throughput of every proposer on a Llama-3-shaped target (GPU host).

Configurations, side by side in one run: plain decoding, the lookahead cache, a draft
model on the CPU in its own worker process, the same draft on the GPU (in the engine's
process, CUDA graphs, as vLLM runs a draft model), and the CPU draft merged with the
lookahead cache (hybrid). Reports tokens/s, tokens per verification step, the time the
engine waited for drafts (per step and as a share of the run) and, for the CPU worker,
the share of drafting hidden behind the GPU's verification and the proposals answered
with no trees because its reply was late.

Random weights cannot agree by chance, so agreement is built in (`bench.agreement`): the
target's embedding and LM head carry the draft's in their first columns and every layer's
output projections are damped, which makes the target's greedy next token the draft's, on
every tensor-parallel rank's shard (`--tensor-parallel-size`). Text has a frequency
structure the draft's reduced head (`--draft-vocab`, FR-Spec) relies on: the head rows of
tokens beyond the `--hot-tokens` most frequent are scaled by `--cold-scale` in both models,
so greedy tokens are mostly frequent ones.
`--head-noise` adds noise to the target's other LM-head columns to lower the agreement, and
`--trace` caps each tree at the accepted length a real draft got on real text (`TraceReplay`).
The bytes and FLOPs per step are those of the real shapes: 8B by default, `--shape 70b`
for Llama-3-70B's (in FP8, `--quantization fp8`, it fits one 80 GB GPU), where a
verification step is long and the CPU draft cheap beside it. `--rounds N` times N runs
after each warm-up (one engine, new prompts each), for a ratio's spread within one run.

    python -m bench.e2e_speculation --out bench/results
    python -m bench.e2e_speculation --shape 70b --quantization fp8 --batches 1,8 --configs plain,cpu-draft
    python -m bench.e2e_speculation --shape 70b --tensor-parallel-size 4 --batches 1,8,32 --configs plain,cpu-draft
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from bench.agreement import DRAFT_FILE, draft_weights, graft_draft_into_target
from bench.gpu_decode import LLAMA3_8B, LLAMA3_70B, random_prompts, timed_decode
from gpu_target.loader import load_config, load_tokenizer
from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine
from hetero.proposers import build_proposer, draft_worker, draft_worker_stats
from hetero.core.protocols import DraftsAhead, KnowsWhenReady, Proposer, TokenTree

SHAPES = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}
DRAFT = dict(LLAMA3_8B, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=9, num_key_value_heads=3, torch_dtype="bfloat16")
WARM_UP_TOKENS = 128  # tokens per request of the warm-up batch before each timed run


def save_tokenizer(directory: str, vocab_size: int) -> None:
    """A word-level tokenizer with the model's vocabulary size (the benchmark feeds token ids)."""
    import transformers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), eos_token="t1", unk_token="t0"
    )
    tokenizer.save_pretrained(directory)


def write_model_dir(config: dict) -> str:
    directory = tempfile.mkdtemp(prefix=f"h{config['hidden_size']}-")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    save_tokenizer(directory, config["vocab_size"])
    return directory


class TraceReplay(Proposer):
    """A proposer whose trees are cut to the accepted length a real-text trace draws (`bench.traces`).

    The real proposer drafts (and pays for) every tree; the tree is then kept down to a depth
    drawn from the trace, and one node below it is kept with its token changed, so the target
    accepts at most that depth (agreement is built in, so the draft's own token there is the
    target's; the changed one is not). Draft models draw by the trace's per-position rates at
    the tree's depth; proposers that often propose nothing (the lookahead cache) draw recorded
    steps (`recorded_steps`). The worker still drafts ahead on its own guess, so its misses are
    those real acceptance causes.
    """

    def __init__(self, draft: Proposer, trace, vocab_size: int, seed: int = 0, recorded_steps: bool = False):
        self.draft, self.trace, self.vocab_size = draft, trace, vocab_size
        self.recorded_steps = recorded_steps
        self.rng = random.Random(seed)

    def propose(self, batch):
        return [self._cut(tree) for tree in self.draft.propose(batch)]

    def _cut(self, tree: TokenTree) -> TokenTree:
        depths = []
        for parent in tree.parent_list:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        if not depths:
            return tree
        deepest = max(depths)
        draw = self.trace.sample_recorded if self.recorded_steps else self.trace.sample_accepted
        keep = draw(deepest, self.rng)
        if keep == deepest:
            return tree
        below = depths.index(keep + 1)  # the first node under the kept depth: on a draft's tree, its chain's
        nodes = [i for i, depth in enumerate(depths) if depth <= keep or i == below]
        index = {node: position for position, node in enumerate(nodes)}
        tokens = [tree.token_list[i] for i in nodes]
        tokens[index[below]] = (tokens[index[below]] + 1) % self.vocab_size
        parents = [-1 if tree.parent_list[i] < 0 else index[tree.parent_list[i]] for i in nodes]
        return TokenTree(tokens, parents)

    @property
    def target_parallelism(self) -> int:
        """The wrapped proposer's node budget per step, which the engine reads; an AttributeError (it
        has none) gives the engine's default, as for an unwrapped proposer."""
        return self.draft.target_parallelism

    def observe(self, batch):
        if isinstance(self.draft, DraftsAhead):
            self.draft.observe(batch)

    def ready_in(self):
        return self.draft.ready_in() if isinstance(self.draft, KnowsWhenReady) else 0.0

    def commit(self, verdicts):
        self.draft.commit(verdicts)

    def release(self, request_id):
        self.draft.release(request_id)

    def close(self):
        self.draft.close()


def build_engine(target_dir: str, draft_dir: str, args, **speculation) -> LLMEngine:
    config = EngineConfig(
        model=target_dir, load_format="dummy", dtype="bfloat16", quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size, disable_custom_all_reduce=args.disable_custom_all_reduce,
        max_model_len=args.prompt_len + args.new_tokens + 64, max_num_seqs=max(args.batches),
        gpu_memory_utilization=args.gpu_memory_utilization or (0.97 if args.shape == "70b" else 0.5), **speculation,
    )
    proposer = None
    if args.trace and config.speculative_model:
        from bench.traces import load_trace

        model_config = load_config(target_dir, require_weights=False)
        inner = build_proposer(config, model_config, load_tokenizer(target_dir))
        proposer = TraceReplay(inner, load_trace(args.trace), model_config.vocab_size)
    engine = LLMEngine(config, proposer)
    engine.collective_rpc(graft_draft_into_target, args=(draft_dir, args.head_noise, 1))
    if engine.proposer is not None and args.always_speculate:
        engine.spec_control.always_speculate = True
    return engine


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 32, 64])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="the target's Llama-3 shape")
    parser.add_argument("--quantization", default=None, help="the target's weights (fp8, int4; default bf16)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="the target over this many GPUs")
    parser.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="NCCL for every all-reduce (vLLM's flag)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="default: 0.5 for 8b, 0.97 for 70b")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=0,
                        help="draft tokens per step (the tree's node budget); 0: the engine's default, as a user gets it")
    parser.add_argument("--draft-vocab", type=int, default=32768, help="the drafts' reduced head (FR-Spec); 0: the whole vocabulary")
    parser.add_argument("--hot-tokens", type=int, default=32768, help="the text's most frequent tokens (the lowest ids)")
    parser.add_argument("--cold-scale", type=float, default=0.8, help="scale of the other tokens' head rows in both models")
    parser.add_argument("--head-noise", type=float, default=0.0)
    parser.add_argument("--cpu-draft-quantization", choices=["none", "int8"], default="int8",
                        help="the CPU worker's weights (speculative_config's quantization); the GPU draft stays in bf16")
    parser.add_argument("--configs", default="plain,lookahead,cpu-draft,gpu-draft,hybrid")
    parser.add_argument("--always-speculate", action="store_true", help="keep the controller from switching speculation off")
    parser.add_argument("--trace", default=None,
                        help="replay a real-text acceptance trace (bench/data/traces: e.g. chat, code/draft-chain-4) "
                             "on the draft models' trees instead of the built-in agreement alone")
    parser.add_argument("--rounds", type=int, default=1,
                        help="timed runs per configuration and batch after its one warm-up, each on new prompts; "
                             "each round's speedup is against plain's same round (same prompts), and the table "
                             "ends with each configuration's median over the rounds")
    parser.add_argument("--log-level", default=None, choices=["debug", "info"],
                        help="debug: a line per engine step and per draft-worker message on stderr (HETERO_LOGGING_LEVEL)")
    args = parser.parse_args(argv)
    if args.shape == "70b":  # ~68 GiB of FP8 weights on an 80 GB GPU: the cache allocator must not strand free memory
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.makedirs(args.out, exist_ok=True)
    if args.log_level:
        os.environ["HETERO_LOGGING_LEVEL"] = args.log_level.upper()  # the draft worker's
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    target = SHAPES[args.shape]
    target_dir = write_model_dir(target)
    draft_dir = write_model_dir(DRAFT)
    draft = draft_weights(draft_dir, seed=7, hot_tokens=args.hot_tokens, cold_scale=args.cold_scale)
    save_file(draft, os.path.join(draft_dir, DRAFT_FILE))
    lookahead_dir = tempfile.mkdtemp(prefix="lookahead-")
    with open(os.path.join(lookahead_dir, "lookahead_cache_config.json"), "w") as f:
        json.dump({"is_debug": False, **({"copy_length": args.k} if args.k else {})}, f)
    draft_model = dict(speculative_model=draft_dir, num_speculative_tokens=args.k or None,
                       speculative_draft_vocab_size=args.draft_vocab or None)
    lookahead = dict(lookahead_cache_config_dir=lookahead_dir, num_speculative_tokens=args.k or None)
    cpu_draft = {"quantization": None if args.cpu_draft_quantization == "none" else args.cpu_draft_quantization}
    speculation = {
        "plain": {},
        "lookahead": lookahead,
        "cpu-draft": dict(draft_model, cpu_draft_worker=True, speculative_config=cpu_draft),
        "gpu-draft": dict(draft_model, cpu_draft_worker=False),
        "hybrid": dict(draft_model, cpu_draft_worker=True, lookahead_cache_config_dir=lookahead_dir,
                       speculative_config=cpu_draft),
    }
    rows, draft_cpus = [], None
    for name in args.configs.split(","):
        engine = build_engine(target_dir, draft_dir, args, **speculation[name])
        worker = draft_worker(engine.proposer)
        if worker is not None:
            draft_cpus = list(worker.options.cpus)
        for batch in args.batches:
            # A warm-up batch of the same size: kernels built and tuned for its shapes, the draft's
            # buffers grown and the speculation controller's first verdict taken (three steps of
            # each option, then probes at widening spacing) before the timed runs, as they are once
            # per batch size in a server's life; the timed runs are the steady state after them.
            timed_decode(engine, random_prompts(batch, args.prompt_len, target["vocab_size"], seed=1000 + batch), WARM_UP_TOKENS)
            for round_ in range(args.rounds):
                prompts = random_prompts(batch, args.prompt_len, target["vocab_size"], seed=batch + 10_000 * round_)
                row = dict(config=name, shape=args.shape, quantization=args.quantization or "none", trace=args.trace or "",
                           batch=batch, round=round_, **timed_row(engine, prompts, args.new_tokens))
                rows.append(row)
                print(row, flush=True)
        release_engine(engine)
        del engine
    write(args, rows, median_speedups(rows), draft_cpus)


def timed_row(engine: LLMEngine, prompts: list[dict], new_tokens: int) -> dict:
    """One timed run's measurements: tokens/s, the speculative steps and their acceptance, the
    draft wait, the steps whose proposals came back only pending (the proposer not ready: a draft
    worker prefilling prompts), and for a CPU draft worker its hidden share, draft-ahead hits, a
    draft forward's time in service (`ahead_ms_per_level`, to hold against `bench.cpu_draft`'s
    forward alone) and late replies."""
    batch = len(prompts)
    before = (engine.spec_stats.num_steps, engine.spec_stats.num_accepted_tokens, engine.spec_stats.num_draft_tokens,
              engine.draft_wait_seconds, draft_worker_stats(engine.proposer), engine.num_unready_steps)
    elapsed, tokens, _ = timed_decode(engine, prompts, new_tokens)
    steps = engine.spec_stats.num_steps - before[0]
    accepted = engine.spec_stats.num_accepted_tokens - before[1]
    drafted = engine.spec_stats.num_draft_tokens - before[2]
    waited = engine.draft_wait_seconds - before[3]
    spec_steps = steps / batch  # engine steps that verified trees (one tree per sequence each)
    row = dict(tokens_per_s=round(tokens / elapsed, 1), spec_seq_steps=steps, draft_tokens=drafted,
               mean_accepted_length=round((accepted + steps) / steps, 2) if steps else "",
               wait_ms_per_spec_step=round(1e3 * waited / spec_steps, 2) if steps else "",
               wait_share=round(waited / elapsed, 3), unready_steps=engine.num_unready_steps - before[5])
    after = draft_worker_stats(engine.proposer)
    if after is not None:
        hidden, exposed = (after[n] - before[4][n] for n in ("hidden_s", "exposed_s"))
        hits, misses = (after[n] - before[4][n] for n in ("predraft_hits", "predraft_misses"))
        ahead_s, ahead_levels = (after[n] - before[4][n] for n in ("ahead_s", "ahead_levels"))
        row["hidden_share"] = round(hidden / (hidden + exposed), 3) if hidden + exposed else ""
        row["ahead_ms_per_level"] = round(1e3 * ahead_s / ahead_levels, 2) if ahead_levels else ""
        row["predraft_hit_rate"] = round(hits / (hits + misses), 3) if hits + misses else ""
        row["late_replies"] = int(after["late_replies"] - before[4]["late_replies"])  # answered empty, not waited for
    return row


def median_speedups(rows: list[dict]) -> list[dict]:
    """Set each row's `speedup_vs_plain` against the plain row of its batch and round (the same
    prompts); per configuration and batch, the median, lowest and highest over the rounds."""
    plain = {(r["batch"], r["round"]): r["tokens_per_s"] for r in rows if r["config"] == "plain"}
    groups: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        if (row["batch"], row["round"]) in plain:
            row["speedup_vs_plain"] = round(row["tokens_per_s"] / plain[row["batch"], row["round"]], 2)
            groups.setdefault((row["config"], row["batch"]), []).append(row["speedup_vs_plain"])
    return [dict(config=config, batch=batch, rounds=len(values), median_speedup=round(statistics.median(values), 3),
                 lowest=min(values), highest=max(values)) for (config, batch), values in groups.items()]


def release_engine(engine: LLMEngine) -> None:
    """Stop the engine's draft worker (if any) and give its GPU memory back before the next engine."""
    if engine.proposer is not None:
        engine.proposer.close()
    engine.__dict__.clear()
    gc.collect()
    torch.cuda.empty_cache()


def write(args, rows, medians, draft_cpus: Optional[list[int]] = None) -> None:
    """The run's Markdown and JSON, with the cores the CPU draft worker ran on (`draft_cpus`) when one did."""
    info = dict(describe_machine(), torch=torch.__version__, gpu=torch.cuda.get_device_name())
    if draft_cpus is not None:
        info["draft_cpus"] = ",".join(map(str, draft_cpus))
    command = "python -m bench.e2e_speculation " + " ".join(sys.argv[1:])
    stem = os.path.join(args.out, "e2e_speculation-" + time.strftime("%Y%m%d-%H%M%S"))
    body = markdown_table(rows) + (["", "## Speedup over the rounds", "", *markdown_table(medians)] if args.rounds > 1 else [])
    print(write_markdown_and_json(stem, f"End-to-end speculation ({info['gpu']})", command, info, rows, body))


if __name__ == "__main__":
    main()
