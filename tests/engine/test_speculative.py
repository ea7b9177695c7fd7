"""Tree verification in the engine: speculative output equals plain output, and the KV matches."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero import LLM, SamplingParams
from hetero.core.config import EngineConfig
from hetero.core.protocols import TokenTree
from hetero.engine import LLMEngine
from hetero.spec import verifier as spec_verifier
from hetero.spec.step_trees import StepTrees
from speculation_helpers import PROMPTS, OracleProposer, speculative_llm

MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32")


@pytest.fixture(scope="module")
def truth(plain):
    outs = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    return {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outs}


@pytest.mark.parametrize(
    "shape, nodes, p_correct, batch",
    [
        ("chain", 4, 1.0, 1),  # all right
        ("chain", 6, 0.0, 4),  # all wrong
        ("chain", 8, 0.7, 16),
        ("wide", 12, 0.5, 8),
        ("random", 24, 0.8, 3),
        ("random", 63, 0.9, 16),
    ],
)
def test_speculative_greedy_equals_plain(tiny_llama_dir, truth, shape, nodes, p_correct, batch):
    proposer = OracleProposer(truth, shape, nodes, p_correct, vocab=320, seed=nodes)
    llm = speculative_llm(tiny_llama_dir, proposer)
    llm.llm_engine.spec_control.always_speculate = True  # this test is about correctness, not speed
    prompts = PROMPTS[:batch]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == truth[tuple(out.prompt_token_ids)]
        assert out.outputs[0].finish_reason == "length"
    stats = llm.llm_engine.spec_stats
    assert stats.num_steps > 0
    if p_correct == 1.0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens or stats.mean_accepted_length > nodes * 0.8
    if p_correct == 0.0:
        assert stats.num_accepted_tokens == 0
    assert all(v.accepted_tokens == [] or p_correct > 0 for v in proposer.commits)
    assert llm.llm_engine.scheduler.allocator.num_free == llm.llm_engine.kv_pool.num_blocks


def test_stop_and_max_tokens_inside_an_accepted_run(tiny_llama_dir, truth):
    proposer = OracleProposer(truth, "chain", 10, 1.0, vocab=320, seed=0)
    llm = speculative_llm(tiny_llama_dir, proposer)
    llm.llm_engine.spec_control.always_speculate = True
    expected = truth[tuple(llm.get_tokenizer()(PROMPTS[0]).input_ids)]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[:7]
    stop_token = expected[4]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[: expected.index(stop_token) + 1]


@pytest.mark.parametrize("shape", ["random", "chain"])
def test_logprobs_under_speculation_match_plain(tiny_llama_dir, shape):
    """Each emitted token's logprobs come from its own verification row, in every sequence of the
    batch (a chain's accepted rows are a range behind its root's).

    Batch-invariant on both sides, so a token's logits are bit-identical whatever the step shape.
    """
    base = dict(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", batch_invariant=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    expected = LLM(**base).generate(PROMPTS[:6], params, use_tqdm=False)
    truth = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in expected}
    llm = speculative_llm(tiny_llama_dir, OracleProposer(truth, shape, 12, 0.7, vocab=320, seed=2), batch_invariant=True)
    llm.llm_engine.spec_control.always_speculate = True
    got = llm.generate(PROMPTS[:6], params, use_tqdm=False)
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0

    def table(out):
        return [{t: (lp.logprob, lp.rank) for t, lp in entry.items()} for entry in out.outputs[0].logprobs]

    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert table(have) == table(want)


def test_steps_that_admit_a_request_verify_the_running_trees(tiny_llama_dir, truth):
    """Requests finish at different steps under speculation, so a server admits one now and
    then: the decoding sequences of such a step keep their trees, and outputs stay plain's."""
    proposer = OracleProposer(truth, "chain", 4, 0.7, vocab=320, seed=5)
    llm = speculative_llm(tiny_llama_dir, proposer, max_num_seqs=3)
    engine = llm.llm_engine
    engine.spec_control.always_speculate = True
    mixed_with_trees = 0
    forward = engine.runner.forward

    def spy(chunks):
        nonlocal mixed_with_trees
        prefills = any(len(c.token_ids) > 1 and c.tree_mask is None for c in chunks)
        mixed_with_trees += prefills and any(c.tree_mask is not None for c in chunks)
        return forward(chunks)

    engine.runner.forward = spy
    outs = llm.generate(PROMPTS[:8], GREEDY, use_tqdm=False)
    assert mixed_with_trees > 0
    for out in outs:
        assert out.outputs[0].token_ids == truth[tuple(out.prompt_token_ids)]
    assert engine.scheduler.allocator.num_free == engine.kv_pool.num_blocks


