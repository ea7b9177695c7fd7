"""Runner-up guesses of the draft worker (`cpu_draft.runner_up`): where cores are spare, the
likeliest other outcomes of a step are drafted ahead beside full acceptance, in forks of the
sequence whose KV takes the shared prefix's K/V by copy; a reply that matches one is served from it."""
from __future__ import annotations

import pytest
import torch

from cpu_draft.draft_capacity import DraftCapacity
from cpu_draft.drafter import DraftModelOptions, Drafter
from cpu_draft.messages import ContextUpdate, update_arrays
from cpu_draft.worker import DraftService

PROMPT = list(range(40, 90))
BUDGET = 4  # nodes per tree: chains of 4 (tree_width 1)


class _MeasuredCapacity(DraftCapacity):
    """A step of 20 ms and 1 ms per depth level at one row, whatever this machine measures:
    room for many rows (the cost model: 20 / (5 levels x 1/6 ms a row) - 5 = 19)."""

    def __init__(self):
        super().__init__()
        super().observe_cycle(0.020)
        super().observe_levels(0.001, 1, 1)

    def observe_cycle(self, seconds: float) -> None:
        pass

    def observe_levels(self, seconds: float, levels: int, rows: int) -> None:
        pass


def _drafter(model_dir, **options) -> Drafter:
    return Drafter.load(str(model_dir), DraftModelOptions(dtype=torch.float32, **options))


def _fresh_tree(drafter: Drafter, context: list[int], max_nodes: int) -> list[int]:
    """The tree ``drafter`` drafts from ``context`` with nothing cached."""
    drafter.release("fresh")
    drafter.set_context("fresh", context)
    return drafter.draft([("fresh", max_nodes)])[0].token_list


def _scripted_run(model_dir, runner_ups: int, pattern: list, steps: int = 16):
    """Decode one sequence through the worker's service, the target's verdict scripted per step:
    "full": the chain accepted and the draft's own bonus; "bonus": the chain accepted and the
    draft's second choice as the bonus; j: the chain rejected at depth j, the target taking the
    draft's second choice there. Every tree served is checked against a fresh draft of its context.
    Returns the service's stats."""
    service = DraftService(_drafter(model_dir), overlap=True, budget=BUDGET, runner_ups=runner_ups)
    service.capacity = _MeasuredCapacity()
    ranks = _drafter(model_dir, tree_width=2)  # a level of 2 nodes: the draft's first and second choices there
    fresh = _drafter(model_dir)
    service.apply_updates(update_arrays([ContextUpdate(1, 0, PROMPT)]))
    service.catch_up(lambda: None)
    context = list(PROMPT)
    for step in range(steps):
        tree = service.propose([(1, BUDGET)])[0]
        assert tree.token_list == _fresh_tree(fresh, context, BUDGET)  # no KV left corrupt by forks, copies or swaps
        chain = tree.token_list
        service.draft_ahead([(1, BUDGET)], lambda: None)
        outcome = pattern[step % len(pattern)]
        if outcome in ("full", "bonus"):
            first, second = _fresh_tree(ranks, context + chain, 2)
            new = chain + [first if outcome == "full" else second]
        else:
            first, second = _fresh_tree(ranks, context + chain[:outcome], 2)
            assert first == chain[outcome]
            new = chain[:outcome] + [second]
        service.apply_updates(update_arrays([ContextUpdate(1, len(context), new)]))
        context += new
    service.propose([(1, BUDGET)])
    return service.stats


PATTERN = ["full", 0, "full", 1, "bonus", 2, "full", 3]


def test_runner_up_guesses_serve_the_steps_the_main_guess_misses(tiny_llama_dir):
    alone = _scripted_run(tiny_llama_dir, runner_ups=0, pattern=PATTERN)
    assert alone.runner_up_guesses == 0
    assert (alone.predraft_hits, alone.predraft_misses) == (1 + 6, 10)  # the prompt's tree, then the steps after "full"
    both = _scripted_run(tiny_llama_dir, runner_ups=5, pattern=PATTERN)
    assert (both.predraft_hits, both.predraft_misses) == (1 + 16, 0)  # every step drafted ahead
    assert both.rejected_guess_hits == 8 and both.bonus_guess_hits == 2
    assert both.runner_up_guesses == 16 * 5


