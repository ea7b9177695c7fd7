"""The batched greedy tree verifier against the per-tree reference, and the engine's use of it."""
import random

import numpy as np
import pytest

from gpu_target.sampler import greedy_accept
from hetero.core.protocols import TokenTree
from hetero.spec.verifier import accept_greedy


def _random_tree(rng: random.Random, vocab: int) -> TokenTree:
    n = rng.randint(1, 12)
    parents = [rng.randint(-1, i - 1) for i in range(n)]  # parents precede children
    return TokenTree(tokens=[rng.randrange(vocab) for _ in range(n)], parents=parents)


@pytest.mark.parametrize("seed", range(20))
def test_accept_greedy_over_flat_arrays_matches_each_tree_alone(seed):
    rng = random.Random(seed)
    vocab = 3  # few tokens: many matches, duplicate siblings and deep paths
    trees = [_random_tree(rng, vocab) for _ in range(rng.randint(1, 16))]
    gap = rng.randint(0, 3)  # rows of other sequences between the trees' rows
    row_starts, rows = [], 0
    for tree in trees:
        row_starts.append(rows)
        rows += len(tree) + 1 + gap
    argmax = np.array([rng.randrange(vocab) for _ in range(rows)], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in trees])]).astype(np.int64)
    best = accept_greedy(argmax, np.concatenate([t.tokens for t in trees]), np.concatenate([t.parents for t in trees]).astype(np.int64),
                         offsets, np.array(row_starts, dtype=np.int64))
    for tree, start, node in zip(trees, row_starts, best.tolist()):
        expected_path, expected_bonus = greedy_accept(argmax[start : start + len(tree) + 1].tolist(), tree)
        assert tree.path_to(node) == expected_path
        assert int(argmax[start + node + 1]) == expected_bonus


def test_accept_greedy_takes_the_deepest_path_and_the_lowest_index_on_ties():
    # root -> 0 (token 5) -> 2 (token 7); root -> 1 (token 5) -> 3 (token 7): two matching paths of depth 2.
    tree = TokenTree(tokens=[5, 5, 7, 7], parents=[-1, -1, 0, 1])
    argmax = np.array([5, 7, 7, 1, 1], dtype=np.int64)  # root row, then rows after nodes 0..3
    best = accept_greedy(argmax, tree.tokens, tree.parents.astype(np.int64), np.array([0, 4]), np.array([0]))
    assert best.tolist() == [2]
    miss = accept_greedy(np.array([9, 7, 7, 1, 1]), tree.tokens, tree.parents.astype(np.int64), np.array([0, 4]), np.array([0]))
    assert miss.tolist() == [-1]


@pytest.mark.parametrize("seed", range(5))
def test_accept_greedy_follows_long_chains_to_their_first_miss(seed):
    rng = random.Random(seed)
    chains = [TokenTree.chain([rng.randrange(2) for _ in range(rng.randint(1, 63))]) for _ in range(rng.randint(1, 8))]
    row_starts = np.cumsum([0] + [len(c) + 1 for c in chains[:-1]]).astype(np.int64)
    # the target agrees with each chain up to a random depth, then differs
    argmax = np.concatenate([np.append(c.tokens, 0) for c in chains])
    for chain, start in zip(chains, row_starts):
        depth = rng.choice([0, len(chain), rng.randint(0, len(chain))])  # none, all, or some accepted
        if depth < len(chain):
            argmax[start + depth] = 1 - chain.tokens[depth]
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in chains])]).astype(np.int64)
    best = accept_greedy(argmax, np.concatenate([c.tokens for c in chains]), np.concatenate([c.parents for c in chains]).astype(np.int64),
                         offsets, row_starts)
    for chain, start, node in zip(chains, row_starts, best.tolist()):
        expected_path, _ = greedy_accept(argmax[start : start + len(chain) + 1].tolist(), chain)
        assert chain.path_to(node) == expected_path
