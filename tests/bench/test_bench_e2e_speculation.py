"""bench.e2e_speculation's trace replay: trees cut to the accepted length a trace draws."""
from __future__ import annotations

from bench.e2e_speculation import TraceReplay
from hetero.core.protocols import Proposer, TokenTree


class _Fixed:
    """A trace whose every draw is `accepted` (capped at the depth)."""

    def __init__(self, accepted: int):
        self.accepted = accepted

    def sample_accepted(self, depth, rng):
        return min(self.accepted, depth)


class _Drafts(Proposer):
    def __init__(self, tree):
        self.tree = tree

    def propose(self, batch):
        return [self.tree for _ in batch]


def test_a_chain_is_kept_up_to_the_drawn_length_and_then_made_wrong():
    chain = TokenTree.chain([10, 11, 12, 13])
    cut = TraceReplay(_Drafts(chain), _Fixed(2), vocab_size=100).propose([None])[0]
    assert cut.token_list == [10, 11, 13] and cut.parent_list == [-1, 0, 1]  # 12 replaced by a token the target rejects
    assert TraceReplay(_Drafts(chain), _Fixed(4), vocab_size=100).propose([None])[0].token_list == [10, 11, 12, 13]
    assert TraceReplay(_Drafts(chain), _Fixed(0), vocab_size=14).propose([None])[0].token_list == [11]
    assert TraceReplay(_Drafts(TokenTree.chain([99])), _Fixed(0), vocab_size=100).propose([None])[0].token_list == [0]


def test_siblings_beside_the_chain_go_with_the_cut():
    tree = TokenTree([10, 20, 11, 21, 12], [-1, -1, 0, 0, 2])  # chain 10 11 12 with siblings 20 and 21
    cut = TraceReplay(_Drafts(tree), _Fixed(1), vocab_size=100).propose([None])[0]
    assert cut.token_list == [10, 20, 12] and cut.parent_list == [-1, -1, 0]
