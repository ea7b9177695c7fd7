"""The draft worker process: owns a Drafter, answers PROPOSE messages, drafts ahead between them.

Started as ``python -m cpu_draft.worker '<json>'``: a fresh interpreter like multiprocessing's
spawn, but one that does not re-run the user's main script (spawn would, and a script
without an ``if __name__ == "__main__"`` guard would then start a second engine).

Overlap: right after answering step t the worker assumes its whole chain is accepted,
guesses the bonus token with the draft itself, and drafts step t+1 from there while the
GPU verifies step t. When the next PROPOSE arrives, a sequence whose real context equals
the guessed one gets the tree drafted ahead as it is; any other sequence has its KV cut
back to the longest prefix it shares with the real context (the accepted part of the
chain is usually still there) and is drafted again. Drafting ahead stops at the next
depth level once a message is waiting, so it delays a request by at most one forward,
unless that message asks for the very trees being drafted (the guess held): then they are
finished, since drafting them again would cost more. Where cores are spare, the likeliest
other outcomes of the step are drafted ahead too, in the same forwards (`cpu_draft.runner_up`);
a waiting message that asks for one of the guesses lets drafting go on for that one only.
Sequences the coordinator decodes without trees (prefill, plain steps) arrive as SYNC
updates; the worker feeds their new tokens and drafts their next trees between messages
(`DraftService.catch_up`), so a prompt's draft prefill and a return to speculation after
plain steps cost the coordinator nothing.

Stats: ``exposed_s`` is draft time between receiving PROPOSE and replying (the
coordinator waits for it); ``hidden_s`` is drafting-ahead time between replying and
the next message (behind the target's verification). Overlap share = hidden / (hidden + exposed).
``predraft_hits`` counts trees served drafted ahead, of any guess; ``rejected_guess_hits`` and
``bonus_guess_hits`` those of runner-up guesses, of ``runner_up_guesses`` drafted.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import numpy as np
import torch

from cpu_draft.affinity import pin_current_process
from cpu_draft.draft_capacity import DraftCapacity
from cpu_draft.draft_tree import tree_levels
from cpu_draft.drafter import SHORT_FEED_TOKENS, DraftModelOptions, Drafter, common_prefix_length
from cpu_draft.messages import PROPOSE, READY, SHUTDOWN, STAT_NAMES, SYNC, TREES, read_updates, tree_arrays
from cpu_draft.runner_up import HIT_STATS, Predrafted, fork_runner_ups, matching, release_forks
from hetero.core.protocols import TokenTree
from ipc import Channel, Message, PeerDeadError

logger = logging.getLogger("hetero.cpu_draft.worker")
NEXT_MESSAGE_SPIN_S = 0.02  # between messages the worker spins this long before it sleeps: the next step's request is due soon


@dataclass(frozen=True)
class WorkerOptions:
    model: str
    draft: DraftModelOptions
    cpus: tuple[int, ...]
    num_threads: Optional[int] = None
    overlap: bool = True
    budget: int = 0  # nodes drafted ahead for sequences decoded without trees (`DraftService.catch_up`)
    runner_ups: int = 0  # runner-up guesses drafted ahead per sequence where cores are spare (`cpu_draft.runner_up`)

    def to_json(self) -> str:
        draft = dict(vars(self.draft), dtype=str(self.draft.dtype).removeprefix("torch."))
        return json.dumps(dict(model=self.model, draft=draft, cpus=list(self.cpus), num_threads=self.num_threads, overlap=self.overlap,
                               budget=self.budget, runner_ups=self.runner_ups))

    @classmethod
    def from_json(cls, text: str) -> "WorkerOptions":
        data = json.loads(text)
        draft = DraftModelOptions(**dict(data["draft"], dtype=getattr(torch, data["draft"]["dtype"]),
                                         keep_token_ids=tuple(data["draft"]["keep_token_ids"])))
        return cls(data["model"], draft, tuple(data["cpus"]), data["num_threads"], data["overlap"], data["budget"], data["runner_ups"])


@dataclass
class WorkerStats:
    exposed_s: float = 0.0
    hidden_s: float = 0.0
    predraft_hits: int = 0
    predraft_misses: int = 0
    runner_up_guesses: int = 0
    rejected_guess_hits: int = 0
    bonus_guess_hits: int = 0

    def as_list(self) -> list[float]:
        return [float(getattr(self, name)) for name in STAT_NAMES]


@dataclass
class DraftService:
    """The worker's drafting state, apart from the process plumbing (tests drive it directly)."""

    drafter: Drafter
    overlap: bool = True
    budget: int = 0  # nodes of a tree drafted ahead for a sequence the coordinator only told of (SYNC)
    runner_ups: int = 0  # runner-up guesses per sequence drafted ahead where cores are spare
    contexts: dict[int, list[int]] = field(default_factory=dict)
    predrafted: dict[int, Predrafted] = field(default_factory=dict)  # the main guess
    runner_up: dict[int, list[Predrafted]] = field(default_factory=dict)  # the runner-up guesses
    stats: WorkerStats = field(default_factory=WorkerStats)
    stale: set[int] = field(default_factory=set)  # sequences told of new tokens, with no tree drafted from them yet
    capacity: DraftCapacity = field(default_factory=DraftCapacity)
    offered: dict[int, tuple[int, list[int]]] = field(default_factory=dict)  # per sequence: (context length, chain) last proposed
    unserved: set[int] = field(default_factory=set)  # stale sequences the last proposal answered without a tree (a prompt to prefill)

    def apply_updates(self, arrays) -> None:
        for seq_id in arrays["released"].tolist():
            self.contexts.pop(seq_id, None)
            self.predrafted.pop(seq_id, None)
            self.runner_up.pop(seq_id, None)
            release_forks(self.drafter, seq_id, self.runner_ups)
            self.offered.pop(seq_id, None)
            self.unserved.discard(seq_id)
            self.capacity.forget(seq_id)
            self.stale.discard(seq_id)
            self.drafter.release(seq_id)
        for update in read_updates(arrays):
            context = self.contexts.get(update.seq_id, [])
            if update.keep > len(context):
                raise RuntimeError(f"sequence {update.seq_id}: told to keep {update.keep} tokens of {len(context)}")
            context = self.contexts[update.seq_id] = context[: update.keep] + update.new_tokens
            self.stale.add(update.seq_id)
            self.unserved.discard(update.seq_id)
            offered = self.offered.pop(update.seq_id, None)
            if offered is not None and len(context) > offered[0]:  # the tree was verified: how much of its chain held
                start, chain = offered
                self.capacity.observe_accepted(update.seq_id, common_prefix_length(context[start:], chain) / len(chain))

    def asked_for(self, message: Optional[Message], seq_ids: Sequence[int], forks: Sequence[tuple[int, Hashable]] = ()) -> Optional[set]:
        """The drafter's sequences drafting the contexts ``message`` asks trees of, where it asks
        for one being drafted for each of ``seq_ids`` (by the sequence itself or one of its
        ``forks``, (seq_id, fork) pairs: a guess held): drafting then goes on for those instead
        of stopping. None where it does not."""
        if message is None or message.kind != PROPOSE or set(message.arrays["released"].tolist()) & set(seq_ids):
            return None
        contexts = {seq_id: self.contexts[seq_id] for seq_id in seq_ids}
        for update in read_updates(message.arrays):
            if update.seq_id in contexts:
                contexts[update.seq_id] = contexts[update.seq_id][: update.keep] + update.new_tokens
        drafting = {seq_id: [seq_id] for seq_id in seq_ids}
        for seq_id, fork in forks:
            drafting[seq_id].append(fork)
        asked = set()
        for seq_id in seq_ids:
            holder = next((d for d in drafting[seq_id] if self.drafter.context(d) == contexts[seq_id]), None)
            if holder is None:
                return None
            asked.add(holder)
        return asked

    def _interrupt(self, pending, seq_ids: Sequence[int], forks: Sequence[tuple[int, Hashable]] = ()):
        """Stop drafting ahead for a waiting message, unless it asks for what is being drafted:
        then go on with what it asks for only (`Drafter.draft`'s ``interrupt``)."""
        def verdict():
            message = pending()
            if message is None:
                return False
            asked = self.asked_for(message, seq_ids, forks)
            return True if asked is None else asked

        return verdict

    def catch_up(self, pending) -> None:
        """Between messages: feed the stale sequences' new tokens and draft their next trees
        (``budget`` nodes, or the last budget asked), until done or a message is waiting
        (``pending()``: the waiting message, or None)."""
        if not self.overlap or not self.budget or pending() is not None:
            return
        stale = sorted(self.stale)
        for seq_id in stale:
            self.drafter.set_context(seq_id, self.contexts[seq_id])
        # The new tokens in short forwards that a waiting message interrupts (a large batch's
        # tokens of a plain window would otherwise be one long forward the next proposal waits for).
        if not stale or not self.drafter.prefill(stale, interrupt=lambda: pending() is not None):
            return
        # A sequence answered without a tree is decoding its next token on the GPU now: draft from the guess of it.
        guessed = set(self.drafter.assume_accepted([s for s in stale if s in self.unserved]))
        requests = [(seq_id, self.budget) for seq_id in stale]
        trees = self.drafter.draft(requests, interrupt=self._interrupt(pending, stale))
        if trees is None:
            return
        for (seq_id, max_nodes), tree in zip(requests, trees):
            context = self.drafter.context(seq_id) if seq_id in guessed else self.contexts[seq_id]
            self.predrafted[seq_id] = Predrafted(list(context), max_nodes, tree)
            self.runner_up.pop(seq_id, None)
        self.stale.clear()
        self.unserved.clear()

    def propose(self, batch: list[tuple[int, int]]) -> list[TokenTree]:
        """Trees for (seq_id, max_nodes): drafted ahead where the guess held; none for sequences
        beyond what the cores can draft within a step (`DraftCapacity`).

        The rest (misses) are drafted now, before the reply, only where the trees are worth the
        whole step's wait for them (`DraftCapacity.draft_now_pays`: at batch 1 usually, among
        hits or in a large batch not). Otherwise they get an empty tree this step and are drafted
        right after the reply, with the hits' next trees, from the guess of the token this step
        decodes for them (`draft_ahead`)."""
        trees: dict[int, TokenTree] = {}
        misses, prefilling = [], set()
        self.stale.difference_update(seq_id for seq_id, _ in batch)
        self.budget = max((max_nodes for _, max_nodes in batch), default=self.budget) or self.budget
        depth = len(tree_levels(self.budget, self.drafter.options.tree_width))
        chosen = self.capacity.select([seq_id for seq_id, max_nodes in batch if max_nodes > 0], depth)
        for seq_id, max_nodes in batch:
            ahead, others = self.predrafted.pop(seq_id, None), self.runner_up.pop(seq_id, [])
            if seq_id not in chosen:
                continue
            context = self.contexts[seq_id]
            hit = matching(([ahead] if ahead is not None else []) + others, context, max_nodes)
            if hit is not None:
                if hit.holder is not None:
                    self.drafter.adopt(seq_id, hit.holder)
                    setattr(self.stats, HIT_STATS[hit.kind], getattr(self.stats, HIT_STATS[hit.kind]) + 1)
                trees[seq_id] = self.drafter.shrink_last_draft(seq_id, hit.tree, max_nodes)
                self.stats.predraft_hits += 1
                continue
            if ahead is not None:
                self.stats.predraft_misses += 1
            self.drafter.set_context(seq_id, context)
            if self.overlap and self.drafter.uncached(seq_id) > SHORT_FEED_TOKENS:
                self.stale.add(seq_id)  # a prompt to prefill: no tree now, `catch_up` drafts one after the reply
                self.unserved.add(seq_id)
                prefilling.add(seq_id)
                continue
            misses.append((seq_id, max_nodes))
        if self.overlap and misses and not self.capacity.draft_now_pays([s for s, _ in misses], len(batch), depth):
            self.stale.update(seq_id for seq_id, _ in misses)
            self.unserved.update(seq_id for seq_id, _ in misses)
            misses = []
        trees.update(zip((s for s, _ in misses), self.drafter.draft(misses)))
        for seq_id, tree in trees.items():
            chain = self.drafter.last_chain(seq_id)
            if len(tree) and chain:
                self.offered[seq_id] = (len(self.contexts[seq_id]), list(chain))
        # A prompt still prefilling is pending (the engine does not judge speculation by it); a miss
        # left for later is an empty tree: its step is what speculation costs here.
        return [trees.get(seq_id, TokenTree.pending() if seq_id in prefilling else TokenTree.empty()) for seq_id, _ in batch]

    def draft_ahead(self, batch: list[tuple[int, int]], pending) -> None:
        """Draft the next step assuming full acceptance (for the sequences answered without a
        tree: assuming the draft's guess of the token this step decodes), and where cores are
        spare its likeliest runner-up outcomes in the same forwards, until done or a message
        is waiting that does not ask for these trees (``pending()``: the waiting message, or None)."""
        if not self.overlap or pending() is not None:
            return
        budgets = dict(batch)
        started = time.perf_counter()
        extended = self.drafter.assume_accepted([s for s, n in batch if n > 0 and (s in self.offered or s in self.unserved)])
        if not extended or pending() is not None and self.asked_for(pending(), extended) is None:
            return
        depth = max(len(tree_levels(budgets[s], self.drafter.options.tree_width)) for s in extended)
        forks = fork_runner_ups(self.drafter, extended, self.runner_ups, self.capacity.spare_rows(len(extended), depth))
        requests = [(seq_id, budgets[seq_id]) for seq_id in extended] + [(fork, budgets[seq_id]) for seq_id, fork, _ in forks]
        trees = self.drafter.draft(requests, interrupt=self._interrupt(pending, extended, [(s, f) for s, f, _ in forks]))
        if trees is None:
            return
        if all(len(tree) for tree in trees):  # every row drafted to the end (none dropped for a waiting proposal)
            self.capacity.observe_levels(time.perf_counter() - started, depth + 1, len(requests))
        for seq_id, tree in zip(extended, trees):
            self.runner_up[seq_id] = []
            if len(tree):  # (none where a waiting proposal asked for a runner-up guess instead)
                self.predrafted[seq_id] = Predrafted(list(self.drafter.context(seq_id)), budgets[seq_id], tree)
            self.stale.discard(seq_id)
            self.unserved.discard(seq_id)
        for (seq_id, fork, kind), tree in zip(forks, trees[len(extended) :]):
            if len(tree):
                self.runner_up[seq_id].append(Predrafted(list(self.drafter.context(fork)), budgets[seq_id], tree, kind, fork))
                self.stats.runner_up_guesses += 1


