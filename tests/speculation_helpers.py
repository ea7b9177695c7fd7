"""Speculation test doubles shared by the engine, quantisation and CUDA-graph tests: prompts,
a proposer whose trees come from the known greedy continuation, and an LLM built around it."""
from __future__ import annotations

import random

import numpy as np

from hetero import LLM
from hetero.core.config import EngineConfig
from hetero.core.protocols import ProposalRequest, Proposer, TokenTree, Verdict
from hetero.engine import LLMEngine

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time there was a small model",
    "x",
    "The capital of Italy is Rome. The capital of",
    "Speculative decoding drafts tokens on the CPU",
    "Hello",
    "a b c d e f g",
    "Python",
    "The",
    "code in Python.",
    "Rome",
    "small model that generated text",
    "CPU and GPU",
    "Once",
]


class OracleProposer(Proposer):
    """Proposes trees around the known greedy continuation, with a chosen shape and error rate.

    `p_correct` is the chance that a node continuing a so-far-correct path carries the true
    next token; wrong nodes carry random tokens. The verifier must accept exactly the
    longest correct path, whatever the shape.
    """

    def __init__(self, truth: dict[tuple[int, ...], list[int]], shape: str, nodes: int, p_correct: float, vocab: int, seed: int):
        self.truth = truth
        self.shape = shape
        self.nodes = nodes
        self.p_correct = p_correct
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.commits: list[Verdict] = []
        self.released: list[str] = []

    def _continuation(self, request: ProposalRequest) -> list[int]:
        prompt = tuple(request.token_ids[: request.num_prompt_tokens])
        done = len(request.token_ids) - request.num_prompt_tokens
        return self.truth[prompt][done:] + [0] * 64

    def _token(self, truth: list[int], depth: int, on_path: bool) -> int:
        if on_path and self.rng.random() < self.p_correct:
            return truth[depth]
        wrong = self.rng.randrange(self.vocab)
        return wrong if wrong != truth[depth] or not on_path else (wrong + 1) % self.vocab

    def propose(self, batch):
        return [self._tree(request) for request in batch]

    def _tree(self, request: ProposalRequest) -> TokenTree:
        n = min(self.nodes, request.max_nodes)
        truth = self._continuation(request)
        tokens, parents, depth, correct = [], [], [], []
        for i in range(n):
            if self.shape == "chain":
                parent = i - 1
            elif self.shape == "wide":
                parent = -1 if i < max(2, n // 2) else self.rng.randrange(i)
            else:  # random
                parent = self.rng.randrange(-1, i)
            d = 0 if parent < 0 else depth[parent] + 1
            on_path = parent < 0 or correct[parent]
            token = self._token(truth, d, on_path)
            tokens.append(token)
            parents.append(parent)
            depth.append(d)
            correct.append(on_path and token == truth[d])
        return TokenTree(np.array(tokens), np.array(parents))

    def commit(self, verdicts):
        self.commits.extend(verdicts)

    def release(self, request_id):
        self.released.append(request_id)


def speculative_llm(model_dir, proposer, **kwargs) -> LLM:
    llm = LLM.__new__(LLM)
    config = EngineConfig(model=str(model_dir), max_model_len=256, dtype="float32", num_speculative_tokens=63, **kwargs)
    llm.llm_engine = LLMEngine(config, proposer=proposer)
    llm._request_counter = iter(range(10**9))
    return llm
