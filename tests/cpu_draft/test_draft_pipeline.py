"""The draft worker's pipeline: sequences decoded without trees are caught up and drafted
between messages, so the next proposal is ready; outputs stay those of plain decoding."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from cpu_draft.draft_capacity import DraftCapacity
from cpu_draft.drafter import DraftModelOptions, Drafter
from types import SimpleNamespace

from cpu_draft.messages import PROPOSE, SHUTDOWN, SYNC, TREES, ContextUpdate, read_trees, tree_arrays, update_arrays
from cpu_draft import worker as worker_module
from cpu_draft.worker import PLAIN_WINDOWS_DRAFTED, DraftService, _Loop
from hetero import LLM, SamplingParams
from tiny_models import PROMPTS

PROMPT = list(range(40, 90))


def _service(model_dir, budget: int = 4) -> DraftService:
    return DraftService(Drafter.load(str(model_dir), DraftModelOptions(dtype=torch.float32)), overlap=True, budget=budget)


def _sync(service: DraftService, seq_id: int, keep: int, tokens: list[int]) -> None:
    service.apply_updates(update_arrays([ContextUpdate(seq_id, keep, tokens)]))


def test_a_synced_sequence_is_drafted_between_messages_and_its_proposal_is_ready(tiny_llama_dir):
    service = _service(tiny_llama_dir)
    _sync(service, 1, 0, PROMPT)
    service.catch_up(lambda: None)
    assert service.predrafted[1].context == PROMPT and not service.stale
    tree = service.propose([(1, 3)])[0]
    assert service.stats.predraft_hits == 1 and service.stats.predraft_misses == 0

    fresh = Drafter.load(str(tiny_llama_dir), DraftModelOptions(dtype=torch.float32))
    fresh.set_context(1, PROMPT)
    expected = fresh.draft([(1, 3)])[0]
    assert tree.tokens.tolist() == expected.tokens.tolist() and tree.parents.tolist() == expected.parents.tolist()


def test_tokens_synced_after_the_draft_ahead_are_drafted_again(tiny_llama_dir):
    service = _service(tiny_llama_dir)
    _sync(service, 1, 0, PROMPT)
    service.catch_up(lambda: None)
    _sync(service, 1, len(PROMPT), [7, 8])  # two plain steps later
    assert service.stale == {1}
    service.catch_up(lambda: None)
    assert service.predrafted[1].context == PROMPT + [7, 8]
    service.propose([(1, 4)])
    assert service.stats.predraft_hits == 1


def test_a_waiting_message_interrupts_the_catch_up_and_it_resumes_later(tiny_llama_dir):
    service = _service(tiny_llama_dir)
    _sync(service, 1, 0, PROMPT)
    other = SimpleNamespace(kind=SYNC, arrays=update_arrays([ContextUpdate(2, 0, [5, 6])]))
    polls = iter([None, None])  # a message arrives after the first checks
    service.catch_up(lambda: next(polls, other))
    assert 1 not in service.predrafted and service.stale == {1}
    service.catch_up(lambda: None)
    assert service.predrafted[1].context == PROMPT


def test_a_catch_up_without_drafting_feeds_the_tokens_and_leaves_the_tree_for_later(tiny_llama_dir):
    service = _service(tiny_llama_dir)
    _sync(service, 1, 0, PROMPT)
    service.catch_up(lambda: None, draft=False)
    assert not service.predrafted and service.stale == {1}
    assert service.drafter.uncached(1) <= 1  # the context's KV is there, all but the root
    service.catch_up(lambda: None)
    assert service.predrafted[1].context == PROMPT and not service.stale


LONG_PROMPT = list(range(40, 140))  # 100 tokens: a catch-up that prefills one measures the prefill pace


def test_a_proposal_pending_on_prompts_estimates_when_their_trees_will_be_ready(tiny_llama_dir, monkeypatch):
    """The estimate is announced only when it spans long enough for a hold to pay (the tiny
    model prefills in milliseconds: the threshold is lowered, then raised above its estimate)."""
    monkeypatch.setattr(worker_module, "MIN_ANNOUNCED_BACKLOG_S", 0.0)
    service = _service(tiny_llama_dir)
    _sync(service, 1, 0, LONG_PROMPT)
    service.propose([(1, 4)])
    assert service.ready_in_s == 0.0  # no prefill measured yet: no estimate
    service.catch_up(lambda: None)
    assert service.prefill_pace > 0
    service.apply_updates(update_arrays([ContextUpdate(2, 0, LONG_PROMPT[::-1]), ContextUpdate(3, 0, LONG_PROMPT[1:])]))
    trees = service.propose([(2, 4), (3, 4)])
    assert [t.ready for t in trees] == [False, False]
    estimate = (100 + 99) / service.prefill_pace
    assert service.ready_in_s == pytest.approx(estimate)
    monkeypatch.setattr(worker_module, "MIN_ANNOUNCED_BACKLOG_S", 2 * estimate)
    assert not any(t.ready for t in service.propose([(2, 4), (3, 4)]))
    assert service.ready_in_s == 0.0  # a short backlog: ridden out, not announced
    service.catch_up(lambda: None)
    assert all(t.ready for t in service.propose([(2, 4), (3, 4)])) and service.ready_in_s == 0.0


def test_the_catch_up_prefills_the_prompts_a_proposal_left_pending_first(tiny_llama_dir):
    """At a large batch the worker drafts for a few sequences: their prompts come before the others'."""
    service = _service(tiny_llama_dir)
    service.apply_updates(update_arrays([ContextUpdate(1, 0, LONG_PROMPT), ContextUpdate(2, 0, LONG_PROMPT[::-1])]))
    service.propose([(2, 4)])  # sequence 1 is not asked for this step
    message = SimpleNamespace(kind=SYNC, arrays=update_arrays([]))
    polls = iter([None] * 3)  # the catch-up's first check and two forwards, then a message waits
    service.catch_up(lambda: next(polls, message))
    assert service.drafter.uncached(2) < len(LONG_PROMPT) == service.drafter.uncached(1)


