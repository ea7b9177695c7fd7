"""Structured output and logit_bias: constrained output is valid, and speculation keeps it lossless.

Greedy output under a grammar must be token-identical with and without speculation
(float32): the grammar's mask is applied at every row of a token tree, along that row's
own draft path, so a draft the grammar forbids is rejected like any wrong draft.
"""
from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from hetero import LLM, SamplingParams, StructuredOutputsParams
from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine
from hetero.core.protocols import ProposalRequest, Proposer, TokenTree
from hetero.structured_output import GrammarCompiler, closed_schema, grammar_of

PROMPTS = ["Hello, my name is", "The capital of France is", "def add(a, b):", "x"]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "colour", "count"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "choice": StructuredOutputsParams(choice=["Paris", "Rome", "a longer answer"]),
    "regex": StructuredOutputsParams(regex=r"[0-9]{3}-[a-c]{2}"),
    "grammar": StructuredOutputsParams(grammar='root ::= "yes" | "no" | "(" root ")"'),
}


def check(name: str, text: str) -> None:
    if name == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif name == "choice":
        assert text in CONSTRAINTS["choice"].choice
    elif name == "regex":
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and set(text[4:]) <= set("abc")
    else:
        assert text.strip("()") in ("yes", "no") and text.count("(") == text.count(")")


