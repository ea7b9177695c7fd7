"""bench.gpu_decode on the CPU: a server-style run splits into the step kinds it ran; requests end at their own lengths."""
from __future__ import annotations

import pytest
import torch

from bench.gpu_decode import ChainOracle, StepKinds, greedy, greedy_successors, request_lengths, stabilise_greedy, timed_decode
from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine

VOCAB = 320  # tests/tiny_models.py


def test_step_kinds_split_a_server_run_by_what_each_step_ran(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    oracle = ChainOracle([], k=3, p=0.5, vocab=VOCAB, target_parallelism=6)
    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=128, dtype="float32", max_num_seqs=3, num_speculative_tokens=3)
    engine = LLMEngine(config, proposer=oracle)
    engine.spec_control.always_speculate = True
    stabilise_greedy(engine.model)  # as the bench does: drafts of greedy successors then get accepted
    oracle.successors = greedy_successors(engine.model)
    kinds = StepKinds(engine)
    elapsed, tokens, outputs = timed_decode(engine, [{"prompt_token_ids": [7 * i + j for j in range(6)]} for i in range(8)], 16, kinds)
    assert len(outputs) == 8 and all(len(out) == 16 for out in outputs.values())
    assert {"spec", "spec+prefill"} <= set(kinds.seconds)  # later requests are admitted beside trees
    assert sum(kinds.tokens.values()) == tokens
    assert 0 < sum(kinds.seconds.values()) <= elapsed
    words = kinds.summary().split()
    shares = {kind: float(value.split("@")[0]) for kind, value in zip(words[::2], words[1::2])}
    step_ms = {kind: float(value.split("/")[1].rstrip("ms")) for kind, value in zip(words[::2], words[1::2])}
    assert step_ms == pytest.approx({kind: 1e3 * kinds.seconds[kind] / kinds.steps[kind] for kind in kinds.seconds}, abs=0.06)
    assert set(shares) == set(kinds.seconds)
    assert abs(sum(shares.values()) - 1.0) < 0.02


def test_requests_of_several_lengths_each_end_at_their_own(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    lengths = request_lengths(8, longest=20, shortest=4, seed=3)
    assert min(lengths) >= 4 and max(lengths) <= 20 and len(set(lengths)) > 2
    assert lengths == request_lengths(8, longest=20, shortest=4, seed=3)  # plain and speculative runs get the same
    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=128, dtype="float32", max_num_seqs=3)
    engine = LLMEngine(config)
    prompts = [{"prompt_token_ids": [7 * i + j for j in range(6)]} for i in range(8)]
    _, tokens, outputs = timed_decode(engine, prompts, lengths)
    by_prompt = {tuple(prompt["prompt_token_ids"]): length for prompt, length in zip(prompts, lengths)}
    assert {prompt: len(out) for prompt, out in outputs.items()} == by_prompt
    assert tokens <= sum(lengths)  # less what the first batch decoded before the clock started


def test_trace_oracle_drafts_right_prefixes_as_the_trace_accepts():
    from bench.traces import Trace
    from hetero.core.protocols import ProposalRequest

    successors = [(t * 7 + 3) % VOCAB for t in range(VOCAB)]
    trace = Trace("test", (0.8, 0.5), 2.0)
    oracle = ChainOracle(successors, k=4, p=trace, vocab=VOCAB, target_parallelism=64)
    rights = []
    for i in range(4000):
        (tree,) = oracle.propose([ProposalRequest(str(i), [5, i % VOCAB], 1, max_nodes=3)])
        tokens, last, right = tree.token_list, i % VOCAB, 0
        assert len(tokens) == 3  # the node budget caps the chain
        while right < len(tokens) and tokens[right] == successors[last]:
            last, right = tokens[right], right + 1
        rights.append(right)
    assert sum(r >= 1 for r in rights) / len(rights) == pytest.approx(0.8, abs=0.02)
    assert sum(r >= 2 for r in rights) / sum(r >= 1 for r in rights) == pytest.approx(0.5, abs=0.03)
    assert sum(r >= 3 for r in rights) / sum(r >= 2 for r in rights) == pytest.approx(0.5, abs=0.05)  # the last rate beyond


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_step_is_labelled_by_the_work_it_verified(tiny_llama_dir, async_scheduling):
    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=128, dtype="float32", max_num_seqs=1, num_scheduler_steps=4)
    engine = LLMEngine(config)
    engine.async_scheduling = async_scheduling
    kinds = StepKinds(engine)
    engine.add_request("r", {"prompt_token_ids": list(range(5, 11))}, greedy(9))
    while engine.has_unfinished_requests():
        kinds.start()
        before = engine.num_generation_tokens_total
        engine.step()
        kinds.record(0.001, engine.num_generation_tokens_total - before)
    # the prefill's step emits its first token; the two 4-step windows emit 4 each, whichever step launched them
    assert kinds.tokens == {"prefill": 1, "plain": 8} and kinds.steps == {"prefill": 1, "plain": 2}


def test_an_oracle_without_successors_drafts_guesses_of_the_full_depth():
    """The verification-cost runs (bench.quant_decode, the tree-size section) draft with p=0 and no successors."""
    from types import SimpleNamespace
    oracle = ChainOracle([], k=5, p=0.0, vocab=VOCAB, target_parallelism=6)
    trees = oracle.propose([SimpleNamespace(request_id=str(i), token_ids=[300 + i], max_nodes=5) for i in range(3)])
    assert [len(tree.tokens) for tree in trees] == [5, 5, 5]
    assert all(0 <= token < VOCAB for tree in trees for token in tree.tokens)