class _Loop:
    def __init__(self, service: DraftService, channel: Channel):
        self.service = service
        self.channel = channel
        self._pending: Optional[Message] = None
        self._arrived = 0.0

    def pending(self) -> Optional[Message]:
        """The next message if one is waiting (kept for `next_message`), else None; never waits."""
        if self._pending is None:
            message = self.channel.try_recv()
            if message is not None:
                self._pending, self._arrived = message.copy(), time.monotonic()
        return self._pending

    def next_message(self) -> tuple[Message, float]:
        """The next message and when it was first seen (`time.monotonic`)."""
        if self._pending is not None:
            message, self._pending = self._pending, None
            return message, self._arrived
        message = self.channel.recv(spin_s=NEXT_MESSAGE_SPIN_S)
        return message, time.monotonic()

    def run(self) -> None:
        answered: Optional[float] = None  # when the last proposal was answered (time.monotonic), while no SYNC came since
        timeline = logger.isEnabledFor(logging.DEBUG)
        while True:
            message, arrived = self.next_message()
            if message.kind == SHUTDOWN:
                return
            if message.kind not in (SYNC, PROPOSE):
                raise RuntimeError(f"draft worker got an unknown message kind {message.kind}")
            started = time.monotonic()
            stats = self.service.stats
            hits, misses, runner_up_hits = stats.predraft_hits, stats.predraft_misses, stats.rejected_guess_hits + stats.bonus_guess_hits
            self.service.apply_updates(message.arrays)
            if message.kind == SYNC:
                answered = None
                self.service.catch_up(self.pending)
                stats.hidden_s += time.monotonic() - started
                if timeline:
                    logger.debug("SYNC queued %.2f ms, caught up in %.2f ms", 1e3 * (started - arrived), 1e3 * (time.monotonic() - started))
                continue
            # The verification step is from the reply to the proposal's sending: a proposal that
            # waited for the worker's own drafting must not make the step look longer.
            sent_at = float(message.arrays["sent_at"][0])  # read now: the message's views end at the next poll
            cycle = sent_at - answered if answered is not None else None
            if cycle is not None:
                self.service.capacity.observe_cycle(cycle)
            batch = list(zip(message.arrays["batch"].tolist(), message.arrays["max_nodes"].tolist()))
            trees = self.service.propose(batch)
            stats.exposed_s += time.monotonic() - started
            self.channel.send(TREES, tree_arrays(trees, stats.as_list()))
            replied = time.monotonic()
            self.service.draft_ahead(batch, self.pending)
            self.service.catch_up(self.pending)
            stats.hidden_s += time.monotonic() - replied
            if timeline:
                logger.debug("PROPOSE of %d, sent %.2f ms after the last reply: queued %.2f ms, replied in %.2f ms (%d drafted ahead, "
                             "%d of them from runner-up guesses, %d drafted again, %d pending, %d empty); then drafted ahead for %.2f ms",
                             len(batch), 1e3 * cycle if cycle is not None else float("nan"),
                             1e3 * (started - sent_at),
                             1e3 * (replied - started), stats.predraft_hits - hits,
                             stats.rejected_guess_hits + stats.bonus_guess_hits - runner_up_hits, stats.predraft_misses - misses,
                             sum(not t.ready for t in trees), sum(t.ready and not len(t) for t in trees), 1e3 * (time.monotonic() - replied))
            answered = replied