class _ScriptedChannel:
    """A worker's channel that delivers a fixed list of messages and records what is sent."""

    def __init__(self, messages):
        self.messages, self.sent = list(messages), []

    def try_recv(self):
        return None

    def recv(self, spin_s=None):
        return self.messages.pop(0)

    def send(self, kind, arrays, timeout=None):
        self.sent.append(kind)


def test_the_worker_stops_drafting_ahead_of_plain_windows_once_speculation_is_off(tiny_llama_dir, monkeypatch):
    """A SYNC or two after a proposal are drafted ahead (a proposal is due); further SYNCs in a
    row are plain windows with speculation off: their tokens are fed, no trees drafted."""
    service = _service(tiny_llama_dir)
    drafted = []
    original = service.catch_up
    monkeypatch.setattr(service, "catch_up", lambda pending, draft=True: drafted.append(draft) or original(pending, draft))

    def message(kind, seq_id, keep, tokens):
        arrays = update_arrays([ContextUpdate(seq_id, keep, tokens)])
        if kind == PROPOSE:
            arrays.update(batch=np.asarray([seq_id]), max_nodes=np.asarray([4]), sent_at=np.asarray([0.0]))
        return SimpleNamespace(kind=kind, arrays=arrays, copy=lambda: None)

    windows = PLAIN_WINDOWS_DRAFTED + 2
    script = [message(SYNC, 1, 0, PROMPT)]
    script += [message(SYNC, 1, len(PROMPT) + i, [7]) for i in range(windows - 1)]
    script += [message(PROPOSE, 1, len(PROMPT) + windows - 1, [8]), message(SYNC, 1, len(PROMPT) + windows, [9]),
               SimpleNamespace(kind=SHUTDOWN, arrays={})]
    channel = _ScriptedChannel(script)
    _Loop(service, channel).run()
    assert channel.sent == [TREES]
    plain = [True] * PLAIN_WINDOWS_DRAFTED + [False] * (windows - PLAIN_WINDOWS_DRAFTED)
    assert drafted == plain + [True, True]  # after the proposal's reply, and the SYNC that follows it
    assert service.drafter.uncached(1) <= 1


def test_no_budget_means_no_drafting_ahead(tiny_llama_dir):
    service = _service(tiny_llama_dir, budget=0)
    _sync(service, 1, 0, PROMPT)
    service.catch_up(lambda: None)
    assert not service.predrafted


