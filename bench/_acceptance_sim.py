"""Speculation steps replayed on a reference greedy continuation: how many drafted tokens
greedy verification accepts per step, for each proposer, exactly and without the target.

Greedy verification accepts a draft token while it equals the target's greedy token, so on the
target's own greedy continuation `out` a step that starts at position i (context = prompt +
out[:i]) accepts the longest prefix of its proposal that matches out[i:], then adds out[i + a]
as the bonus token and the next step starts at i + a + 1 (Leviathan et al., 2023, greedy case).

A draft chain started at i proposes teacher-forced tokens for as long as it is right, so one
prefill of the draft over prompt + out gives every chain: `top1[j]` (the draft's greedy token
after prompt + out[:j]) and the accepted length from i for a chain of k is the run of
consecutive `top1[j] == out[j]` from i, capped at k. A tree with the draft's top-2 at its first
`branch_depth` levels (and a chain below each branch) accepts out[j] at those levels when it is
either of the two. The lookahead cache is replayed itself: it proposes on prompt + out[:i], the
tree is walked along out[i:], and it is told the verdict, as the engine does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from hetero.core.protocols import ProposalRequest, TokenTree, Verdict

# A proposer's accepted length for a step starting at output position i (never beyond the end).
StepFn = Callable[[int], int]


@dataclass
class StepLog:
    """Accepted draft tokens of every step, and the deepest each step's proposal went."""

    accepted: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)

    def extend(self, other: "StepLog") -> None:
        self.accepted += other.accepted
        self.depth += other.depth

    def mean_accepted_length(self) -> float:
        """Tokens per verification step: accepted drafts plus the bonus token."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else 0.0

    def per_position_acceptance(self, max_depth: int) -> list[float]:
        """P(position d accepted | position d drafted and d - 1 accepted), d = 1..max_depth."""
        rates = []
        for d in range(1, max_depth + 1):
            reached = sum(1 for a, k in zip(self.accepted, self.depth) if a >= d - 1 and k >= d)
            accepted = sum(1 for a in self.accepted if a >= d)
            rates.append(accepted / reached if reached else 0.0)
        return rates


def matching_runs(matches: Sequence[bool]) -> list[int]:
    """runs[j] = number of consecutive True from j on."""
    runs = [0] * (len(matches) + 1)
    for j in range(len(matches) - 1, -1, -1):
        runs[j] = runs[j + 1] + 1 if matches[j] else 0
    return runs[:-1]


def chain_steps(top1: Sequence[int], out: Sequence[int], k: int, branch: Sequence[int] = (), branch_depth: int = 0) -> StepFn:
    """The step function of a draft chain of depth k; with `branch` (the draft's second choice at
    every position) and `branch_depth` > 0, of a tree holding both choices at its first levels."""
    runs = matching_runs([a == b for a, b in zip(top1, out)])
    either = [a == b or (bool(branch) and c == b) for a, b, c in zip(top1, out, branch or top1)]

    def step(i: int) -> int:
        accepted = 0
        for level in range(min(branch_depth, k)):
            if i + accepted >= len(out) or not either[i + accepted]:
                return accepted
            accepted += 1
        tail = runs[i + accepted] if i + accepted < len(out) else 0
        return min(k, accepted + tail)

    return step


def replay(out_len: int, step: StepFn, depth: int, start: int = 1) -> StepLog:
    """Steps from output position `start` (out[0] comes from the prefill) to the end."""
    log = StepLog()
    i = start
    while i < out_len:
        accepted = min(step(i), out_len - i - 1) if out_len - i > 1 else 0
        log.accepted.append(accepted)
        log.depth.append(depth)
        i += accepted + 1
    return log


def tree_accepted(tree: TokenTree, continuation: Sequence[int]) -> int:
    """Length of the longest root path of `tree` that `continuation` starts with."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parent_list):
        children.setdefault(parent, []).append(node)
    accepted, parent = 0, -1
    while accepted < len(continuation):
        match = next((c for c in children.get(parent, []) if tree.token_list[c] == continuation[accepted]), None)
        if match is None:
            break
        accepted, parent = accepted + 1, match
    return accepted


def tree_depth(tree: TokenTree) -> int:
    depth = [0] * len(tree.parent_list)
    for node, parent in enumerate(tree.parent_list):
        depth[node] = 1 if parent < 0 else depth[parent] + 1
    return max(depth, default=0)


def replay_lookahead(cache, request_id: str, prompt: Sequence[int], out: Sequence[int], max_nodes: int,
                     other: StepFn | None = None, other_depth: int = 0, start: int = 1) -> StepLog:
    """The lookahead cache proposing along `out`; with `other`, each step accepts the longer of the
    cache's tree and `other`'s proposal `other_depth` deep (a draft model and the cache side by
    side, the step's depth the deeper of the two). Releases the
    request at the end, so its tokens enter the cache's global history as the engine's would."""
    log = StepLog()
    i = start
    tokens = list(prompt) + list(out[:start])
    while i < len(out):
        (tree,) = cache.propose([ProposalRequest(request_id, tokens, len(prompt), max_nodes)])
        accepted = tree_accepted(tree, out[i:len(out) - 1])
        if other is not None:
            accepted = max(accepted, min(other(i), len(out) - i - 1))
        new = list(out[i:i + accepted + 1])
        cache.commit([Verdict(request_id, new[:-1], new[-1], len(tree.token_list))])
        log.accepted.append(accepted)
        log.depth.append(max(tree_depth(tree), other_depth if other is not None else 0))
        tokens += new
        i += accepted + 1
    cache.release(request_id)
    return log
