"""CUDA-graph bucketing: the padded layout (CPU) and equivalence with eager decoding (GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_target.cuda_graphs import (
    NULL_BLOCK,
    Ragged,
    allocate_buffers,
    bucket_ladder,
    bucket_view,
    fill_host_inputs,
    fill_ragged_host_inputs,
    ragged_ladder,
)
from gpu_target.runner import SequenceChunk
from hetero import LLM, SamplingParams
from hetero.core.protocols import TokenTree

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def test_ladder_is_powers_of_two_within_the_token_cap():
    ladder = bucket_ladder(max_seqs=48, max_query_len=17, max_tokens=256)
    assert (64, 1) in ladder and (64, 4) in ladder and (8, 17) in ladder and (16, 16) in ladder
    assert (64, 8) not in ladder and (16, 17) not in ladder and (8, 32) not in ladder  # 17 is the top rung
    assert all(b * q <= 256 for b, q in ladder)
    assert ladder == sorted(ladder, key=lambda bq: (bq[0] * bq[1], bq[1]), reverse=True)


def test_padding_layout_keeps_real_tokens_apart_from_padding():
    tree = TokenTree(np.array([5, 6, 7]), np.array([-1, 0, -1]))
    masks = [1] + [(int(m) << 1) | 1 for m in tree.ancestor_masks()]
    chunks = [
        SequenceChunk([11, 5, 6, 7], [20, 21, 22, 21], [3, 4], 20, [0, 1, 2, 3], masks),
        SequenceChunk([12], [9], [7], 9, [0]),
    ]
    host = bucket_view(allocate_buffers(max_tokens=32, max_seqs=8, max_blocks=3, device="cpu"), num_seqs=4, num_tokens=16)
    host["tree_mask"].fill_(-7)  # stale values from an earlier step must all be overwritten
    rows = fill_host_inputs({name: t.numpy() for name, t in host.items()}, chunks, query_len=4, block_size=16)
    assert host["input_ids"][:5].tolist() == [11, 5, 6, 7, 12]
    # The kernel reads cached = seq_len - Q, so every sequence's length counts the padded Q.
    assert host["seq_lens"].tolist() == [24, 13, 4, 4]
    assert host["slot_mapping"][:4].tolist() == [4 * 16 + 4 + i for i in range(4)]  # storage 20.. is in block 4
    assert host["slot_mapping"][4].item() == 7 * 16 + 9
    assert set(host["slot_mapping"][5:].tolist()) == {NULL_BLOCK * 16}
    assert host["tree_mask"][:4].tolist() == masks
    # The decode token sees itself (causal); its padding tokens only their own bit, beyond seq_len.
    assert host["tree_mask"][4:8].tolist() == [1, 2, 4, 8]
    assert host["block_tables"][2:].tolist() == [[NULL_BLOCK] * 3] * 2
    assert host["tree_mask"][8:].tolist() == [1, 2, 4, 8] * 2
    assert rows == [0, 1, 2, 3, 4]
    assert host["query_start_loc"].tolist() == [0, 4, 8, 12, 16]


def test_ragged_ladder_steps_by_128_up_to_the_largest_step():
    assert ragged_ladder(2048) == [128 * i for i in range(16, 0, -1)] + [64]
    assert ragged_ladder(2112)[:2] == [2176, 2048]
    assert ragged_ladder(100) == [128, 64]


def test_ragged_layout_packs_the_chunks_and_leaves_the_rest_empty():
    tree = TokenTree(np.array([5, 6, 7]), np.array([-1, 0, -1]))
    masks = [1] + [(int(m) << 1) | 1 for m in tree.ancestor_masks()]
    chunks = [
        SequenceChunk([1, 2, 3, 4, 5], [0, 1, 2, 3, 4], [2], 0, [4]),  # a prompt: logits of its last token only
        SequenceChunk([11, 5, 6, 7], [20, 21, 22, 21], [3, 4], 20, [0, 1, 2, 3], masks),
        SequenceChunk([12], [9], [7], 9, [0]),
    ]
    host = bucket_view(allocate_buffers(max_tokens=64, max_seqs=8, max_blocks=3, device="cpu"), num_seqs=6, num_tokens=16)
    for stale in host.values():  # an earlier step's values must all be overwritten
        stale.fill_(7)
    rows = fill_ragged_host_inputs({name: t.numpy() for name, t in host.items()}, chunks, block_size=16)
    assert host["input_ids"].tolist() == [1, 2, 3, 4, 5, 11, 5, 6, 7, 12] + [0] * 6
    assert host["query_start_loc"].tolist() == [0, 5, 9, 10, 10, 10, 10]
    assert host["seq_lens"].tolist() == [5, 24, 10, 0, 0, 0]
    assert host["slot_mapping"][:10].tolist() == [2 * 16 + i for i in range(5)] + [4 * 16 + 4 + i for i in range(4)] + [7 * 16 + 9]
    assert set(host["slot_mapping"][10:].tolist()) == {NULL_BLOCK * 16}
    assert host["tree_mask"].tolist() == [0] * 5 + masks + [0] * 7  # causal tokens carry no bits
    assert host["positions"][:10].tolist() == [0, 1, 2, 3, 4, 20, 21, 22, 21, 9]
    assert host["block_tables"].tolist() == [[2, 0, 0], [3, 4, 0], [7, 0, 0]] + [[NULL_BLOCK] * 3] * 3
    assert rows == [4, 5, 6, 7, 8, 9]


PROMPTS = ["Hello, my name is", "The capital of France is", "def add(a, b):", "x", "Once upon a time there was"]


@needs_cuda
def test_graphs_match_eager_and_cpu(tiny_llama_dir):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cpu = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=256)
    expected = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, greedy, use_tqdm=False)]
    for eager in (True, False):
        gpu = LLM(model=str(tiny_llama_dir), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                  enforce_eager=eager, gpu_memory_utilization=0.3)
        assert gpu.llm_engine.runner.graph_runner is None if eager else gpu.llm_engine.runner.graph_runner.graphs
        got = [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, greedy, use_tqdm=False)]
        assert got == expected, f"enforce_eager={eager}"
        del gpu


@needs_cuda
@pytest.mark.parametrize("eager,max_num_seqs", [(True, 8), (False, 8), (False, 2)])
def test_gpu_verifies_trees_losslessly(tiny_llama_dir, eager, max_num_seqs):
    """With 2 slots for 5 prompts, requests are admitted beside other sequences' trees: those
    steps replay ragged graphs."""
    from speculation_helpers import OracleProposer, speculative_llm

    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    cpu = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=256)
    truth = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in cpu.generate(PROMPTS, greedy, use_tqdm=False)}
    proposer = OracleProposer(truth, "random", 12, 0.8, vocab=320, seed=5)
    llm = speculative_llm(tiny_llama_dir, proposer, device="cuda", max_num_seqs=max_num_seqs, gpu_memory_utilization=0.3,
                          enforce_eager=eager)
    llm.llm_engine.spec_control.always_speculate = True
    graphs = llm.llm_engine.runner.graph_runner
    assert (graphs is None) == eager
    replayed = []  # (bucket, whether the step verified trees) of each replay
    if graphs is not None:
        replay = graphs.run

        def recorded_replay(chunks, bucket):
            replayed.append((bucket, any(c.tree_mask is not None for c in chunks)))
            return replay(chunks, bucket)

        graphs.run = recorded_replay
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outs} == truth
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    if max_num_seqs == 2:
        assert any(isinstance(bucket, Ragged) and trees for bucket, trees in replayed)


def test_decode_and_tree_rows_are_their_tokens_slots_and_other_rows_are_gathered():
    chunks = [SequenceChunk([11, 5, 6], [20, 21, 22], [3, 4], 20, [0, 1, 2]), SequenceChunk([12], [9], [7], 9, [0])]
    host = {name: t.numpy() for name, t in bucket_view(allocate_buffers(32, 8, 3, "cpu"), 4, 16).items()}
    assert fill_host_inputs(host, chunks, query_len=4, block_size=16) == [0, 1, 2, 4]
    chunks[0] = SequenceChunk([11, 5, 6], [20, 21, 22], [3, 4], 20, [2, 0])
    assert fill_host_inputs(host, chunks, query_len=4, block_size=16) == [2, 0, 4]