def test_kv_cache_after_speculation_matches_plain(tiny_llama_dir, truth):
    """Rejected nodes leave no trace; accepted ones sit where plain decoding puts them, bit for bit.

    Both engines run batch-invariant: in normal mode the CPU GEMM's rounding depends on
    the number of rows (M=1 decode vs M=1+nodes verification), so the KV would only agree
    to float32 rounding.
    """

    def run(engine: LLMEngine, steps: int):
        engine.add_request("r", PROMPTS[3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        for _ in range(steps):
            engine.step()
        seq = engine.groups["r"].seqs[0]
        return seq, engine.kv_pool

    base = dict(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", batch_invariant=True)
    plain_seq, plain_pool = run(LLMEngine(EngineConfig(**base)), 30)
    proposer = OracleProposer(truth, "random", 16, 0.6, vocab=320, seed=3)
    spec_engine = LLMEngine(EngineConfig(**base, num_speculative_tokens=16), proposer=proposer)
    spec_engine.spec_control.always_speculate = True
    spec_seq, spec_pool = run(spec_engine, 8)
    n = min(plain_seq.num_computed, spec_seq.num_computed)
    assert n > 12 and spec_engine.spec_stats.num_accepted_tokens > 0
    assert spec_seq.token_ids[:n] == plain_seq.token_ids[:n]

    def kv(seq, pool):
        bs = pool.block_size
        slots = torch.tensor([seq.block_table[i // bs] * bs + i % bs for i in range(n)])
        flat = pool.storage.view(pool.storage.shape[0], 2, -1, *pool.storage.shape[4:])
        return flat[:, :, slots]

    plain_kv, spec_kv = kv(plain_seq, plain_pool), kv(spec_seq, spec_pool)
    assert torch.equal(plain_kv, spec_kv)


def test_lookahead_cache_speeds_up_copying_and_stays_lossless(tiny_llama_dir, tmp_path):
    """The real lookahead proposer, configured as TACO-LLM: output equals plain decoding and drafts get accepted.

    A prompt that repeats the model's own greedy continuation makes the continuation
    copyable from the prompt, as in summarise/rewrite workloads.
    """
    plain = LLM(model=str(tiny_llama_dir), max_model_len=512, dtype="float32")
    seed_prompt = "The capital of Italy is Rome. The capital of"
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    first = plain.generate(seed_prompt, params, use_tqdm=False)[0]
    copy_prompt = {"prompt_token_ids": first.prompt_token_ids + first.outputs[0].token_ids + first.prompt_token_ids}
    expected = plain.generate(copy_prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    (tmp_path / "lookahead_cache_config.json").write_text('{"cache_mode": 2, "copy_length": 8, "is_debug": false}')
    spec = LLM(model=str(tiny_llama_dir), max_model_len=512, dtype="float32", lookahead_cache_config_dir=str(tmp_path))
    spec.llm_engine.spec_control.always_speculate = True  # acceptance, not the controller's timing, is tested here
    out = spec.generate(copy_prompt, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected
    stats = spec.llm_engine.spec_stats
    assert stats.num_accepted_tokens > 0
    assert out.metrics.num_accepted_tokens == stats.num_accepted_tokens
    assert (out.metrics.num_spec_steps, out.metrics.num_draft_tokens) == (stats.num_steps, stats.num_draft_tokens)
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens and stats.accepted_per_position[0] > 0

    ngram = LLM(
        model=str(tiny_llama_dir),
        max_model_len=512,
        dtype="float32",
        speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4},
    )
    ngram.llm_engine.spec_control.always_speculate = True
    assert ngram.generate(copy_prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert ngram.llm_engine.spec_stats.num_accepted_tokens > 0


def test_a_full_63_node_tree_verifies(tiny_llama_dir, truth):
    """The largest tree: node 62's ancestor bit is bit 63 of the int64 mask (the sign bit)."""
    proposer = OracleProposer(truth, "chain", 63, 1.0, vocab=320, seed=0)
    llm = speculative_llm(tiny_llama_dir, proposer)
    llm.llm_engine.spec_control.always_speculate = True
    prompt = PROMPTS[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == truth[tuple(out.prompt_token_ids)]
    long_truth = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32").generate(
        prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    proposer.truth = {tuple(out.prompt_token_ids): long_truth}
    before = llm.llm_engine.spec_stats.num_accepted_tokens
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == long_truth
    assert llm.llm_engine.spec_stats.num_accepted_tokens - before >= 63  # a whole 63-node chain was accepted


class _DroppingFirstTree(OracleProposer):
    """Proposes a tree with a token outside the vocabulary for the first sequence of each batch of
    several: the engine drops that tree and verifies the others."""

    def propose(self, batch):
        trees = super().propose(batch)
        if len(batch) > 1 and len(trees[0]):
            trees[0] = TokenTree(np.full(len(trees[0]), 10**6), trees[0].parents)
        return trees


@pytest.mark.parametrize("shape", ["chain", "random"])
def test_the_trees_flattened_when_attached_are_the_ones_verified(tiny_llama_dir, truth, monkeypatch, shape):
    """A step's trees are concatenated once, when the engine attaches them, and the verifier's
    greedy acceptance reads that; a step that dropped a tree flattens the trees it verifies
    anew. Outputs equal plain decoding either way."""
    flattened_by_verifier = []

    class Counted(StepTrees):
        def __init__(self, trees):
            flattened_by_verifier.append(len(trees))
            super().__init__(trees)

    monkeypatch.setattr(spec_verifier, "StepTrees", Counted)
    for proposer_type, drops in ((OracleProposer, False), (_DroppingFirstTree, True)):
        llm = speculative_llm(tiny_llama_dir, proposer_type(truth, shape, 6, 0.7, vocab=320, seed=1))
        llm.llm_engine.spec_control.always_speculate = True
        flattened_by_verifier.clear()
        for out in llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False):
            assert out.outputs[0].token_ids == truth[tuple(out.prompt_token_ids)]
        assert llm.llm_engine.spec_stats.num_steps > 0
        assert bool(flattened_by_verifier) == drops
