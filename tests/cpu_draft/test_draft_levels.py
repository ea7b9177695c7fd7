"""The drafter's trees against a straightforward reference: every level from a full forward of
the HF model (no KV cache) over the context and the chain so far, read with torch's topk and
softmax over the head's ids. Float32, so any change in how a level is read (the native forward's
own top-k read, buffers, bookkeeping) that alters a drafted token, a parent or a tree's shape fails here."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from cpu_draft.drafter import DraftModelOptions, Drafter, tree_levels
from tiny_models import save_tiny_model

VOCAB = 5000  # a head of several of the native read's chunks (2048 columns), with a ragged tail


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama-5k"), "llama", seed=4, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()


def reference_tree(model, context: list[int], head_ids: torch.Tensor, max_nodes: int, width: int):
    """(tokens, parents, scores) as the drafter defines a tree: a greedy chain, each chain node with
    its next-best siblings, scores the path probabilities (`tree_levels` nodes per level)."""
    tokens, parents, scores, chain = [], [], [], []
    parent, path_prob = -1, 1.0
    with torch.no_grad():
        for count in tree_levels(max_nodes, width):
            logits = model(torch.tensor([context + chain])).logits[0, -1][head_ids]
            probs = torch.softmax(logits, -1)
            top = torch.topk(logits, count).indices
            chain_node = len(tokens)
            for column in top.tolist():
                tokens.append(int(head_ids[column]))
                parents.append(parent)
                scores.append(path_prob * float(probs[column]))
            parent, path_prob = chain_node, path_prob * float(probs[top[0]])
            chain.append(tokens[chain_node])
    return tokens, parents, scores


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("draft_vocab", [None, 4500])
def test_drafted_trees_are_the_reference_trees(model_dir, hf_model, native, width, draft_vocab):
    """Five steps over three sequences of different lengths, each step accepting part of the chain
    and a bonus token (so the KV rolls back), budgets that leave some levels narrower."""
    options = DraftModelOptions(dtype=torch.float32, native_kernels=native, tree_width=width, draft_vocab_size=draft_vocab)
    drafter = Drafter.load(str(model_dir), options)
    head_ids = torch.arange(VOCAB) if drafter.head_ids is None else drafter.head_ids
    rng = np.random.default_rng(1)
    contexts = {"a": rng.integers(0, VOCAB, 9).tolist(), "b": rng.integers(0, VOCAB, 30).tolist(), "c": [17]}
    for step in range(5):
        requests = [(seq_id, 2 + (step + i) % 3 * width) for i, seq_id in enumerate(contexts)]
        for seq_id, context in contexts.items():
            drafter.set_context(seq_id, context)
        trees = drafter.draft(requests)
        for (seq_id, max_nodes), tree in zip(requests, trees):
            tokens, parents, scores = reference_tree(hf_model, contexts[seq_id], head_ids, max_nodes, width)
            assert tree.tokens.tolist() == tokens, (step, seq_id)
            assert tree.parents.tolist() == parents, (step, seq_id)
            np.testing.assert_allclose(tree.scores, scores, rtol=2e-4)
            chain = drafter.last_chain(seq_id)
            contexts[seq_id] = contexts[seq_id] + chain[: (step + len(seq_id)) % (len(chain) + 1)] + [int(rng.integers(0, VOCAB))]
    guessed = {seq_id: drafter.context(seq_id) for seq_id in drafter.assume_accepted(list(contexts))}
    assert set(guessed) == set(contexts)
    for seq_id, context in guessed.items():  # the bonus guess: the best head id after the last chain
        assert reference_tree(hf_model, context[:-1], head_ids, 1, 1)[0] == [context[-1]]
