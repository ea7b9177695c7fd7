"""The GPU batch-invariant mode on an 8B Llama-3-shaped target (random bf16 weights): its
cost against the normal mode, and the greedy equalities it exists for.

gemm       GPU time of each 8B projection (and the LM head) at 1, 8 and 64 rows: the normal
           dispatch (gpu_target/gemv.py: GEMV, skinny GEMM or cuBLAS) against the invariant GEMM,
           and whether row 0 of the batch has the bits it has computed alone;
attention  GPU time of one layer's attention (8B heads, bf16 paged cache): the normal kernel
           (gpu_target/triton_attention.py) against the invariant one, for decode at 1 and 64
           sequences and a 9-token tree verification of 64, with max_seq_len the engine's
           max_model_len as its CUDA graphs pass it; the step's extra over 32 layers;
           whether sequence 0's rows have the bits they have computed alone, and each
           the bits of the same token decoded (chain row i: one query row over the
           context and new tokens 0..i); the invariant kernel at each --mma-rows (its
           MMA_ROWS: MMA_ROWS / 4 rows of a sequence, with their 4 query heads each,
           share each K/V tile load);
cost       decode tokens/s of the normal and the invariant mode at batch 1, 8 and 64
           (plain greedy decoding, CUDA graphs, multi-step decode as the engine runs it);
alone      each request's greedy tokens run alone, in a batch of 8 and in a batch of 64
           (other prompts beside it): identical in the invariant mode;
spec       speculative greedy decoding against plain greedy decoding of the same prompts:
           identical in the invariant mode. The proposer replays the plain run's tokens,
           each draft token right with probability --draft-p and random otherwise, so
           trees are deep, partly rejected and always meet tokens plain decoding emitted.

The weights are the loader's random ones, *not* damped as bench.gpu_decode damps them:
with random weights the top logits are nearly tied, so greedy decoding flips on any
rounding difference. That makes the equality checks sharp, and the normal mode is run
through the same checks as the control that shows they can fail.

    python -m bench.batch_invariant --out bench/results
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import sys
import time

import torch

from bench._cuda_timing import median_replay_ms
from bench._machine import describe_machine
from bench._report import section_tables, write_markdown_and_json
from bench.e2e_speculation import write_model_dir
from bench.gpu_decode import LLAMA3_8B, random_prompts, timed_decode
from gpu_target import gemv, invariant_attention
from gpu_target.attention import AttentionMetadata
from gpu_target.invariant_attention import invariant_paged_attention
from gpu_target.invariant_matmul import invariant_linear
from gpu_target.triton_attention import paged_attention
from hetero.core.config import EngineConfig
from hetero.core.protocols import TokenTree
from hetero.engine import LLMEngine


class PlainReplay:
    """Drafts a chain of k tokens from the plain run's output, each right with probability p."""

    def __init__(self, truth: dict[tuple, list[int]], k: int, p: float, vocab: int, seed: int = 0):
        self.truth, self.k, self.p, self.vocab = truth, k, p, vocab
        self.rng = random.Random(seed)
        self.target_parallelism = 64

    def propose(self, batch):
        trees = []
        for request in batch:
            prompt = tuple(request.token_ids[: request.num_prompt_tokens])
            done = len(request.token_ids) - request.num_prompt_tokens
            ahead = self.truth.get(prompt, [])[done : done + min(self.k, request.max_nodes)]
            trees.append(TokenTree.chain([t if self.rng.random() < self.p else self.rng.randrange(self.vocab) for t in ahead]))
        return trees

    def commit(self, verdicts):
        pass

    def release(self, request_id):
        pass


PROJECTIONS = dict(qkv=(6144, 4096), o=(4096, 4096), gate_up=(28672, 4096), down=(4096, 14336), lm_head=(128256, 4096))