class PathProposer(Proposer):
    """Drafts the known constrained continuation, with a share of random (mostly forbidden) tokens."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], vocab: int, p_correct: float, nodes: int = 8):
        self.truth, self.vocab, self.p_correct, self.nodes = truth, vocab, p_correct, nodes
        self.rng = random.Random(0)

    def propose(self, batch: list[ProposalRequest]) -> list[TokenTree]:
        trees = []
        for request in batch:
            prompt = tuple(request.token_ids[: request.num_prompt_tokens])
            done = len(request.token_ids) - request.num_prompt_tokens
            rest = self.truth[prompt][done:]
            tokens, parents = [], []
            for i in range(min(self.nodes, request.max_nodes)):
                right = i < len(rest) and self.rng.random() < self.p_correct
                tokens.append(rest[i] if right else self.rng.randrange(self.vocab))
                parents.append(i - 1 if i % 3 else -1 if i == 0 else i - 2)
            trees.append(TokenTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64)))
        return trees

    def commit(self, verdicts):
        pass

    def release(self, seq_key):
        pass


def speculative_llm(model_dir, proposer=None, **kwargs) -> LLM:
    llm = LLM.__new__(LLM)
    config = EngineConfig(model=str(model_dir), max_model_len=256, dtype="float32", num_speculative_tokens=16, **kwargs)
    llm.llm_engine = LLMEngine(config, proposer=proposer)
    llm._request_counter = iter(range(10**9))
    llm.llm_engine.spec_control.always_speculate = True  # correctness, not the controller's timing
    return llm


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32")


def greedy(name: str) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=CONSTRAINTS[name])


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_plain_decoding_follows_the_constraint(plain, name):
    for out in plain.generate(PROMPTS, greedy(name), use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop"
        check(name, out.outputs[0].text)
    sampled = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=40, structured_outputs=CONSTRAINTS[name])
    for completion in plain.generate(PROMPTS[:2], sampled, use_tqdm=False)[0].outputs:
        check(name, completion.text)


@pytest.mark.parametrize("name", ["json", "choice", "regex"])
def test_greedy_under_a_grammar_is_the_same_with_tree_verification(plain, tiny_llama_dir, name):
    expected = plain.generate(PROMPTS, greedy(name), use_tqdm=False)
    truth = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) + [0] * 16 for o in expected}
    llm = speculative_llm(tiny_llama_dir, PathProposer(truth, vocab=320, p_correct=0.7))
    outs = llm.generate(PROMPTS, greedy(name), use_tqdm=False)
    assert token_ids(outs) == token_ids(expected)
    stats = llm.llm_engine.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_greedy_under_a_grammar_is_the_same_with_lookahead_and_a_draft_model(plain, tiny_llama_dir):
    expected = token_ids(plain.generate(PROMPTS, greedy("json"), use_tqdm=False))
    lookahead = speculative_llm(tiny_llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3})
    assert token_ids(lookahead.generate(PROMPTS, greedy("json"), use_tqdm=False)) == expected
    draft = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", speculative_model=str(tiny_llama_dir),
                num_speculative_tokens=4, cpu_draft_worker=False)
    draft.llm_engine.spec_control.always_speculate = True
    assert token_ids(draft.generate(PROMPTS, greedy("json"), use_tqdm=False)) == expected
    assert draft.llm_engine.spec_stats.num_steps > 0


def test_sampling_under_a_grammar_with_speculation_stays_valid(plain, tiny_llama_dir):
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=40, structured_outputs=CONSTRAINTS["json"])
    expected = plain.generate(PROMPTS, greedy("json"), use_tqdm=False)
    truth = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) + [0] * 16 for o in expected}
    llm = speculative_llm(tiny_llama_dir, PathProposer(truth, vocab=320, p_correct=0.8))
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        check("json", out.outputs[0].text)


def test_row_masks_leave_the_grammar_where_it_was(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_model_len=64, dtype="float32"))
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    state = compiler.new_states(CONSTRAINTS["json"], 1)[0]
    for token in engine.tokenizer.encode('{"ok'):
        state.accept(token)
    before = state.row_masks(None, torch.device("cpu"))
    quote = engine.tokenizer.encode('"')[0]
    colon = engine.tokenizer.encode(":")[0]
    tree = TokenTree(np.array([quote, colon, 7, quote]), np.array([-1, 0, -1, 2]))
    masks = state.row_masks(tree, torch.device("cpu"))
    assert masks.shape == (5, engine.model_config.vocab_size)
    assert torch.equal(masks[0], before[0])
    assert masks[0][quote] and masks[1][colon] and masks[2].sum() > 0
    assert not masks[0][7]  # node 2's token is forbidden: its subtree's rows are never read
    assert torch.equal(state.row_masks(None, torch.device("cpu")), before)

    # A path through the grammar's end and past it (EOS, then more) rolls back exactly too.
    done = compiler.new_states(CONSTRAINTS["json"], 1)[0]
    for token in engine.tokenizer.encode('{"ok":true,"colour":"red","count":8'):
        done.accept(token)
    before = done.row_masks(None, torch.device("cpu"))
    close, eos = engine.tokenizer.encode("}")[0], engine.eos_token_ids[0]
    masks = done.row_masks(TokenTree(np.array([close, eos, eos, close]), np.array([-1, 0, 1, -1])), torch.device("cpu"))
    assert masks[1][eos] and masks[1].sum() == 1 and masks[2][eos]
    assert torch.equal(done.row_masks(None, torch.device("cpu")), before)


def test_bad_constraints_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        grammar_of(StructuredOutputsParams(regex="[a"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_logit_bias_moves_the_choice_and_stays_lossless_under_speculation(plain, tiny_llama_dir):
    base = plain.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    favoured = 42
    biased_params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={favoured: 100})
    biased = plain.generate(PROMPTS, biased_params, use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) == {favoured} for o in biased)
    banned = {t: -100 for t in base[0].outputs[0].token_ids}
    avoided = plain.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias=banned), use_tqdm=False)
    assert not set(avoided[0].outputs[0].token_ids) & set(banned)
    truth = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) + [0] * 16 for o in biased}
    spec = speculative_llm(tiny_llama_dir, PathProposer(truth, vocab=320, p_correct=0.8))
    assert token_ids(spec.generate(PROMPTS, biased_params, use_tqdm=False)) == token_ids(biased)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"x": 1})
    with pytest.raises(ValueError, match="logit_bias"):
        plain.generate("x", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def _allows_after(engine, compiler, schema: dict, text: str, next_text: str) -> bool:
    """Whether the grammar of `schema`, after `text`, allows the first token of `next_text`."""
    state = compiler.new_states(StructuredOutputsParams(json=schema), 1)[0]
    for token in engine.tokenizer.encode(text):
        state.accept(token)
    return bool(state.row_masks(None, torch.device("cpu"))[0][engine.tokenizer.encode(next_text)[0]])


def test_a_schema_that_lists_its_properties_gets_no_others_unless_it_allows_them(tiny_llama_dir):
    """As vLLM's default backend (xgrammar, strict): after the listed properties the object
    closes; a schema that says additionalProperties: true, or a nested object's, keeps them open."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_model_len=64, dtype="float32"))
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    listed = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    assert _allows_after(engine, compiler, listed, '{"ok":true', "}")
    assert not _allows_after(engine, compiler, listed, '{"ok":true', ",")
    assert _allows_after(engine, compiler, dict(listed, additionalProperties=True), '{"ok":true', ",")
    nested = {"type": "object", "properties": {"inner": listed}, "required": ["inner"], "additionalProperties": True}
    assert not _allows_after(engine, compiler, nested, '{"inner":{"ok":true', ",")
    assert _allows_after(engine, compiler, nested, '{"inner":{"ok":true}', ",")


def test_closing_a_schema_leaves_data_same_object_subschemas_and_the_callers_schema_alone():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "string"}, "tags": {"type": "array", "items": {"properties": {"x": {}}}}},
        "allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}],
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}},
        "enum": [{"properties": 1}],
        "anyOf": [{"properties": {"c": {}}, "additionalProperties": {"type": "integer"}}],
    }
    original = json.loads(json.dumps(schema))
    closed = closed_schema(schema)
    assert schema == original  # a copy: the request's schema is not changed
    assert closed["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a property named "properties", not a schema
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert all("additionalProperties" not in sub for sub in closed["allOf"])
    assert closed["$defs"]["Point"]["additionalProperties"] is False
    assert closed["enum"] == [{"properties": 1}]
    assert closed["anyOf"][0]["additionalProperties"] == {"type": "integer"}
