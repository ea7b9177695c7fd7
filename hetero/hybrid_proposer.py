"""Hybrid proposals: the draft model's tree and the lookahead cache's merged into one per sequence.

TACO-LLM merges its lookahead cache's trees; here the cache's tree (copies of text seen
before: rewrites, retrieved passages, code edits) and the draft model's (open text) share
one node budget. The merged tree is their union as a trie, so a path both propose is
verified once. When the union outgrows the budget, the tree whose deepest path is longer
keeps all its nodes first (a long cache match outranks the draft, a short or missing one
does not), and the other fills what is left, parents before children.
"""
from __future__ import annotations

from typing import Sequence

from hetero.core.protocols import DraftsAhead, ProposalRequest, Proposer, TokenTree, Verdict


def merge_trees(first: TokenTree, second: TokenTree, max_nodes: int) -> TokenTree:
    """The union of two trees as a trie, at most ``max_nodes`` nodes: ``first``'s nodes, then ``second``'s."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}
    for tree in (first, second):
        merged: list[int | None] = []  # this tree's node -> its merged node (None: dropped with its subtree)
        for token, parent in zip(tree.token_list, tree.parent_list):
            at = -1 if parent == -1 else merged[parent]
            node = None if at is None else index.get((at, token))
            if node is None and at is not None and len(tokens) < max_nodes:
                node = index[(at, token)] = len(tokens)
                tokens.append(token)
                parents.append(at)
            merged.append(node)
    return TokenTree(tokens, parents)


def _depth(tree: TokenTree) -> int:
    return int(tree.depths().max()) if len(tree) else 0


class HybridProposer(Proposer):
    """A draft-model proposer and a lookahead cache behind one `Proposer`."""

    def __init__(self, draft: Proposer, lookahead: Proposer):
        self.draft = draft
        self.lookahead = lookahead

    def propose(self, batch: Sequence[ProposalRequest]) -> list[TokenTree]:
        cached = self.lookahead.propose(batch)
        drafted = self.draft.propose(batch)
        trees = []
        for request, from_cache, from_draft in zip(batch, cached, drafted):
            first, second = (from_cache, from_draft) if _depth(from_cache) > _depth(from_draft) else (from_draft, from_cache)
            merged = merge_trees(first, second, request.max_nodes)
            trees.append(merged if len(merged) or from_draft.ready else from_draft)
        return trees

    def observe(self, batch: Sequence[ProposalRequest]) -> None:
        if isinstance(self.draft, DraftsAhead):
            self.draft.observe(batch)

    def commit(self, verdicts: Sequence[Verdict]) -> None:
        self.lookahead.commit(verdicts)
        self.draft.commit(verdicts)

    def release(self, request_id: str) -> None:
        self.lookahead.release(request_id)
        self.draft.release(request_id)

    def close(self) -> None:
        self.draft.close()