def test_the_engine_tells_the_worker_of_plain_steps_and_outputs_stay_plain(tiny_llama_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(device="cpu", model=str(tiny_llama_dir), dtype="float32")
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(PROMPTS, greedy, use_tqdm=False)]
    llm = LLM(device="cpu", model=str(tiny_llama_dir), dtype="float32", speculative_model=str(tiny_llama_dir),
              num_speculative_tokens=4, cpu_draft_worker=True)
    engine = llm.llm_engine
    told = []
    observe = engine.proposer.observe
    engine.observer.observe = lambda batch: (told.append(len(batch)), observe(batch))
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    finally:
        engine.proposer.close()
    assert got == expected
    assert told  # prefill and plain steps reached the worker (the controller decides between them and trees)


def test_the_coordinator_keeps_one_core_in_eight_and_pins_itself_off_the_draft(monkeypatch):
    from cpu_draft import affinity

    pinned = []
    monkeypatch.setattr(affinity.os, "sched_setaffinity", lambda pid, cpus: pinned.append(sorted(cpus)))
    threads = []
    monkeypatch.setattr(affinity.torch, "set_num_threads", threads.append)
    for usable, draft in [(range(16), list(range(2, 16))), (range(2), [1]), (range(1), [0]), (range(4, 12), list(range(5, 12))),
                          (range(64), list(range(8, 24)))]:  # at most MAX_DEFAULT_DRAFT_CORES; the coordinator the rest
        monkeypatch.setattr(affinity, "_process_cpus", None)
        monkeypatch.setattr(affinity.os, "sched_getaffinity", lambda pid, usable=usable: set(usable))
        assert affinity.default_draft_cpus() == draft
    monkeypatch.setattr(affinity, "_process_cpus", None)
    monkeypatch.setattr(affinity.os, "sched_getaffinity", lambda pid: set(range(16)))
    # Every thread of the process, those started before too (OpenMP's pool, grown while the model loaded).
    monkeypatch.setattr(affinity, "_thread_ids", lambda: [101, 102, 103])
    monkeypatch.setattr(affinity.os, "sched_setaffinity", lambda pid, cpus: pinned.append((pid, sorted(cpus))))
    assert affinity.pin_coordinator(range(2, 16)) == [0, 1] and threads == [2]
    assert pinned == [(101, [0, 1]), (102, [0, 1]), (103, [0, 1])]
    monkeypatch.setattr(affinity.os, "sched_getaffinity", lambda pid: {0, 1})  # the pinned thread's own set now
    assert affinity.default_draft_cpus() == list(range(2, 16))  # a second engine's draft is not shrunk by the pin
    assert affinity.pin_coordinator(range(16)) == [] and len(pinned) == 3  # nothing left: not pinned


def test_the_coordinator_pins_the_threads_it_started_before_pinning():
    import threading

    from cpu_draft import affinity

    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("needs two usable cores")
    started, release = threading.Event(), threading.Event()
    native_ids = []

    def idle():
        native_ids.append(threading.get_native_id())
        started.set()
        release.wait()

    thread = threading.Thread(target=idle)
    thread.start()
    started.wait()
    original = torch.get_num_threads()
    try:
        rest = affinity.pin_coordinator(usable[1:])
        assert rest == usable[:1] and os.sched_getaffinity(native_ids[0]) == set(usable[:1])
    finally:
        release.set()
        thread.join()
        for tid in affinity._thread_ids():  # the whole test process back on its cores
            os.sched_setaffinity(tid, usable)
        torch.set_num_threads(original)


def test_a_prompt_to_prefill_gets_no_tree_now_and_is_drafted_after_the_reply(tiny_llama_dir):
    service = _service(tiny_llama_dir)
    service.apply_updates(update_arrays([ContextUpdate(1, 0, PROMPT), ContextUpdate(2, 0, PROMPT[:5])]))
    trees = service.propose([(1, 4)])
    assert len(trees[0]) == 0 and not trees[0].ready  # the long prompt waits for its prefill: "not ready yet", which the engine's controller does not judge
    assert [t.ready for t in read_trees(tree_arrays(trees + [service.propose([(2, 4)])[0]], []))] == [False, True]  # the short one is drafted; so it crosses the channel
    assert service.stale == {1} and service.unserved == {1}
    service.catch_up(lambda: None)
    # the engine decodes the prompt's next token meanwhile: the tree is drafted from the draft's guess of it
    guessed = service.predrafted[1].context
    assert guessed[:-1] == PROMPT and len(guessed) == len(PROMPT) + 1
    _sync(service, 1, len(PROMPT), guessed[-1:])  # the target decoded the guessed token
    assert len(service.propose([(1, 4)])[0]) == 4 and service.stats.predraft_hits == 1