def graph_ms(fn, calls: int = 20) -> float:
    """GPU milliseconds of one call of `fn`, from a CUDA graph of `calls` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_replay_ms(graph, 10) / calls


def bench_gemm(rows: list[dict]) -> None:
    for name, (n, k) in PROJECTIONS.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (1, 8, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            normal, invariant = graph_ms(lambda: gemv.linear(x, weight)), graph_ms(lambda: invariant_linear(x, weight))
            alone = x[:1].clone()
            rows.append(dict(section="gemm", projection=name, n=n, k=k, rows=m,
                             row0_bits_as_alone_normal=torch.equal(gemv.linear(x, weight)[:1], gemv.linear(alone, weight)),
                             row0_bits_as_alone_invariant=torch.equal(invariant_linear(x, weight)[:1], invariant_linear(alone, weight)),
                             normal_us=round(1e3 * normal, 1),
                             invariant_us=round(1e3 * invariant, 1), ratio=f"{invariant / normal:.2f}x",
                             invariant_tb_s=round(n * k * 2 / invariant / 1e9, 2)))


ATTENTION_CASES = dict(decode=(1, 1), decode_batch=(64, 1), verify_batch=(64, 9))  # (sequences, new tokens each)


def attention_batch(num_seqs: int, q_len: int, ctx: int, max_seq_len: int, block_size: int = 16):
    """Metadata of `num_seqs` sequences of `ctx` cached and `q_len` new tokens (a chain tree
    when q_len > 1) over shuffled blocks of a random bf16 cache, and their queries."""
    heads, kv_heads = LLAMA3_8B["num_attention_heads"], LLAMA3_8B["num_key_value_heads"]
    head_dim = LLAMA3_8B["hidden_size"] // heads
    seq_len = ctx + q_len
    blocks = -(-seq_len // block_size)
    tables = (torch.randperm(num_seqs * blocks, device="cuda") + 1).int().view(num_seqs, blocks)  # block 0: the null block
    storage = torch.arange(ctx, seq_len, device="cuda")
    slots = (tables[:, storage // block_size].long() * block_size + storage % block_size).flatten()
    chain = torch.tensor([(1 << (i + 1)) - 1 for i in range(q_len)], device="cuda")
    meta = AttentionMetadata(
        query_start_loc=torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda"),
        block_tables=tables, slot_mapping=slots, tree_mask=chain.repeat(num_seqs) if q_len > 1 else None,
        max_query_len=q_len, max_seq_len=max(max_seq_len, seq_len),
        query_lens_host=[q_len] * num_seqs, seq_lens_host=[seq_len] * num_seqs,
    )
    shape = (num_seqs * blocks + 1, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    query = torch.randn(num_seqs * q_len, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    return meta, k_cache, v_cache, query


def chain_row_decoded(meta: AttentionMetadata, ctx: int, i: int) -> AttentionMetadata:
    """Sequence 0's chain row i as the token decoded after new tokens 0..i-1: one query row
    over the same blocks, seeing the context and new tokens 0..i."""
    seq_len = ctx + i + 1
    return AttentionMetadata(meta.query_start_loc.new_tensor([0, 1]), meta.seq_lens.new_tensor([seq_len]),
                             meta.block_tables[:1], meta.slot_mapping[i : i + 1], None, 1, meta.max_seq_len,
                             [1], [seq_len])


def bench_attention(rows: list[dict], ctx: int, max_model_len: int, mma_rows: list[int]) -> None:
    """The normal kernel against the invariant one at each of `mma_rows` (its MMA_ROWS)."""
    for case, (num_seqs, q_len) in ATTENTION_CASES.items():
        meta, k_cache, v_cache, query = attention_batch(num_seqs, q_len, ctx, max_model_len)
        first = AttentionMetadata(meta.query_start_loc[:2], meta.seq_lens[:1], meta.block_tables[:1],
                                  meta.slot_mapping[:q_len], None if meta.tree_mask is None else meta.tree_mask[:q_len],
                                  q_len, meta.max_seq_len, [q_len], meta.seq_lens_host[:1])
        scale = query.shape[2] ** -0.5

        def measure(attend):
            """(us, sequence 0's bits as alone, each of its rows' bits as decoded)."""
            us = 1e3 * graph_ms(lambda: attend(query, k_cache, v_cache, meta, scale))
            batched = attend(query, k_cache, v_cache, meta, scale)[:q_len]
            alone = torch.equal(batched, attend(query[:q_len].clone(), k_cache, v_cache, first, scale))
            decoded = all(torch.equal(batched[i : i + 1], attend(query[i : i + 1].clone(), k_cache, v_cache,
                                                                 chain_row_decoded(meta, ctx, i), scale))
                          for i in range(q_len))
            return us, alone, decoded

        normal_us, normal_alone, normal_decoded = measure(paged_attention)
        for m in mma_rows:
            invariant_attention.MMA_ROWS = m
            invariant_us, invariant_alone, invariant_decoded = measure(invariant_paged_attention)
            rows.append(dict(section="attention", case=case, seqs=num_seqs, new_tokens=q_len, ctx=ctx,
                             max_seq_len=meta.max_seq_len, mma_rows=m, seq0_bits_as_alone_normal=normal_alone,
                             seq0_bits_as_alone_invariant=invariant_alone,
                             seq0_rows_bits_as_decoded_normal=normal_decoded,
                             seq0_rows_bits_as_decoded_invariant=invariant_decoded,
                             normal_us=round(normal_us, 1), invariant_us=round(invariant_us, 1),
                             ratio=f"{invariant_us / normal_us:.2f}x",
                             extra_ms_per_step_32_layers=round(32e-3 * (invariant_us - normal_us), 2)))
        invariant_attention.MMA_ROWS = mma_rows[0]


def build_engine(model_dir: str, invariant: bool, max_model_len: int, proposer=None, k=None) -> tuple[LLMEngine, float]:
    started = time.perf_counter()
    config = EngineConfig(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                          max_model_len=max_model_len, max_num_seqs=64, gpu_memory_utilization=0.5,
                          batch_invariant=invariant, num_speculative_tokens=k)
    return LLMEngine(config, proposer=proposer), time.perf_counter() - started


def release_memory() -> None:
    """Give the dropped engine's GPU memory back before the next one sizes its KV cache."""
    gc.collect()
    torch.cuda.empty_cache()