def test_runner_up_guesses_need_spare_cores(tiny_llama_dir):
    service = DraftService(_drafter(tiny_llama_dir), overlap=True, budget=BUDGET, runner_ups=5)  # unmeasured: no spare rows known
    service.apply_updates(update_arrays([ContextUpdate(1, 0, PROMPT)]))
    service.catch_up(lambda: None)
    service.propose([(1, BUDGET)])
    service.draft_ahead([(1, BUDGET)], lambda: None)
    assert service.stats.runner_up_guesses == 0 and not service.runner_up[1]
    service.capacity = _MeasuredCapacity()
    service.capacity.cycle_s = 0.007  # 7 / (5 x 1/6) - 5 = 3 rows fit: the main guess and 2 runner-ups
    service.propose([(1, BUDGET)])
    service.draft_ahead([(1, BUDGET)], lambda: None)
    guesses = service.drafter.runner_up_guesses(1)
    likeliest = sorted(guesses, key=lambda g: -g[2])[:2]
    assert [g.context for g in service.runner_up[1]] == [g[1] for g in likeliest]


def test_spare_rows_are_what_the_step_holds_beside_the_main_guesses():
    capacity = DraftCapacity(row_overhead=5.0)
    assert capacity.spare_rows(1, depth=4) == 0  # unmeasured
    capacity.observe_cycle(0.007)
    capacity.observe_levels(0.001, levels=1, rows=1)
    assert capacity.spare_rows(1, depth=4) == 2  # 7 / (5 x 1/6) - 5 = 3 rows in all
    assert capacity.spare_rows(8, depth=4) == 0


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_a_fork_holds_the_kv_a_fresh_sequence_computes(tiny_llama_dir, layout):
    drafter = _drafter(tiny_llama_dir, kv_layout=layout)
    drafter.set_context(1, PROMPT)
    chain = drafter.draft([(1, BUDGET)])[0].token_list
    assert drafter.assume_accepted([1]) == [1]
    fresh = _drafter(tiny_llama_dir, kv_layout=layout)
    # The same fork three times: all of its context but the root copied, then only the tokens
    # its KV lacks, then the prefix it shares with the source (the rest is the draft's to feed).
    for context, copied in ((PROMPT + chain[:2] + [7], len(PROMPT) + 2), (PROMPT + chain + [9], len(PROMPT) + 4), (PROMPT[:30] + [5, 6], 30)):
        assert drafter.fork(1, "fork", context)
        assert drafter.kv_length("fork") == copied
        tree = drafter.draft([("fork", BUDGET)])[0].token_list
        fresh.release(2)
        fresh.set_context(2, context)
        assert tree == fresh.draft([(2, BUDGET)])[0].token_list
        cached = drafter.kv_length("fork")
        torch.testing.assert_close(drafter.kv_snapshot("fork"), fresh.kv_snapshot(2)[:, :, :cached], rtol=1e-5, atol=1e-5)
    assert drafter.context(1) == PROMPT + chain + drafter.context(1)[-1:]  # the source untouched


def test_adopting_a_fork_swaps_the_sequences(tiny_llama_dir):
    drafter = _drafter(tiny_llama_dir)
    drafter.set_context(1, PROMPT)
    drafter.draft([(1, BUDGET)])
    assert drafter.fork(1, "fork", PROMPT + [3])
    drafter.draft([("fork", BUDGET)])
    fork_chain = drafter.last_chain("fork")
    drafter.adopt(1, "fork")
    assert drafter.context(1) == PROMPT + [3] and drafter.last_chain(1) == fork_chain
    assert drafter.context("fork") == PROMPT