def test_prefill_in_several_forwards_leaves_the_kv_of_one_prefill(tiny_llama_dir):
    whole = Drafter.load(str(tiny_llama_dir), DraftModelOptions(dtype=torch.float32, prefill_forward_tokens=64))
    whole.set_context(1, PROMPT)
    assert whole.prefill([1])
    chunked = Drafter.load(str(tiny_llama_dir), DraftModelOptions(dtype=torch.float32, prefill_forward_tokens=7))
    chunked.set_context(1, PROMPT)
    polls = iter([False, True])
    assert not chunked.prefill([1], interrupt=lambda: next(polls, False))  # stopped after one forward of 7
    assert chunked.kv_length(1) == 7
    assert chunked.prefill([1])
    assert chunked.kv_length(1) == whole.kv_length(1) == len(PROMPT) - 1
    assert torch.allclose(chunked.kv_snapshot(1), whole.kv_snapshot(1), atol=1e-5)
    assert chunked.draft([(1, 4)])[0].tokens.tolist() == whole.draft([(1, 4)])[0].tokens.tolist()


def _propose_message(updates, batch):
    arrays = update_arrays(updates)
    arrays["batch"] = [seq_id for seq_id, _ in batch]
    return SimpleNamespace(kind=PROPOSE, arrays=arrays)


def _proposed_chain(service: DraftService) -> list[int]:
    _sync(service, 1, 0, PROMPT)
    service.catch_up(lambda: None)
    return service.propose([(1, 4)])[0].tokens.tolist()


def test_drafting_ahead_goes_on_for_a_proposal_that_asks_for_the_guessed_context(tiny_llama_dir):
    service = _service(tiny_llama_dir)
    chain = _proposed_chain(service)
    polls = []

    def pending():  # nothing waits at first; from the first depth level on, the proposal that confirms the guess
        polls.append(1)
        if len(polls) <= 2:
            return None
        guessed = service.drafter.context(1)[len(PROMPT):]
        return _propose_message([ContextUpdate(1, len(PROMPT), guessed)], [(1, 4)])

    service.draft_ahead([(1, 4)], pending)
    assert len(polls) > 3  # the message was seen while drafting ahead
    guessed = service.predrafted[1].context[len(PROMPT):]  # finished, not dropped
    assert guessed[: len(chain)] == chain and len(guessed) == len(chain) + 1  # the chain and the bonus guess
    service.apply_updates(pending().arrays)
    service.propose([(1, 4)])
    assert service.stats.predraft_hits == 2


def test_a_batchs_draft_ahead_that_a_proposal_asks_for_is_cut_at_the_level_it_reached(tiny_llama_dir):
    """Two sequences drafted ahead; the proposal confirming both guesses arrives mid-draft: the
    trees go out at the depth reached (what a smaller budget drafts from the guessed context),
    not after the rest of the levels, and they are the proposal's hits."""
    service = _service(tiny_llama_dir)
    service.apply_updates(update_arrays([ContextUpdate(1, 0, PROMPT), ContextUpdate(2, 0, PROMPT[5:])]))
    service.catch_up(lambda: None)
    service.propose([(1, 4), (2, 4)])
    polls = []

    def pending():  # nothing waits at first; then the proposal that confirms both guesses
        polls.append(1)
        if len(polls) <= 2:
            return None
        return _propose_message([ContextUpdate(s, len(service.contexts[s]), service.drafter.context(s)[len(service.contexts[s]):])
                                 for s in (1, 2)], [(1, 4), (2, 4)])

    service.draft_ahead([(1, 4), (2, 4)], pending)
    ahead = {s: service.predrafted[s] for s in (1, 2)}
    assert all(0 < len(a.tree) < 4 for a in ahead.values())  # cut, not dropped and not finished
    for seq_id, a in ahead.items():
        fresh = Drafter.load(str(tiny_llama_dir), DraftModelOptions(dtype=torch.float32))
        fresh.set_context(seq_id, a.context)
        assert a.tree.token_list == fresh.draft([(seq_id, len(a.tree))])[0].token_list
    service.apply_updates(pending().arrays)
    hits = service.stats.predraft_hits
    trees = service.propose([(1, 4), (2, 4)])
    assert service.stats.predraft_hits == hits + 2 and [len(t) for t in trees] == [len(ahead[s].tree) for s in (1, 2)]