def same(reference: dict, other: dict) -> str:
    """'identical/compared' over the prompts both runs have."""
    common = [p for p in other if p in reference]
    return f"{sum(reference[p] == other[p] for p in common)}/{len(common)}"


def run_mode(model_dir, invariant, prompts, args, rows) -> None:
    mode = "invariant" if invariant else "normal"
    engine, startup = build_engine(model_dir, invariant, args.max_model_len)
    rows.append(dict(section="startup", mode=mode, engine_s=round(startup, 1)))
    outputs = {}
    for batch in (1, 8, 64):
        timed_decode(engine, prompts[:batch], 4)  # warm-up of this batch's shapes
        seconds, tokens, outputs[batch] = timed_decode(engine, prompts[:batch], args.new_tokens)
        rows.append(dict(section="cost", mode=mode, batch=batch, tokens_per_s=round(tokens / seconds, 1),
                         ms_per_step=round(1e3 * seconds / (tokens / batch), 2)))
    del engine
    release_memory()
    plain = outputs[64]
    rows.append(dict(section="alone", mode=mode, batch1_vs_batch64=same(plain, outputs[1]),
                     batch8_vs_batch64=same(plain, outputs[8]),
                     distinct_tokens_in_batch64=len({t for out in plain.values() for t in out})))
    vocab = LLAMA3_8B["vocab_size"]
    proposer = PlainReplay(plain, args.k, args.draft_p, vocab)
    engine, _ = build_engine(model_dir, invariant, args.max_model_len, proposer, args.k)
    for batch in (8, 64):
        trees, accepted = engine.spec_stats.num_steps, engine.spec_stats.num_accepted_tokens
        _, _, spec = timed_decode(engine, prompts[:batch], args.new_tokens)
        trees, accepted = engine.spec_stats.num_steps - trees, engine.spec_stats.num_accepted_tokens - accepted
        rows.append(dict(section="spec", mode=mode, batch=batch, spec_vs_plain=same(plain, spec),
                         trees=trees, accepted_per_tree=round(accepted / max(trees, 1), 2)))
    del engine
    release_memory()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--k", type=int, default=8, help="draft tokens per tree")
    parser.add_argument("--draft-p", type=float, default=0.8, help="chance that each draft token is the plain run's")
    parser.add_argument("--modes", default="normal,invariant")
    parser.add_argument("--mma-rows", default=f"{invariant_attention.MMA_ROWS},32,64",
                        help="the invariant attention's MMA_ROWS values to time (the first stays for the runs after)")
    args = parser.parse_args(argv)
    model_dir = write_model_dir(dict(LLAMA3_8B, max_position_embeddings=args.max_model_len))
    prompts = random_prompts(64, args.prompt_len, LLAMA3_8B["vocab_size"], seed=0)
    rows: list[dict] = []
    bench_gemm(rows)
    for ctx in (args.prompt_len + args.new_tokens - 1, args.max_model_len - 9):
        bench_attention(rows, ctx, args.max_model_len, [int(m) for m in args.mma_rows.split(",")])
    release_memory()
    for mode in args.modes.split(","):
        run_mode(model_dir, mode == "invariant", prompts, args, rows)
    cost = {(r["mode"], r["batch"]): r["tokens_per_s"] for r in rows if r["section"] == "cost"}
    for batch in (1, 8, 64):
        if ("normal", batch) in cost and ("invariant", batch) in cost:
            rows.append(dict(section="slowdown", batch=batch,
                             invariant_over_normal=f"{cost[('normal', batch)] / cost[('invariant', batch)]:.2f}x"))
    info = dict(describe_machine(), torch=torch.__version__, gpu=torch.cuda.get_device_name())
    command = "python -m bench.batch_invariant " + " ".join(sys.argv[1:] if argv is None else argv)
    body = section_tables(rows, ("gemm", "attention", "startup", "cost", "slowdown", "alone", "spec"))
    stem = os.path.join(args.out, f"batch_invariant-{time.strftime('%Y%m%d-%H%M%S')}")
    print(write_markdown_and_json(stem, f"Batch-invariant mode ({info['gpu']}, python {platform.python_version()})",
                                  command, info, rows, body))


if __name__ == "__main__":
    main()
