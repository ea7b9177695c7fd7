"""Batch scaling of the CPU draft: as many sequences as the cores can draft within a step,
those accepted most first; the rest get no tree."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from cpu_draft.draft_capacity import DraftCapacity
from cpu_draft.drafter import DraftModelOptions, Drafter
from cpu_draft.messages import SYNC, ContextUpdate, update_arrays
from cpu_draft.worker import DraftService


def test_everything_is_drafted_until_measured():
    assert DraftCapacity().capacity(64, depth=4) == 64


def test_capacity_is_what_fits_the_step_in_the_cost_model():
    capacity = DraftCapacity(row_overhead=5.0)
    capacity.observe_cycle(0.010)  # a 10 ms verification step
    capacity.observe_levels(5 * 0.0026, levels=5, rows=8)  # 2.6 ms a level at 8 rows: 0.2 ms a row of 5 + 8
    # (4 + 1) levels x 0.2 ms x (5 + m) <= 10 ms  ->  m <= 5
    assert capacity.capacity(32, depth=4) == 5
    assert capacity.capacity(3, depth=4) == 3
    assert capacity.capacity(32, depth=60) == 1  # never below one


def test_the_level_time_follows_the_rows_it_was_measured_at():
    capacity = DraftCapacity(row_overhead=5.0, smoothing=0.5)
    capacity.observe_levels(0.0026, levels=1, rows=8)
    capacity.observe_levels(0.0012, levels=1, rows=1)  # the old 2.6 ms at 8 rows is 1.2 ms at 1 row: the mean stays
    assert abs(capacity.level_s - 0.0012) < 1e-12 and capacity.level_rows == 1


def test_the_sequences_accepted_most_are_chosen_and_the_others_regain_ground():
    capacity = DraftCapacity(aging=0.25)
    capacity.observe_cycle(0.010)
    capacity.observe_levels(0.0026, levels=1, rows=8)
    for seq_id, accepted in enumerate([4, 0, 2, 3, 3, 1, 1]):  # of chains of 4 tokens
        capacity.observe_accepted(seq_id, accepted, 4)
    capacity.observe_accepted(4, 4, 4)  # then all 4: 3.3 accepted and 0.7 cut short per chain, a rate of 0.825
    chosen, depth = capacity.plan(range(8), depth=4)  # 7 is new: tried first
    assert (chosen, depth) == ({7, 0, 4, 3, 2}, 4)
    assert capacity.acceptance_rate(0) == 1.0 and capacity.acceptance_rate(2) == 2 / 3
    assert capacity.rejected[1] == 0.75 and capacity.acceptance_rate(1) == 0.0  # regained a quarter of its rejections


def test_acceptance_rate_is_the_geometric_runs_maximum_likelihood():
    capacity = DraftCapacity(smoothing=0.5)
    capacity.observe_accepted(1, 2, 4)  # 2 accepted, then a rejection
    capacity.observe_accepted(1, 4, 4)  # all 4 accepted: no rejection seen
    assert capacity.acceptance_rate(1) == 3.0 / (3.0 + 0.5)
    assert capacity.expected_tokens(1, 0) == 1.0
    rate = capacity.acceptance_rate(1)
    assert abs(capacity.expected_tokens(1, 3) - (1 + rate + rate ** 2 + rate ** 3)) < 1e-12
    assert capacity.expected_tokens(2, 3) == 4.0  # unmeasured: every token accepted


def test_shallower_trees_for_every_sequence_beat_deep_trees_for_a_few():
    """A 10 ms step and 0.2 ms a row: depth 4 (5 levels) fits 5 of 8 sequences, depth 2 (3
    levels) all 8. At an acceptance rate of 0.9: 5 x 4.10 + 3 = 23.5 tokens against 8 x 2.71 = 21.7,
    and depth 3 fits 7: 7 x 3.44 + 1 = 25.1, the most."""
    capacity = DraftCapacity(row_overhead=5.0)
    capacity.observe_cycle(0.010)
    capacity.observe_levels(0.0026, levels=1, rows=8)
    for seq_id in range(8):
        for _ in range(10):
            capacity.observe_accepted(seq_id, 9, 10)  # 9 accepted per rejection
    assert [capacity.capacity(8, d) for d in (4, 3, 2)] == [5, 7, 8]
    chosen, depth = capacity.plan(range(8), depth=4)
    assert depth == 3 and len(chosen) == 7
    few = DraftCapacity(row_overhead=5.0)  # the same step and costs, two sequences: all fit at full depth
    few.observe_cycle(0.010)
    few.observe_levels(0.0026, levels=1, rows=8)
    assert few.plan([0, 1], depth=4) == ({0, 1}, 4)


def test_a_worker_short_of_cores_drafts_for_the_best_sequences_only(tiny_llama_dir):
    service = DraftService(Drafter.load(str(tiny_llama_dir), DraftModelOptions(dtype=torch.float32)), overlap=True, budget=4)
    prompts = {seq_id: list(range(10 + seq_id, 20 + seq_id)) for seq_id in range(4)}
    service.apply_updates(update_arrays([ContextUpdate(s, 0, p) for s, p in prompts.items()]))
    service.catch_up(lambda: None)  # the prompts' first trees, drafted between messages
    trees = service.propose([(s, 4) for s in prompts])
    assert all(len(t) == 4 for t in trees)  # unmeasured: every sequence
    service.capacity.observe_cycle(0.010)
    service.capacity.observe_levels(0.010, levels=1, rows=1)  # far too slow: not even one tree fits the step
    accepted = {0: [], 1: trees[1].tokens.tolist()[:2], 2: [], 3: []}  # only sequence 1's drafts held
    service.apply_updates(update_arrays([ContextUpdate(s, len(p), accepted[s] + [7]) for s, p in prompts.items()]))
    assert service.capacity.acceptance_rate(1) == 2 / 3 and service.capacity.acceptance_rate(0) == 0.0
    trees = service.propose([(s, 4) for s in prompts])
    # Only sequence 1 is drafted for; its tree, too slow to wait for, follows the reply.
    assert [len(t) for t in trees] == [0, 0, 0, 0] and all(t.ready for t in trees)
    before = service.stats.ahead_levels
    service.draft_ahead([(s, 4) for s in prompts], lambda: None)
    # The best sequence only, one level deep: a deeper tree would hold the batch up for levels past the step.
    assert set(service.predrafted) == {1} and len(service.predrafted[1].tree) == 1
    assert service.stats.ahead_levels - before == 2 and service.stats.ahead_s > 0  # the guess's forward and the level's


def test_a_batch_waits_for_missed_trees_only_where_they_are_worth_the_wait():
    capacity = DraftCapacity()
    assert capacity.draft_now_pays([1], 1, depth=4)  # unmeasured: at batch 1 draft them, as before any measurement
    assert not capacity.draft_now_pays(list(range(8)), 8, depth=4)  # and in a batch, a wait of unknown length does not
    capacity.observe_cycle(0.007)  # a 7 ms verification step
    capacity.observe_levels(0.004, levels=4, rows=1)  # 1 ms per depth level at one row
    assert capacity.draft_now_pays([1], 1, depth=4)  # batch 1: 4 ms of drafting buys ~4 tokens in a 7 ms step
    assert not capacity.draft_now_pays([1], 8, depth=4)  # one miss among 8: the other 7 would wait for it
    assert not capacity.draft_now_pays(list(range(32)), 32, depth=4)  # 32 rows take far longer than the step
    capacity.observe_accepted(1, 0, 4)
    assert not capacity.draft_now_pays([1], 1, depth=4)  # drafts that are never accepted are not worth waiting for
    assert not capacity.draft_now_pays([], 1, depth=4)


def test_a_worker_short_of_cores_drafts_shallower_trees_for_more_sequences(tiny_llama_dir):
    service = DraftService(Drafter.load(str(tiny_llama_dir), DraftModelOptions(dtype=torch.float32)), overlap=True, budget=4)
    prompts = {seq_id: list(range(10 + seq_id, 20 + seq_id)) for seq_id in range(4)}
    service.apply_updates(update_arrays([ContextUpdate(s, 0, p) for s, p in prompts.items()]))
    service.catch_up(lambda: None)
    assert all(len(t) == 4 for t in service.propose([(s, 4) for s in prompts]))  # unmeasured: every sequence, full depth
    service.draft_ahead([(s, 4) for s in prompts], lambda: None)
    guessed = {s: service.predrafted[s].context[len(p):] for s, p in prompts.items()}
    assert all(len(service.predrafted[s].tree) == 4 for s in prompts)
    # Measured (not on this machine's clock): a 30 ms step and 1 ms a row: depth 4 fits one
    # sequence (5 tokens + 3), depth 3 two (8 + 2), depth 2 all four (12).
    service.capacity = DraftCapacity()
    service.capacity.observe_cycle(0.030)
    service.capacity.observe_levels(0.006, levels=1, rows=1)
    service.apply_updates(update_arrays([ContextUpdate(s, len(p), guessed[s]) for s, p in prompts.items()]))  # all held
    assert all(service.capacity.acceptance_rate(s) == 1.0 for s in prompts)
    trees = service.propose([(s, 4) for s in prompts])
    assert service.depth == 2 and [len(t) for t in trees] == [2, 2, 2, 2]  # the full trees drafted ahead, shrunk
    assert service.stats.predraft_hits == 8 and service.stats.predraft_misses == 0
    service.draft_ahead([(s, 4) for s in prompts], lambda: None)
    assert all(len(service.predrafted[s].tree) == 2 for s in prompts)  # drafted ahead to the planned depth


def test_a_draft_ahead_cut_off_by_the_next_message_still_measures_its_levels(tiny_llama_dir):
    """The plan must learn from the drafts that overran the step, not only from those that finished."""
    service = DraftService(Drafter.load(str(tiny_llama_dir), DraftModelOptions(dtype=torch.float32)), overlap=True, budget=4)
    prompts = {seq_id: list(range(10 + seq_id, 20 + seq_id)) for seq_id in range(2)}
    service.apply_updates(update_arrays([ContextUpdate(s, 0, p) for s, p in prompts.items()]))
    service.catch_up(lambda: None)
    service.propose([(s, 4) for s in prompts])
    service.capacity = DraftCapacity()
    other = SimpleNamespace(kind=SYNC, arrays=update_arrays([ContextUpdate(5, 0, [1, 2])]))
    polls = iter([None, None])  # the checks before drafting; at the first level's end a message for another sequence waits
    service.draft_ahead([(s, 4) for s in prompts], lambda: next(polls, other))
    assert not service.predrafted  # cut off
    assert service.capacity.level_s is not None and service.capacity.level_rows == 2
    assert service.stats.ahead_levels >= 1 and service.stats.ahead_s > 0  # counted as the plan counts them



def _batch_of_one(level_s: float, accepted: int, drafted: int) -> DraftCapacity:
    capacity = DraftCapacity(row_overhead=5.0)
    capacity.observe_cycle(0.0055)  # a 5.5 ms verification step
    capacity.observe_levels(level_s, levels=1, rows=1)
    for _ in range(10):
        capacity.observe_accepted(0, accepted, drafted)
    return capacity


def test_a_batch_of_one_drafts_as_deep_as_its_draft_ahead_fits_the_step():
    """0.6 ms a level in a 5.5 ms step: 8 levels and the bonus guess take 5.4 ms; a budget of
    16 would make the engine wait 4.8 ms a step for the other 8. The draft's acceptance does
    not move it (the engine's tree sizing grants fewer nodes where they do not pay)."""
    assert _batch_of_one(0.0006, 9, 10).plan([0], depth=16) == ({0}, 8)
    assert _batch_of_one(0.0006, 1, 2).plan([0], depth=16) == ({0}, 8)
    assert _batch_of_one(0.0006, 9, 10).plan([0], depth=4) == ({0}, 4)  # the whole budget fits
    assert _batch_of_one(0.0015, 9, 10).plan([0], depth=16) == ({0}, 2)  # 3 levels of 1.5 ms fit, not 4
    assert _batch_of_one(0.006, 9, 10).plan([0], depth=16) == ({0}, 1)  # nothing fits: one level
    assert DraftCapacity().plan([0], depth=16) == ({0}, 16)  # unmeasured: the whole budget


def test_a_small_batch_does_not_trade_its_trees_for_one_that_overruns_the_step():
    """Two sequences accepted at 0.97, a 5.5 ms step, 0.1 ms a row (0.6 ms a level at one row):
    one 16-deep tree (14.5 tokens with the other's one) would overrun the step by 4.7 ms, and a
    single sequence's draft-ahead is finished, not cut, so both would wait for it. Depth 6 fits
    both: 2 x 6.6 tokens."""
    capacity = DraftCapacity(row_overhead=5.0)
    capacity.observe_cycle(0.0055)
    capacity.observe_levels(0.0006, levels=1, rows=1)
    for seq_id in (0, 1):
        for _ in range(10):
            capacity.observe_accepted(seq_id, 97, 100)
    assert capacity.plan([0, 1], depth=16) == ({0, 1}, 6)


def test_a_worker_drafting_for_one_sequence_cuts_a_large_budget_to_what_hides_behind_the_step(tiny_llama_dir):
    """The engine's default budget is 16 nodes; with a 5.5 ms step and 1 ms a level, a batch of
    one gets trees of 4 (4 levels and the bonus guess take 5 ms), drafted ahead to that depth."""
    service = DraftService(Drafter.load(str(tiny_llama_dir), DraftModelOptions(dtype=torch.float32)), overlap=True, budget=16)
    prompt = list(range(10, 20))
    service.apply_updates(update_arrays([ContextUpdate(0, 0, prompt)]))
    service.catch_up(lambda: None)
    assert [len(t) for t in service.propose([(0, 16)])] == [16]  # unmeasured: the whole budget
    service.capacity = DraftCapacity()
    service.capacity.observe_cycle(0.0055)
    service.capacity.observe_levels(0.001, levels=1, rows=1)
    trees = service.propose([(0, 16)])  # drafted now (4 levels are worth the wait at batch 1)
    assert service.depth == 4 and [len(t) for t in trees] == [4]
    service.draft_ahead([(0, 16)], lambda: None)
    assert len(service.predrafted[0].tree) == 4
