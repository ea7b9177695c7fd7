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
depth level once a message is waiting, so it delays a request by at most one forward.
Where that message asks for the very trees being drafted (the guess held), a single
sequence's draft is finished (drafting it again would cost more), and a batch's trees are
cut at the level they reached and sent as they are, shallower, rather than holding the
whole batch's step for the rest.
Sequences the coordinator decodes without trees (prefill, plain steps) arrive as SYNC
updates; the worker feeds their new tokens and drafts their next trees between messages
(`DraftService.catch_up`), so a prompt's draft prefill and a return to speculation after
plain steps cost the coordinator nothing. A proposal that arrives before that catch-up
(the coordinator's SYNC and its next proposal often come together) gets pending trees for
those sequences, which the engine's controller does not judge. After `PLAIN_WINDOWS_DRAFTED`
SYNCs in a row (speculation is off) the catch-up feeds the tokens but drafts no trees: they
would only contend with the engine for the host's cores and memory.

Stats: ``exposed_s`` is draft time between receiving PROPOSE and replying (the
coordinator waits for it); ``hidden_s`` is drafting-ahead time between replying and
the next message (behind the target's verification). Overlap share = hidden / (hidden + exposed).
``ahead_s`` / ``ahead_levels``: the drafts made ahead and their depth levels, whose ratio is
the time of a forward in service (beside the coordinator's traffic), which
`bench.cpu_draft` times alone.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from cpu_draft.affinity import pin_current_process
from cpu_draft.draft_capacity import DraftCapacity
from cpu_draft.drafter import SHORT_FEED_TOKENS, DraftModelOptions, Drafter, common_prefix_length, tree_levels
from cpu_draft.messages import PROPOSE, READY, SHUTDOWN, STAT_NAMES, SYNC, TREES, read_updates, tree_arrays
from hetero.core.protocols import TokenTree
from ipc import Channel, Message, PeerDeadError

logger = logging.getLogger("hetero.cpu_draft.worker")
NEXT_MESSAGE_SPIN_S = 0.02  # between messages the worker spins this long before it sleeps: the next step's request is due soon
DUE_MARGIN_S = 0.05  # how long past its estimate the worker still expects the held proposal (`_Loop.run`)
MIN_PACE_TOKENS = 64  # prompt tokens a catch-up must prefill for its pace to count (`_observe_prefill`)
# Shortest prompt backlog worth announcing (`DraftService.propose`): one the engine gains from holding
# its proposals through (a large batch's prompts, the better part of a second); shorter ones (a few
# prompts: a few windows) it rides out as before, at the cost of a single step or two.
MIN_ANNOUNCED_BACKLOG_S = 0.25
PLAIN_WINDOWS_DRAFTED = 2  # SYNCs in a row after which catch-up feeds tokens but drafts no trees (speculation is off)


@dataclass(frozen=True)
class WorkerOptions:
    model: str
    draft: DraftModelOptions
    cpus: tuple[int, ...]
    num_threads: Optional[int] = None
    overlap: bool = True
    budget: int = 0  # nodes drafted ahead for sequences decoded without trees (`DraftService.catch_up`)

    def to_json(self) -> str:
        draft = dict(vars(self.draft), dtype=str(self.draft.dtype).removeprefix("torch."))
        return json.dumps(dict(model=self.model, draft=draft, cpus=list(self.cpus), num_threads=self.num_threads, overlap=self.overlap,
                               budget=self.budget))

    @classmethod
    def from_json(cls, text: str) -> "WorkerOptions":
        data = json.loads(text)
        draft = DraftModelOptions(**dict(data["draft"], dtype=getattr(torch, data["draft"]["dtype"]),
                                         keep_token_ids=tuple(data["draft"]["keep_token_ids"])))
        return cls(data["model"], draft, tuple(data["cpus"]), data["num_threads"], data["overlap"], data["budget"])


@dataclass
class _Predrafted:
    context: list[int]
    max_nodes: int
    tree: TokenTree


@dataclass
class WorkerStats:
    exposed_s: float = 0.0
    hidden_s: float = 0.0
    predraft_hits: int = 0
    predraft_misses: int = 0
    ahead_s: float = 0.0  # drafting ahead: the seconds of its drafts ...
    ahead_levels: int = 0  # ... and their depth levels (forwards), so that their mean is a forward's time in service

    def as_list(self) -> list[float]:
        return [float(getattr(self, name)) for name in STAT_NAMES]


@dataclass
class DraftService:
    """The worker's drafting state, apart from the process plumbing (tests drive it directly)."""

    drafter: Drafter
    overlap: bool = True
    budget: int = 0  # nodes of a tree drafted ahead for a sequence the coordinator only told of (SYNC)
    contexts: dict[int, list[int]] = field(default_factory=dict)
    predrafted: dict[int, _Predrafted] = field(default_factory=dict)
    stats: WorkerStats = field(default_factory=WorkerStats)
    stale: set[int] = field(default_factory=set)  # sequences told of new tokens, with no tree drafted from them yet
    capacity: DraftCapacity = field(default_factory=DraftCapacity)
    offered: dict[int, tuple[int, list[int]]] = field(default_factory=dict)  # per sequence: (context length, chain) last proposed
    unserved: set[int] = field(default_factory=set)  # stale sequences the last proposal answered without a tree (a prompt to prefill)
    fresh: set[int] = field(default_factory=set)  # new, or told of tokens by SYNC (steps without trees), since their last proposal
    depth: Optional[int] = None  # the depth `DraftCapacity.plan` chose at the last proposal (None: the budget's)
    prefill_pace: Optional[float] = None  # prompt tokens a second its prefills ran at (`catch_up`), None until measured
    ready_in_s: float = 0.0  # the last proposal's estimate of when its pending trees will be ready (`propose`)

    def apply_updates(self, arrays, plain: bool = False) -> bool:
        """Take a message's context updates and releases; ``plain``: a SYNC's, of steps decoded without trees.

        Returns whether a sequence got more tokens than one verification step gives it (its
        offered chain and the bonus token; one without a tree): steps without trees came since
        the last proposal, told in this message rather than by a SYNC (under async scheduling a
        probe after a plain window is launched before the window is synced)."""
        past_one_step = False
        for seq_id in arrays["released"].tolist():
            self.contexts.pop(seq_id, None)
            self.predrafted.pop(seq_id, None)
            self.offered.pop(seq_id, None)
            self.unserved.discard(seq_id)
            self.fresh.discard(seq_id)
            self.capacity.forget(seq_id)
            self.stale.discard(seq_id)
            self.drafter.release(seq_id)
        for update in read_updates(arrays):
            new = update.seq_id not in self.contexts
            context = self.contexts.get(update.seq_id, [])
            if update.keep > len(context):
                raise RuntimeError(f"sequence {update.seq_id}: told to keep {update.keep} tokens of {len(context)}")
            told = len(context)
            context = self.contexts[update.seq_id] = context[: update.keep] + update.new_tokens
            self.stale.add(update.seq_id)
            self.unserved.discard(update.seq_id)
            if plain or new:
                self.fresh.add(update.seq_id)
            offered = self.offered.pop(update.seq_id, None)
            start, chain = offered if offered is not None else (told, [])
            past_one_step |= len(context) - start > len(chain) + 1
            if offered is not None and len(context) > start:  # the tree was verified: how much of its chain held
                self.capacity.observe_accepted(update.seq_id, common_prefix_length(context[start:], chain), len(chain))
        return past_one_step

    def needed_by(self, message: Optional[Message], seq_ids: Sequence[int]) -> bool:
        """Whether ``message`` asks for trees of exactly the contexts the drafter is drafting
        ``seq_ids`` from (its guess held): then drafting goes on instead of stopping for it."""
        if message is None or message.kind != PROPOSE or set(message.arrays["released"].tolist()) & set(seq_ids):
            return False
        contexts = {seq_id: self.contexts[seq_id] for seq_id in seq_ids}
        for update in read_updates(message.arrays):
            if update.seq_id in contexts:
                contexts[update.seq_id] = contexts[update.seq_id][: update.keep] + update.new_tokens
        return all(contexts[seq_id] == self.drafter.context(seq_id) for seq_id in seq_ids)

    def _interrupt(self, pending, seq_ids: Sequence[int]):
        """Stop drafting ahead for a waiting message, unless it asks for what is being drafted."""
        return lambda: pending() is not None and not self.needed_by(pending(), seq_ids)

    @staticmethod
    def _cut(pending, seq_ids: Sequence[int]):
        """Polled after `_interrupt` let drafting go on: a waiting proposal asks for these very
        trees. Several sequences' trees are cut at the level they reached and go out as they are
        (shallower trees, not a whole batch's step held for the rest of a draft that overran it);
        one sequence's draft is finished (its levels cost less than the tokens they add)."""
        return lambda: len(seq_ids) > 1 and pending() is not None

    def catch_up(self, pending, draft: bool = True) -> None:
        """Between messages: feed the stale sequences' new tokens and, with ``draft``, draft their
        next trees (``budget`` nodes, or the last budget asked), until done or a message is
        waiting (``pending()``: the waiting message, or None). Without ``draft`` the sequences
        stay stale: their trees are drafted at the next catch-up that drafts, or when asked."""
        if not self.overlap or not self.budget or pending() is not None:
            return
        # The sequences the last proposal answered without a tree first: the prompts of those it will draft for.
        stale = sorted(self.stale, key=lambda seq_id: (seq_id not in self.unserved, seq_id))
        for seq_id in stale:
            self.drafter.set_context(seq_id, self.contexts[seq_id])
        # The new tokens in short forwards that a waiting message interrupts (a large batch's
        # tokens of a plain window would otherwise be one long forward the next proposal waits for).
        backlog, started = self._prompt_backlog(stale), time.perf_counter()
        prefilled = bool(stale) and self.drafter.prefill(stale, interrupt=lambda: pending() is not None)
        self._observe_prefill(backlog - self._prompt_backlog(stale), time.perf_counter() - started)
        if not prefilled or not draft:
            return
        # A sequence answered without a tree is decoding its next token on the GPU now: draft from the guess of it.
        guessed = set(self.drafter.assume_accepted([s for s in stale if s in self.unserved]))
        requests = [(seq_id, self._planned(self.budget)) for seq_id in stale]
        trees = self.drafter.draft(requests, interrupt=self._interrupt(pending, stale), cut=self._cut(pending, stale))
        if trees is None:
            return
        for (seq_id, max_nodes), tree in zip(requests, trees):
            context = self.drafter.context(seq_id) if seq_id in guessed else self.contexts[seq_id]
            self.predrafted[seq_id] = _Predrafted(list(context), max_nodes, tree)
        self.stale.clear()
        self.unserved.clear()

    def _prompt_backlog(self, seq_ids) -> int:
        """Prompt tokens whose K/V the sequences still need (feeds longer than a catch-up's)."""
        return sum(uncached for uncached in map(self.drafter.uncached, seq_ids) if uncached > SHORT_FEED_TOKENS)

    def _observe_prefill(self, tokens: int, seconds: float) -> None:
        """One catch-up's prompt tokens and time: the pace `propose` estimates readiness from."""
        if tokens < MIN_PACE_TOKENS or seconds <= 0:
            return
        pace = tokens / seconds
        self.prefill_pace = pace if self.prefill_pace is None else 0.5 * (self.prefill_pace + pace)

    def propose(self, batch: list[tuple[int, int]]) -> list[TokenTree]:
        """Trees for (seq_id, max_nodes): drafted ahead where the guess held; none for sequences
        beyond what the cores can draft within a step (`DraftCapacity`).

        The rest (misses) are drafted now, before the reply, only where the trees are worth the
        whole step's wait for them (`DraftCapacity.draft_now_pays`: at batch 1 usually, among
        hits or in a large batch not). Otherwise they get an empty tree this step and are drafted
        right after the reply, with the hits' next trees, from the guess of the token this step
        decodes for them (`draft_ahead`)."""
        trees: dict[int, TokenTree] = {}
        misses, not_ready = [], set()
        self.stale.difference_update(seq_id for seq_id, _ in batch)
        self.budget = max((max_nodes for _, max_nodes in batch), default=self.budget) or self.budget
        depth = len(tree_levels(self.budget, self.drafter.options.tree_width))
        chosen, self.depth = self.capacity.plan([seq_id for seq_id, max_nodes in batch if max_nodes > 0], depth)
        for seq_id, max_nodes in batch:
            if seq_id not in chosen:
                self.predrafted.pop(seq_id, None)
                continue
            max_nodes = self._planned(max_nodes)
            context = self.contexts[seq_id]
            ahead = self.predrafted.pop(seq_id, None)
            if ahead is not None and ahead.context == context:  # drafted ahead to another depth plan: shrunk or kept
                trees[seq_id] = self.drafter.shrink_last_draft(seq_id, ahead.tree, min(max_nodes, len(ahead.tree)))
                self.stats.predraft_hits += 1
                continue
            if ahead is not None:
                self.stats.predraft_misses += 1
            self.drafter.set_context(seq_id, context)
            if self.overlap and self.drafter.uncached(seq_id) > SHORT_FEED_TOKENS:
                self.stale.add(seq_id)  # a prompt to prefill: no tree now, `catch_up` drafts one after the reply
                self.unserved.add(seq_id)
                not_ready.add(seq_id)
                continue
            misses.append((seq_id, max_nodes))
        if self.overlap and misses and not self.capacity.draft_now_pays([s for s, _ in misses], len(batch), self.depth):
            self.stale.update(seq_id for seq_id, _ in misses)
            self.unserved.update(seq_id for seq_id, _ in misses)
            # New or back from plain steps, and `catch_up` has not drafted for it yet: not ready, as a prompt is.
            not_ready.update(seq_id for seq_id, _ in misses if seq_id in self.fresh)
            misses = []
        self.fresh.difference_update(seq_id for seq_id, _ in batch)
        trees.update(zip((s for s, _ in misses), self.drafter.draft(misses)))
        for seq_id, tree in trees.items():
            chain = self.drafter.last_chain(seq_id)
            if len(tree) and chain:
                self.offered[seq_id] = (len(self.contexts[seq_id]), list(chain))
        # Prompts still to prefill keep their trees pending for a while: the engine may hold its next
        # proposal that long (`WorkerDraftProposer.ready_in`) rather than ask after every plain window.
        prompts = self._prompt_backlog(not_ready)
        backlog_s = prompts / self.prefill_pace if prompts and self.prefill_pace else 0.0
        self.ready_in_s = backlog_s if backlog_s >= MIN_ANNOUNCED_BACKLOG_S else 0.0
        # A prompt still prefilling, or a sequence new or back from plain steps whose catch-up
        # the proposal cut short, is pending (the engine does not judge speculation by it); a miss
        # left for later is an empty tree: its step is what speculation costs here.
        return [trees.get(seq_id, TokenTree.pending() if seq_id in not_ready else TokenTree.empty()) for seq_id, _ in batch]

    def _planned(self, max_nodes: int) -> int:
        """``max_nodes`` cut to the planned depth's levels."""
        if self.depth is None:
            return max_nodes
        return min(max_nodes, self.depth * self.drafter.options.tree_width)

    def draft_ahead(self, batch: list[tuple[int, int]], pending) -> None:
        """Draft the next step assuming full acceptance (for the sequences answered without a
        tree: assuming the draft's guess of the token this step decodes), until done or a
        message is waiting that does not ask for these trees (``pending()``: the waiting
        message, or None)."""
        if not self.overlap or pending() is not None:
            return
        budgets = {seq_id: self._planned(max_nodes) for seq_id, max_nodes in batch}
        started = time.perf_counter()
        extended = self.drafter.assume_accepted([s for s, n in batch if n > 0 and (s in self.offered or s in self.unserved)])
        if not extended or pending() is not None and not self.needed_by(pending(), extended):
            return
        requests = [(seq_id, budgets[seq_id]) for seq_id in extended]
        interrupt, polls = self._interrupt(pending, extended), 0

        def counted_interrupt() -> bool:
            nonlocal polls
            polls += 1
            return interrupt()

        trees = self.drafter.draft(requests, interrupt=counted_interrupt, cut=self._cut(pending, extended))
        # Its forwards: the guess's, the first level's and one more per poll that let drafting go
        # on (the levels of its deepest tree where it was cut short). An interrupted draft counts
        # too: learning from finished ones alone, the capacity plan would keep planning the
        # drafts that overrun the step (they are the ones cut off).
        width = self.drafter.options.tree_width
        levels = max(len(tree_levels(len(tree), width)) for tree in trees) if trees is not None else polls
        seconds = time.perf_counter() - started
        self.capacity.observe_levels(seconds, levels + 1, len(requests))
        self.stats.ahead_s += seconds
        self.stats.ahead_levels += levels + 1
        if trees is None:
            return
        for (seq_id, max_nodes), tree in zip(requests, trees):
            self.predrafted[seq_id] = _Predrafted(list(self.drafter.context(seq_id)), max_nodes, tree)
            self.stale.discard(seq_id)
            self.unserved.discard(seq_id)


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
        syncs = 0  # SYNCs since the last proposal: plain windows in a row
        due = 0.0  # (time.monotonic) when the engine, told its trees were pending that long, will ask again
        timeline = logger.isEnabledFor(logging.DEBUG)
        while True:
            message, arrived = self.next_message()
            if message.kind == SHUTDOWN:
                return
            if message.kind not in (SYNC, PROPOSE):
                raise RuntimeError(f"draft worker got an unknown message kind {message.kind}")
            started = time.monotonic()
            stats = self.service.stats
            hits, misses = stats.predraft_hits, stats.predraft_misses
            past_one_step = self.service.apply_updates(message.arrays, plain=message.kind == SYNC)
            if message.kind == SYNC:
                answered, syncs = None, syncs + 1
                # After a plain window or two (a controller's comparison, prompts prefilling) the
                # next proposal is due: draft for it; so too until the time the last reply said its
                # pending trees would be ready (the engine holds its next proposal till then). Past
                # that speculation is off, and its trees would only contend for the host's cores
                # and memory with the engine: feed the tokens only.
                self.service.catch_up(self.pending, draft=syncs <= PLAIN_WINDOWS_DRAFTED or started <= due)
                stats.hidden_s += time.monotonic() - started
                if timeline:
                    logger.debug("SYNC queued %.2f ms, caught up in %.2f ms", 1e3 * (started - arrived), 1e3 * (time.monotonic() - started))
                continue
            # The verification step is from the reply to the proposal's sending: a proposal that
            # waited for the worker's own drafting must not make the step look longer, nor one
            # whose tokens show that steps without trees (a plain window) came between.
            sent_at = float(message.arrays["sent_at"][0])  # read now: the message's views end at the next poll
            cycle = sent_at - answered if answered is not None else None
            if cycle is not None and not past_one_step:
                self.service.capacity.observe_cycle(cycle)
            batch = list(zip(message.arrays["batch"].tolist(), message.arrays["max_nodes"].tolist()))
            syncs = 0
            trees = self.service.propose(batch)
            stats.exposed_s += time.monotonic() - started
            self.channel.send(TREES, tree_arrays(trees, stats.as_list(), self.service.ready_in_s))
            replied = time.monotonic()
            due = replied + self.service.ready_in_s + DUE_MARGIN_S if self.service.ready_in_s else 0.0
            self.service.draft_ahead(batch, self.pending)
            self.service.catch_up(self.pending)
            stats.hidden_s += time.monotonic() - replied
            if timeline:
                logger.debug("PROPOSE of %d, sent %.2f ms after the last reply: queued %.2f ms, replied in %.2f ms (%d drafted ahead, "
                             "%d drafted again, %d pending, %d empty); then drafted ahead for %.2f ms",
                             len(batch), 1e3 * cycle if cycle is not None else float("nan"),
                             1e3 * (started - sent_at),
                             1e3 * (replied - started), stats.predraft_hits - hits, stats.predraft_misses - misses,
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
        _Loop(DraftService(drafter, options.overlap, options.budget), channel).run()
    except PeerDeadError:
        logger.info("the coordinator is gone; exiting")
    finally:
        channel.close()


def launch_command(spec: dict, options: WorkerOptions) -> list[str]:
    return [sys.executable, "-m", "cpu_draft.worker", json.dumps({"spec": spec, "options": options.to_json()})]


if __name__ == "__main__":
    arguments = json.loads(sys.argv[1])
    worker_main(arguments["spec"], WorkerOptions.from_json(arguments["options"]))
