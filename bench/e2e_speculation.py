"""End-to-end decode throughput of every proposer on an 8B Llama-3-shaped target (GPU host).

Configurations, side by side in one run: plain decoding, the lookahead cache, a draft
model on the CPU in its own worker process (AMX BF16), and the same draft on the GPU (as
vLLM runs it). Reports tokens/s, tokens per verification step and, for the CPU worker,
the share of drafting hidden behind the GPU's verification.

Random weights cannot agree by chance, so agreement is built in: the target's embedding
and LM head carry the draft's in their first `draft_hidden` columns (zero elsewhere) and
every layer's output projections are damped, which makes the target's greedy next token
the draft's. `--head-noise` adds noise to the target's other LM-head columns to lower the
agreement. The bytes and FLOPs per step are those of the real shapes.

    python -m bench.e2e_speculation --out bench/results
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from bench.gpu_decode import DAMPING, LLAMA3_8B, random_prompts, stabilise_greedy, timed_decode
from gpu_target.loader import load_config, random_state_dict
from hetero.config import EngineConfig
from hetero.engine import LLMEngine

DRAFT = dict(LLAMA3_8B, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=9, num_key_value_heads=3, torch_dtype="bfloat16")


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


def draft_weights(draft_dir: str, seed: int) -> dict[str, torch.Tensor]:
    """Random draft weights (the loader's dummy format) with its layers' outputs damped like the target's."""
    weights = random_state_dict(load_config(draft_dir, require_weights=False), torch.bfloat16, "cpu", seed)
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.mul_(DAMPING)
    return weights


def graft_draft_into_target(model, draft: dict[str, torch.Tensor], head_noise: float, seed: int) -> None:
    """Give the target the draft's embedding and LM head, and damp its layers' outputs."""
    width = draft["model.embed_tokens.weight"].shape[1]
    generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    with torch.no_grad():
        model.embed_tokens.weight.zero_()[:, :width] = draft["model.embed_tokens.weight"].to(model.embed_tokens.weight.device)
        head = model.lm_head.weight
        if head_noise:
            head.normal_(0.0, head_noise, generator=generator)
        else:
            head.zero_()
        head[:, :width] = draft["lm_head.weight"].to(head.device)
    stabilise_greedy(model, DAMPING)


def build_engine(target_dir: str, draft: dict, args, **speculation) -> LLMEngine:
    config = EngineConfig(
        model=target_dir, load_format="dummy", dtype="bfloat16", max_model_len=1024,
        max_num_seqs=max(args.batches), gpu_memory_utilization=0.5, **speculation,
    )
    engine = LLMEngine(config)
    graft_draft_into_target(engine.model, draft, args.head_noise, seed=1)
    if engine.proposer is not None and args.always_speculate:
        engine.spec_control.always_speculate = True
    return engine


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--head-noise", type=float, default=0.0)
    parser.add_argument("--configs", default="plain,lookahead,cpu-draft,gpu-draft")
    parser.add_argument("--always-speculate", action="store_true", help="keep the controller from switching speculation off")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    target_dir = write_model_dir(LLAMA3_8B)
    draft_dir = write_model_dir(DRAFT)
    draft = draft_weights(draft_dir, seed=7)
    save_file(draft, os.path.join(draft_dir, "model.safetensors"))
    lookahead_dir = tempfile.mkdtemp(prefix="lookahead-")
    with open(os.path.join(lookahead_dir, "lookahead_cache_config.json"), "w") as f:
        json.dump({"is_debug": False, "copy_length": args.k}, f)
    speculation = {
        "plain": {},
        "lookahead": dict(lookahead_cache_config_dir=lookahead_dir, num_speculative_tokens=args.k),
        "cpu-draft": dict(speculative_model=draft_dir, num_speculative_tokens=args.k, cpu_draft_worker=True),
        "gpu-draft": dict(speculative_model=draft_dir, num_speculative_tokens=args.k, cpu_draft_worker=False),
    }
    rows = []
    for name in args.configs.split(","):
        engine = build_engine(target_dir, draft, args, **speculation[name])
        for batch in args.batches:
            prompts = random_prompts(batch, args.prompt_len, LLAMA3_8B["vocab_size"], seed=batch)
            timed_decode(engine, prompts[:1], 8)
            before = (engine.spec_stats.num_steps, engine.spec_stats.num_accepted_tokens, engine.spec_stats.num_draft_tokens)
            elapsed, tokens, _ = timed_decode(engine, prompts, args.new_tokens)
            steps = engine.spec_stats.num_steps - before[0]
            accepted = engine.spec_stats.num_accepted_tokens - before[1]
            drafted = engine.spec_stats.num_draft_tokens - before[2]
            row = dict(config=name, batch=batch, tokens_per_s=round(tokens / elapsed, 1),
                       spec_seq_steps=steps, draft_tokens=drafted,
                       mean_accepted_length=round((accepted + steps) / steps, 2) if steps else "")
            stats = getattr(engine.proposer, "stats", None)
            if callable(stats):
                row["overlap_share"] = round(stats().get("overlap_share", 0.0), 3)
            rows.append(row)
            print(row, flush=True)
        close = getattr(engine.proposer, "close", None)
        if callable(close):
            close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    plain = {r["batch"]: r["tokens_per_s"] for r in rows if r["config"] == "plain"}
    for row in rows:
        if row["batch"] in plain:
            row["speedup_vs_plain"] = round(row["tokens_per_s"] / plain[row["batch"]], 2)
    write(args, rows)


def write(args, rows) -> None:
    info = dict(describe_machine(), torch=torch.__version__, gpu=torch.cuda.get_device_name())
    command = "python -m bench.e2e_speculation " + " ".join(sys.argv[1:])
    stem = os.path.join(args.out, "e2e_speculation-" + time.strftime("%Y%m%d-%H%M%S"))
    print(write_markdown_and_json(stem, f"End-to-end speculation ({info['gpu']})", command, info, rows, markdown_table(rows)))


if __name__ == "__main__":
    main()