def test_drafting_ahead_stops_for_a_proposal_of_another_context(tiny_llama_dir):
    service = _service(tiny_llama_dir)
    chain = _proposed_chain(service)
    rejected = _propose_message([ContextUpdate(1, len(PROMPT), [chain[0], (chain[1] + 1) % 320])], [(1, 4)])
    calls = iter([None, None])
    service.draft_ahead([(1, 4)], lambda: next(calls, rejected))
    assert 1 not in service.predrafted


def test_warm_up_leaves_no_sequence_behind_and_changes_no_draft(tiny_llama_dir):
    warmed = Drafter.load(str(tiny_llama_dir), DraftModelOptions(dtype=torch.float32, max_num_seqs=8))
    warmed.warm_up(4)
    assert not warmed._seqs and warmed.kv.cache.storage.numel() == 0  # its storage given back, not kept at its largest batch
    fresh = Drafter.load(str(tiny_llama_dir), DraftModelOptions(dtype=torch.float32, max_num_seqs=8))
    for drafter in (warmed, fresh):
        drafter.set_context(1, PROMPT)
    ours, theirs = warmed.draft([(1, 4)])[0], fresh.draft([(1, 4)])[0]
    assert ours.token_list == theirs.token_list and ours.parent_list == theirs.parent_list


def _two_sequences_one_rejected(service: DraftService) -> tuple[list[int], list[int]]:
    """Sequences 1 and 2 drafted and drafted ahead; then sequence 1's chain is accepted with the
    guessed bonus (a hit) and sequence 2's first node rejected (a miss). Their new contexts."""
    service.apply_updates(update_arrays([ContextUpdate(1, 0, PROMPT), ContextUpdate(2, 0, PROMPT[5:])]))
    service.catch_up(lambda: None)
    assert all(len(tree) == 4 for tree in service.propose([(1, 4), (2, 4)]))
    chains = {s: list(service.drafter.last_chain(s)) for s in (1, 2)}
    service.draft_ahead([(1, 4), (2, 4)], lambda: None)
    guessed = service.predrafted[1].context[len(PROMPT):]
    rejected = [(chains[2][0] + 1) % 320]
    service.apply_updates(update_arrays([ContextUpdate(1, len(PROMPT), guessed), ContextUpdate(2, len(PROMPT) - 5, rejected)]))
    return PROMPT + guessed, PROMPT[5:] + rejected


def test_a_miss_beside_hits_gets_no_tree_now_and_is_drafted_ahead_from_the_guess_of_its_next_token(tiny_llama_dir):
    service = _service(tiny_llama_dir)
    first, second = _two_sequences_one_rejected(service)
    service.capacity = DraftCapacity()  # measured (not on this machine's clock): a step of 7 ms, 1 ms per depth level
    service.capacity.observe_cycle(0.007)
    service.capacity.observe_levels(0.004, 4, 1)
    trees = service.propose([(1, 4), (2, 4)])
    assert len(trees[0]) == 4 and len(trees[1]) == 0 and trees[1].ready  # the hit goes out; the miss does not hold the step up
    assert service.stats.predraft_hits == 3 and service.stats.predraft_misses == 1  # the first proposal: two hits
    service.draft_ahead([(1, 4), (2, 4)], lambda: None)
    ahead = service.predrafted[2]
    assert ahead.context[:-1] == second and not service.unserved and not service.stale  # drafted from its context + one guessed token

    fresh = Drafter.load(str(tiny_llama_dir), DraftModelOptions(dtype=torch.float32))
    fresh.set_context(2, second)
    assert fresh.prefill([2])
    guess = fresh.assume_accepted([2])
    assert guess == [2] and fresh.context(2) == ahead.context
    expected = fresh.draft([(2, 4)])[0]
    assert ahead.tree.token_list == expected.token_list  # the tree a fresh drafter makes from that context

    service.apply_updates(update_arrays([ContextUpdate(2, len(second), ahead.context[len(second):])]))  # the guess held
    assert len(service.propose([(2, 4)])[0]) == 4 and service.stats.predraft_hits == 4


