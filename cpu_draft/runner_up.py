"""Drafting ahead for a step's runner-up outcomes beside its likeliest one.

The worker drafts step t+1 during step t from the guess that tree t's chain is accepted
with the draft's bonus token; with a chain of d tokens accepted at p per token that guess
holds about p^d of the time. The other outcomes are the tree rejected at some level (the
target's token there is then its correction, most often the draft's runner-up at that
level) and the chain accepted with another bonus. Where the cores are spare
(`DraftCapacity.spare_rows`: a small batch's forward is bound by its weights, so a few more
rows cost little), the likeliest of these, by the draft's own probabilities
(`Drafter.runner_up_guesses`), are drafted in the same forwards as the main guess, each in a
fork of the sequence (`Drafter.fork`: the K/V of the shared prefix copied, only the part
the fork lacks). A reply that matches one is served from it (`Drafter.adopt`), as SpecInfer
and Sequoia cover several outcomes with one tree, here across steps.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

from cpu_draft.drafter import Drafter
from hetero.core.protocols import TokenTree

FULL = "full"  # the main guess: the chain accepted, the bonus the draft's first choice
HIT_STATS = {"rejected": "rejected_guess_hits", "bonus": "bonus_guess_hits"}  # `WorkerStats` counter of each runner-up kind


@dataclass
class Predrafted:
    """A tree drafted ahead from a guessed ``context``, held by the drafter's sequence ``holder``
    (None: the sequence itself; else a fork of it)."""

    context: list[int]
    max_nodes: int
    tree: TokenTree
    kind: str = FULL
    holder: Optional[Hashable] = None


def fork_id(seq_id: int, index: int) -> tuple:
    return ("runner-up", seq_id, index)


def fork_runner_ups(drafter: Drafter, seq_ids: Sequence[int], per_seq: int, rows: int) -> list[tuple[int, Hashable, str]]:
    """Fork the likeliest runner-up contexts of ``seq_ids`` (just extended by `Drafter.assume_accepted`),
    most probable first across them, at most ``per_seq`` each and ``rows`` in all: (seq_id, fork, kind)."""
    if per_seq <= 0 or rows <= 0:
        return []
    ranked = sorted(((guess, seq_id) for seq_id in seq_ids for guess in drafter.runner_up_guesses(seq_id)), key=lambda item: -item[0].prob)
    taken: dict[int, int] = defaultdict(int)
    forks = []
    for guess, seq_id in ranked:
        if len(forks) == rows:
            break
        if taken[seq_id] == per_seq:
            continue
        fork = fork_id(seq_id, taken[seq_id])
        if drafter.fork(seq_id, fork, drafter.context(seq_id)[: guess.prefix] + [guess.token]):
            taken[seq_id] += 1
            forks.append((seq_id, fork, guess.kind))
    return forks


def release_forks(drafter: Drafter, seq_id: int, per_seq: int) -> None:
    for index in range(per_seq):
        drafter.release(fork_id(seq_id, index))


def matching(guesses: Sequence[Predrafted], context: list[int], max_nodes: int) -> Optional[Predrafted]:
    """The guess drafted from ``context`` with a budget of at least ``max_nodes``, if any."""
    return next((g for g in guesses if g.context == context and max_nodes <= g.max_nodes), None)
