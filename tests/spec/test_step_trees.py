"""A step's trees flat (`StepTrees`) and greedy acceptance of chains from their node offsets alone."""
import random

import numpy as np
import pytest

from gpu_target.sampler import greedy_accept
from hetero.core.protocols import TokenTree
from hetero.spec.step_trees import StepTrees
from hetero.spec.verifier import accept_greedy


@pytest.mark.parametrize("seed", range(10))
def test_chains_accepted_without_parents_match_each_chain_alone(seed):
    """Chains of different lengths, with other rows between theirs: `parents=None` takes each
    node's row from its chain's offset and start, as the per-tree reference does."""
    rng = random.Random(seed)
    chains = [TokenTree.chain([rng.randrange(2) for _ in range(rng.randint(1, 12))]) for _ in range(rng.randint(1, 16))]
    row_starts, rows = [], 0
    for chain in chains:
        row_starts.append(rows)
        rows += len(chain) + 1 + rng.randint(0, 3)
    argmax = np.array([rng.randrange(2) for _ in range(rows)], dtype=np.int64)
    for chain, start in zip(chains, row_starts):  # agree up to a random depth: none, all or some
        depth = rng.choice([0, len(chain), rng.randint(0, len(chain))])
        argmax[start : start + depth] = chain.tokens[:depth]
        if depth < len(chain):
            argmax[start + depth] = 1 - chain.tokens[depth]
    flat = StepTrees(chains)
    assert flat.parents is None
    best = accept_greedy(argmax, flat.tokens, None, flat.node_offsets, np.array(row_starts, dtype=np.int64))
    with_parents = accept_greedy(argmax, flat.tokens, np.concatenate([c.parents for c in chains]).astype(np.int64),
                                 flat.node_offsets, np.array(row_starts, dtype=np.int64))
    assert best.tolist() == with_parents.tolist()
    for chain, start, node in zip(chains, row_starts, best.tolist()):
        expected_path, expected_bonus = greedy_accept(argmax[start : start + len(chain) + 1].tolist(), chain)
        assert chain.path_to(node) == expected_path
        assert int(argmax[start + node + 1]) == expected_bonus


def test_step_trees_are_the_trees_back_to_back():
    chain, tree = TokenTree.chain([4, 5, 6]), TokenTree(tokens=[7, 8, 9], parents=[-1, -1, 0])
    flat = StepTrees([chain, tree])
    assert flat.tokens.tolist() == [4, 5, 6, 7, 8, 9] and flat.tokens.dtype == np.int64
    assert flat.node_offsets.tolist() == [0, 3, 6]
    assert flat.parents.tolist() == [-1, 0, 1, -1, -1, 0] and flat.parents.dtype == np.int64
    assert StepTrees([chain, chain]).parents is None
    empty = StepTrees([])
    assert empty.node_offsets.tolist() == [0] and empty.in_vocab(1)


def test_vocabulary_check_and_identity():
    chain, other = TokenTree.chain([0, 9]), TokenTree.chain([0, 9])
    flat = StepTrees([chain])
    assert flat.in_vocab(10) and not flat.in_vocab(9)
    assert not StepTrees([TokenTree.chain([-1])]).in_vocab(10)
    assert flat.holds([chain])
    assert not flat.holds([other])  # equal, but not the trees the step proposed
    assert not flat.holds([chain, chain]) and not flat.holds([])