def test_a_miss_at_batch_1_is_drafted_before_the_reply(tiny_llama_dir):
    service = _service(tiny_llama_dir)
    _, second = _two_sequences_one_rejected(service)
    trees = service.propose([(2, 4)])  # batch 1: waiting for its draft beats a step without a tree
    assert len(trees[0]) == 4 and service.stats.predraft_misses == 1
    assert service.drafter.context(2) == second and not service.unserved


def test_sequences_back_from_plain_steps_before_their_catch_up_are_pending_not_empty(tiny_llama_dir):
    """A proposal right after a plain window that cut the catch-up short: its trees are not
    ready (the engine does not judge speculation by that step), and they are drafted after the reply."""
    service = _service(tiny_llama_dir)
    service.apply_updates(update_arrays([ContextUpdate(1, 0, PROMPT), ContextUpdate(2, 0, PROMPT[5:])]))
    service.catch_up(lambda: None)
    service.propose([(1, 4), (2, 4)])
    service.draft_ahead([(1, 4), (2, 4)], lambda: None)
    accepted = {s: service.predrafted[s].context for s in (1, 2)}  # both chains accepted, with the guessed bonus
    plain_tokens = [3, 4, 5]
    service.apply_updates(update_arrays([ContextUpdate(s, len(service.contexts[s]), accepted[s][len(service.contexts[s]):] + plain_tokens)
                                         for s in (1, 2)]), plain=True)
    service.capacity = DraftCapacity()  # measured (not on this clock): both fit a step of 7 ms, but waiting for their trees does not pay
    service.capacity.observe_cycle(0.007)
    service.capacity.observe_levels(0.0036, 4, 1)
    for seq_id in (1, 2):
        service.capacity.observe_accepted(seq_id, 1, 4)
    waiting = SimpleNamespace(kind=PROPOSE, arrays=update_arrays([]))
    service.catch_up(lambda: waiting)  # the proposal is already waiting: no catch-up
    trees = service.propose([(1, 4), (2, 4)])
    assert [(len(t), t.ready) for t in trees] == [(0, False), (0, False)]
    service.draft_ahead([(1, 4), (2, 4)], lambda: None)  # after the reply, as the worker's loop does
    service.catch_up(lambda: None)
    assert all(service.predrafted[s].context[:-1] == accepted[s] + plain_tokens for s in (1, 2))

    service.apply_updates(update_arrays([ContextUpdate(1, len(accepted[1]) + 3, [9])]))  # the guess missed
    assert service.propose([(1, 4), (2, 4)])[0].ready  # only the first proposal after plain steps waits for the catch-up


class _LazyChannel(_ScriptedChannel):
    """A scripted channel whose messages are made when received (from the worker's state then)."""

    def recv(self, spin_s=None):
        return self.messages.pop(0)()


def test_a_proposal_after_steps_without_trees_does_not_count_as_a_verification_step(tiny_llama_dir, monkeypatch):
    """Under async scheduling a probe that follows a plain window carries the window's tokens
    itself (no SYNC came between): the time since the last reply holds the window, not one
    verification step, and must not enter the step that the depth plan fits drafts into."""
    service = _service(tiny_llama_dir)
    cycles = []
    monkeypatch.setattr(service.capacity, "observe_cycle", cycles.append)

    def message(kind, tokens_after_chain=None):
        def make():
            told = len(service.contexts.get(1, []))
            if tokens_after_chain is None:
                update = ContextUpdate(1, told, [] if told else PROMPT)
            else:
                start, chain = service.offered.get(1, (told, []))
                update = ContextUpdate(1, start, list(chain) + [5] + tokens_after_chain)  # the chain held, then the bonus token
            arrays = update_arrays([update])
            if kind == PROPOSE:
                arrays.update(batch=np.asarray([1]), max_nodes=np.asarray([4]), sent_at=np.asarray([time.monotonic()]))
            return SimpleNamespace(kind=kind, arrays=arrays, copy=lambda: None)
        return make

    script = [message(SYNC), message(PROPOSE), message(PROPOSE, []), message(PROPOSE, list(range(20, 28))),
              lambda: SimpleNamespace(kind=SHUTDOWN, arrays={})]
    _Loop(service, _LazyChannel(script)).run()
    assert len(cycles) == 1  # the proposal after one verified step; not the first (no reply before it) nor the one after the window
