"""The narrow interfaces between the coordinator, the proposers and the verifier.

A token tree is flat arrays so that it can live in shared memory without pickling:
``tokens[i]`` is node i's token and ``parents[i]`` the index of its parent node, or -1
when the node hangs directly below the root (the sequence's last committed token).
Parents always come before their children (``parents[i] < i``), so a node's depth is
``depth[parents[i]] + 1`` computed in one forward pass.

Proposals are treated as deterministic by the verifier (a point-mass draft
distribution), which makes one lossless acceptance rule serve every proposer: the
lookahead cache's copies and a draft model's top-k trees alike. ``scores`` is what the
proposer believed of each node (draft probability or frequency); it is used for
ranking and pruning only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence, runtime_checkable

import numpy as np

MAX_TREE_NODES = 63  # root + nodes: each ancestor set fits one int64 bitmask


@dataclass
class TokenTree:
    tokens: np.ndarray  # int64 [n]
    parents: np.ndarray  # int32 [n]; -1 = child of the root
    scores: Optional[np.ndarray] = None  # float32 [n], higher is more likely
    ready: bool = True  # False: the proposer has no draft for this sequence yet (`pending`)

    def __post_init__(self) -> None:
        self.tokens = _flat(self.tokens, np.int64)
        n = len(self.tokens)
        # `chain` passes the shared parents of an n-node chain, known to be a chain: they are
        # neither converted nor compared (a proposer makes a chain for every sequence of every step).
        shared_chain = n <= MAX_TREE_NODES and self.parents is _chain_parent_array(n)
        if not shared_chain:
            self.parents = _flat(self.parents, np.int32)
        if self.scores is not None:
            self.scores = _flat(self.scores, np.float32)
        if len(self.parents) != n or (self.scores is not None and len(self.scores) != n):
            raise ValueError("TokenTree arrays must have one entry per node")
        if n > MAX_TREE_NODES:
            raise ValueError(f"a token tree holds at most {MAX_TREE_NODES} nodes, got {n}")
        # The arrays as lists too, made once per tree: the engine walks and copies a tree's
        # nodes several times per step, for every sequence, and a `tolist` costs more than
        # the walk it would feed. A Python pass over at most 63 parents is also cheaper than
        # two numpy reductions. A chain's `parent_list` is shared with every chain of its length.
        self.token_list: list[int] = self.tokens.tolist()
        self.parent_list: list[int] = _chain_parents(n) if shared_chain else self.parents.tolist()
        # A chain (every proposer's most common shape) is checked by one list comparison; its
        # paths are prefixes, which verification takes without walking them.
        self.is_chain = shared_chain or self.parent_list == _chain_parents(n)
        if not self.is_chain and not all(-1 <= parent < i for i, parent in enumerate(self.parent_list)):
            raise ValueError("TokenTree parents must precede their children (-1 <= parents[i] < i)")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def empty(cls) -> "TokenTree":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int32))

    @classmethod
    def pending(cls) -> "TokenTree":
        """No tree because the proposer is not ready for this sequence yet (a draft worker
        still computing its prompt's KV): unlike an empty tree, which is the proposer's
        answer, this one says nothing about what speculation delivers."""
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int32), ready=False)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "TokenTree":
        """A chain of `tokens`; its parents are the read-only array shared by every chain of its length."""
        return cls(np.asarray(tokens, np.int64), _chain_parent_array(len(tokens)))

    def depths(self) -> np.ndarray:
        """Depth of each node: 1 for children of the root."""
        depths, _ = tree_row_layout(tuple(self.parent_list))
        return np.array(depths[1:], dtype=np.int32)

    def ancestor_masks(self) -> np.ndarray:
        """int64 bitmask per node: bit j set when node j is the node itself or an ancestor."""
        _, row_masks = tree_row_layout(tuple(self.parent_list))
        return np.array([mask >> 1 for mask in row_masks[1:]], dtype=np.int64)  # row bits less the root's

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` inclusive."""
        if self.is_chain:
            return list(range(node + 1))
        parents = self.parent_list
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]


def _flat(values, dtype) -> np.ndarray:
    """`values` as a 1-D array of `dtype` (no copy when it is one already)."""
    array = np.asarray(values, dtype=dtype)
    return array if array.ndim == 1 else array.reshape(-1)


@functools.lru_cache(maxsize=MAX_TREE_NODES + 1)
def _chain_parents(n: int) -> list[int]:
    """The parents of an n-node chain: -1, 0, 1, ... (shared: callers must not modify it)."""
    return list(range(-1, n - 1))


