"""`TokenTree.chain` against a chain given its parents explicitly, and the shared parents it uses."""
import numpy as np
import pytest

from hetero.core.protocols import MAX_TREE_NODES, TokenTree


@pytest.mark.parametrize("n", [0, 1, 2, 8, MAX_TREE_NODES])
def test_a_chain_equals_the_tree_with_its_parents_spelled_out(n):
    tokens = list(range(100, 100 + n))
    chain, explicit = TokenTree.chain(tokens), TokenTree(tokens, list(range(-1, n - 1)))
    for tree in (chain, explicit):
        assert tree.is_chain
        assert tree.tokens.dtype == np.int64 and tree.parents.dtype == np.int32
        assert tree.token_list == tokens and tree.tokens.tolist() == tokens
        assert tree.parent_list == list(range(-1, n - 1)) and tree.parents.tolist() == tree.parent_list
        assert tree.path_to(n - 1) == list(range(n))


def test_chains_share_read_only_parents():
    a, b = TokenTree.chain([1, 2, 3]), TokenTree.chain([4, 5, 6])
    assert a.parents is b.parents
    with pytest.raises(ValueError):
        a.parents[0] = 0
    assert TokenTree.chain([7, 8]).parents is not a.parents


def test_a_chain_is_still_checked_for_its_size_and_other_trees_for_their_parents():
    with pytest.raises(ValueError, match="at most"):
        TokenTree.chain(list(range(MAX_TREE_NODES + 1)))
    with pytest.raises(ValueError, match="precede"):
        TokenTree([1, 2, 3], [-1, 2, 0])
    branching = TokenTree([1, 2, 3], [-1, -1, 0])
    assert not branching.is_chain and branching.parent_list == [-1, -1, 0]
