"""Quality of the quantised targets on a real model, on the CPU: teacher-forced agreement and KL.

The full-precision model (float32; the default SmolLM2-135M is a Q4_1 GGUF dequantised to
float) greedily continues each prompt; then every format reads prompt + continuation in one
prefill, and at each continuation position its next-token distribution is compared with the
full-precision one: top-1 agreement (same argmax) and KL(P_full || P_quantised) in nats. This
is the usual teacher-forced protocol (as in llama.cpp's `perplexity --kl-divergence`), so
one early disagreement does not derail the rest of a sequence. The format "bf16" (the
projections' weights rounded to bfloat16, computed in float32 like the others) is the
reference row: what the target's own dtype already costs.

    python -m bench.quant_quality --formats bf16,fp8,int4 --out bench/results
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from gpu_target.loader import DEFAULT_MODEL_NAMES
from gpu_target.model import Linear
from gpu_target.quantization.linear import PROJECTIONS
from gpu_target.runner import SequenceChunk
from hetero import LLM, SamplingParams

SUBJECTS = ("the moon", "photosynthesis", "the Roman empire", "prime numbers", "volcanoes", "the printing press",
            "honey bees", "electric cars", "the French revolution", "black holes", "coffee", "the internet",
            "glaciers", "chess", "vaccines", "the Python programming language")
FRAMES = ("Write a short paragraph about {}.", "Explain {} to a child:", "The history of {} begins",
          "Q: What is the most important fact about {}?\nA:")


def default_prompts() -> list[str]:
    """64 prompts: each frame around each subject."""
    return [frame.format(subject) for subject in SUBJECTS for frame in FRAMES]


def teacher_forced_logits(llm: LLM, tokens: list[int], start: int) -> torch.Tensor:
    """float32 logits predicting tokens[start:], from one prefill of all of `tokens`."""
    engine = llm.llm_engine
    blocks = list(range(1, 2 + len(tokens) // engine.config.block_size))
    rows = range(start - 1, len(tokens) - 1)
    return engine.runner.forward([SequenceChunk(tokens, range(len(tokens)), blocks, 0, rows)])


def dequantize_once(model) -> None:
    """Give each `QuantizedLinear` its dequantised weight as a plain `Linear`: what its CPU
    forward computes (F.linear on the weight dequantised to the compute dtype), without
    dequantising again at every call."""
    for layer in model.layers:
        for block_name, proj_name in PROJECTIONS:
            block = getattr(layer, block_name)
            quantized = getattr(block, proj_name)
            weight = quantized.quantized.dequantize(model.embed_tokens.weight.dtype)
            linear = Linear(quantized.in_features, quantized.out_features, bias=quantized.bias is not None)
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            if quantized.bias is not None:
                linear.bias = quantized.bias
            setattr(block, proj_name, linear)


def round_to_bf16(model) -> None:
    """Round each projection's weight to bfloat16 in place (kept float32 for the float32 compute)."""
    for layer in model.layers:
        for block_name, proj_name in PROJECTIONS:
            weight = getattr(getattr(layer, block_name), proj_name).weight
            weight.data.copy_(weight.data.to(torch.bfloat16))


def compare(reference: torch.Tensor, quantized: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-position top-1 agreement, per-position KL(P_reference || P_quantized) in nats)."""
    log_p, log_q = reference.log_softmax(-1), quantized.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return reference.argmax(-1) == quantized.argmax(-1), kl


def run(model: str, formats: list[str], new_tokens: int, num_prompts: int) -> list[dict]:
    """One model in memory at a time (a 1.5B target in float32 is 6+ GB): the full-precision
    logits are kept, then each format is built, compared and freed in turn."""
    options = dict(model=model, dtype="float32", max_model_len=1024, kv_cache_space=0.5, seed=0)
    full = LLM(**options)
    prompts = (default_prompts() * (1 + num_prompts // 64))[:num_prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    sequences = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids))
                 for o in full.generate(prompts, greedy, use_tqdm=False)]
    references = [teacher_forced_logits(full, prompt + continuation, len(prompt)) for prompt, continuation in sequences]
    del full
    gc.collect()
    agree: dict[str, list[torch.Tensor]] = {fmt: [] for fmt in formats}
    kls: dict[str, list[torch.Tensor]] = {fmt: [] for fmt in formats}
    for fmt in formats:
        llm = LLM(**options, quantization=None if fmt == "bf16" else fmt)
        (round_to_bf16 if fmt == "bf16" else dequantize_once)(llm.llm_engine.model)
        for number, ((prompt, continuation), reference) in enumerate(zip(sequences, references)):
            same, kl = compare(reference, teacher_forced_logits(llm, prompt + continuation, len(prompt)))
            agree[fmt].append(same)
            kls[fmt].append(kl)
            print(f"{fmt}: prompt {number + 1}/{len(sequences)}", file=sys.stderr, flush=True)
        del llm
        gc.collect()
    rows = []
    for fmt in formats:
        agree_all, kl_all = torch.cat(agree[fmt]).float(), torch.cat(kls[fmt])
        first_disagreement = [int(s.logical_not().nonzero()[0]) if not s.all() else len(s) for s in agree[fmt]]
        rows.append({
            "format": fmt,
            "prompts": len(sequences),
            "positions": len(agree_all),
            "top1_agreement_%": round(100 * agree_all.mean().item(), 2),
            "mean_kl_nats": f"{kl_all.mean().item():.5f}",
            "p99_kl_nats": f"{kl_all.quantile(0.99).item():.4f}",
            "mean_tokens_before_first_disagreement": round(sum(first_disagreement) / len(first_disagreement), 1),
        })
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAMES[0], help="HF directory or .gguf (default: packaged SmolLM2-135M)")
    parser.add_argument("--formats", default="bf16,fp8,int4",
                        help="comma-separated quantization methods to compare; bf16: weights rounded to bfloat16")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy continuation length per prompt")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if args.new_tokens < 1 or args.num_prompts < 1:
        parser.error("--new-tokens and --num-prompts must be positive")
    torch.manual_seed(0)
    rows = run(args.model, [f for f in args.formats.split(",") if f], args.new_tokens, args.num_prompts)
    command = "python -m bench.quant_quality " + " ".join(sys.argv[1:] if argv is None else argv)
    name = os.path.basename(str(args.model)).removesuffix(".gguf")
    stem = os.path.join(args.out, f"quant_quality-{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    body = ["Teacher-forced on the float32 model's greedy continuations; KL(P_float || P_quantised) per position.",
            "", *markdown_table(rows)]
    print(write_markdown_and_json(stem, f"Quantised target quality: {name}", command, describe_machine(), rows, body))


if __name__ == "__main__":
    main()