@functools.lru_cache(maxsize=MAX_TREE_NODES + 1)
def _chain_parent_array(n: int) -> np.ndarray:
    """`_chain_parents(n)` as a read-only int32 array, shared by the chains `TokenTree.chain` makes."""
    parents = np.arange(-1, n - 1, dtype=np.int32)
    parents.flags.writeable = False
    return parents


@functools.lru_cache(maxsize=4096)
def tree_row_layout(parents: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A tree laid out behind its root, as verification feeds it (row 0 the root, row i + 1
    node i): each row's depth below the root and its ancestor mask (itself included) as bits
    of row indices, unsigned (up to 64 bits).

    Trees repeat their shapes (a proposer's chains are one shape per length), so each
    shape is laid out once rather than node by node for every sequence of every step.
    """
    depths, masks = [0], [1]
    for node, parent in enumerate(parents):
        depths.append(depths[parent + 1] + 1)
        masks.append(masks[parent + 1] | (2 << node))
    return tuple(depths), tuple(masks)


@dataclass
class ProposalRequest:
    """What a proposer sees of one running sequence."""

    request_id: str
    token_ids: Sequence[int]  # prompt + output so far (the last one is the tree's root)
    num_prompt_tokens: int
    max_nodes: int  # the node budget the coordinator grants this sequence this step


@dataclass
class Verdict:
    """What the verifier decided for one sequence's tree."""

    request_id: str
    accepted_tokens: list[int]  # the accepted draft tokens, root excluded
    bonus_token: Optional[int]  # the target's own next token after them (None once finished)
    num_draft_tokens: int = 0  # nodes the tree had


@dataclass
class SpecStats:
    """Counters for one request or for the whole engine."""

    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    sum_squared_accepted: int = 0  # of each tree's accepted tokens: with the sum, their variance
    accepted_length_counts: list[int] = field(default_factory=list)  # [n]: trees that accepted exactly n drafts

    def record(self, num_draft: int, num_accepted: int) -> None:
        """One verified tree: its node count and accepted tokens (every sequence, every step)."""
        self.num_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.sum_squared_accepted += num_accepted * num_accepted
        counts = self.accepted_length_counts
        if num_accepted >= len(counts):
            counts.extend([0] * (num_accepted + 1 - len(counts)))
        counts[num_accepted] += 1

    def record_batch(self, num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        """Several verified trees at once (a step's, for the engine's totals): node counts and accepted tokens."""
        self.num_steps += len(num_draft)
        self.num_draft_tokens += sum(num_draft)
        self.num_accepted_tokens += sum(num_accepted)
        self.sum_squared_accepted += sum(accepted * accepted for accepted in num_accepted)
        counts = self.accepted_length_counts
        for accepted in num_accepted:
            if accepted >= len(counts):
                counts.extend([0] * (accepted + 1 - len(counts)))
            counts[accepted] += 1

    @property
    def accepted_per_position(self) -> list[int]:
        """[i]: trees whose accepted path reached draft position i (0-based), i.e. accepted more than i drafts."""
        per_position, reached = [], 0
        for count in reversed(self.accepted_length_counts[1:]):
            reached += count
            per_position.append(reached)
        return per_position[::-1]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts plus the bonus token."""
        if not self.num_steps:
            return 0.0
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps


DEFAULT_TARGET_PARALLELISM = 64  # a proposer's node budget per step, summed over the batch, unless it sets its own


class Proposer(Protocol):
    """What the engine and the server use of a proposer. Implementations subclass it, which
    gives them the defaults below (the node budget, a ``close`` that does nothing)."""

    # The step's tree nodes summed over the batch: the coordinator divides it among the
    # sequences (`SpeculationController`) and sizes the step's token buffers with it.
    target_parallelism: int = DEFAULT_TARGET_PARALLELISM

    def propose(self, batch: Sequence[ProposalRequest]) -> list[TokenTree]:
        """One tree per request, each within its ``max_nodes`` budget (may be empty)."""

    def commit(self, verdicts: Sequence[Verdict]) -> None:
        """Learn what was accepted; roll internal state back to the accepted point."""

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request."""

    def close(self) -> None:
        """Stop any worker process and free what it holds now (the server calls it on shutdown)."""


@runtime_checkable
class DraftsAhead(Protocol):
    """A proposer that works between steps (the CPU draft worker) and is told of tokens decoded without it."""

    def observe(self, batch: Sequence[ProposalRequest]) -> None:
        """The sequences' tokens after a step that verified no tree (prefill, plain decoding); never waits."""


@runtime_checkable
class KnowsWhenReady(Protocol):
    """A proposer that can say how long its pending trees (`TokenTree.pending`) will stay pending
    (the CPU draft worker, prefilling prompts): the engine does not ask it again before then."""

    def ready_in(self) -> float:
        """Seconds until the trees it last answered pending should be ready; 0 when none are, or past."""