def worker_main(spec: dict, options: WorkerOptions) -> None:
    """Pin, load, attach, serve until SHUTDOWN or the owner dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    level = os.environ.get("HETERO_LOGGING_LEVEL", "INFO").upper()  # DEBUG: a line per message (`_Loop.run`)
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s draft-worker %(levelname)s %(message)s")
    threads = pin_current_process(options.cpus, options.num_threads)
    drafter = Drafter.load(options.model, options.draft)
    drafter.warm_up(options.budget or 1)
    try:
        channel = Channel.attach(spec)
    except PeerDeadError:
        logger.info("the coordinator is gone before the model loaded; exiting")
        return
    logger.info("pid %d drafting with %s on cpus %s, %d threads", os.getpid(), options.model, list(options.cpus), threads)
    try:
        channel.send(READY, {"pid": np.asarray([os.getpid()], np.int64)})
        _Loop(DraftService(drafter, options.overlap, options.budget, options.runner_ups), channel).run()
    except PeerDeadError:
        logger.info("the coordinator is gone; exiting")
    finally:
        channel.close()


def launch_command(spec: dict, options: WorkerOptions) -> list[str]:
    return [sys.executable, "-m", "cpu_draft.worker", json.dumps({"spec": spec, "options": options.to_json()})]


if __name__ == "__main__":
    arguments = json.loads(sys.argv[1])
    worker_main(arguments["spec"], WorkerOptions.from_json(arguments["options"]))
