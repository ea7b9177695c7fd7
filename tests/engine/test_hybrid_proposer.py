"""Hybrid proposals: a draft model's and the lookahead cache's trees merged into one, losslessly."""
from __future__ import annotations

import json

import pytest

from hetero import LLM, SamplingParams
from hetero.hybrid_proposer import HybridProposer, merge_trees
from hetero.core.protocols import ProposalRequest, TokenTree
from tiny_models import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _paths(tree: TokenTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path of the tree."""
    paths = []
    for token, parent in zip(tree.token_list, tree.parent_list):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return set(paths)


def test_the_union_shares_common_prefixes():
    cache = TokenTree.chain([5, 6, 7, 8])
    draft = TokenTree([5, 6, 9, 4], [-1, 0, 1, -1])  # 5 6 9, and 4
    merged = merge_trees(cache, draft, max_nodes=16)
    assert _paths(merged) == _paths(cache) | _paths(draft)
    assert len(merged) == 6  # 5 6 7 8 + 9 under 6 + 4


def test_the_budget_keeps_the_first_tree_whole_and_fills_with_the_second():
    first = TokenTree.chain([1, 2, 3])
    second = TokenTree([1, 7, 8, 9], [-1, 0, 1, -1])  # 1 7 8, and 9
    merged = merge_trees(first, second, max_nodes=4)
    assert len(merged) == 4
    assert _paths(first) <= _paths(merged)
    assert (1, 7) in _paths(merged) and (1, 7, 8) not in _paths(merged)
    assert all(-1 <= p < i for i, p in enumerate(merged.parent_list))
    # a node dropped for the budget takes its subtree with it, even where room comes back later
    assert merge_trees(TokenTree.chain([1]), TokenTree([2, 3, 4], [-1, 0, -1]), max_nodes=2).token_list == [1, 2]


class _Fixed:
    def __init__(self, tree):
        self.tree = tree

    def propose(self, batch):
        return [self.tree for _ in batch]


def test_a_draft_not_ready_stays_pending_unless_the_cache_has_a_tree():
    batch = [ProposalRequest("r", [1, 2, 3], 3, 4)]
    assert not HybridProposer(_Fixed(TokenTree.pending()), _Fixed(TokenTree.empty())).propose(batch)[0].ready
    from_cache = HybridProposer(_Fixed(TokenTree.pending()), _Fixed(TokenTree.chain([4, 5]))).propose(batch)[0]
    assert from_cache.ready and from_cache.token_list == [4, 5]
    assert HybridProposer(_Fixed(TokenTree.empty()), _Fixed(TokenTree.empty())).propose(batch)[0].ready


@pytest.fixture(scope="module")
def lookahead_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lookahead")
    (directory / "lookahead_cache_config.json").write_text(json.dumps({"copy_length": 6}))
    return str(directory)


@pytest.mark.parametrize("worker", [False, True])
def test_hybrid_speculation_is_lossless(tiny_llama_dir, lookahead_dir, worker):
    plain = LLM(device="cpu", model=str(tiny_llama_dir), dtype="float32")
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(device="cpu", model=str(tiny_llama_dir), dtype="float32", speculative_model=str(tiny_llama_dir),
              num_speculative_tokens=8, cpu_draft_worker=worker, lookahead_cache_config_dir=lookahead_dir)
    engine = llm.llm_engine
    assert isinstance(engine.proposer, HybridProposer)
    engine.spec_control.always_speculate = True
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        engine.proposer.close()
    assert got == expected
    assert engine.spec_stats.num_accepted_tokens > 0
