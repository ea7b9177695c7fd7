"""Runner-up guesses of the draft worker (`cpu_draft.runner_up`): where cores are spare, the
likeliest other outcomes of a step are drafted ahead beside full acceptance, in forks of the
sequence whose KV takes the shared prefix's K/V by copy; a reply that matches one is served from it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cpu_draft.draft_capacity import DraftCapacity
from cpu_draft.draft_tree import RunnerUp, TreeBuilder, runner_ups
from cpu_draft.drafter import DraftModelOptions, Drafter
from cpu_draft.messages import PROPOSE, ContextUpdate, update_arrays
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


def _scripted_run(model_dir, runner_ups: int, pattern: list, width: int = 1, steps: int = 16):
    """Decode one sequence through the worker's service (trees of ``width`` nodes a level), the
    target's verdict scripted per step: "full": the chain accepted and the draft's own bonus;
    "bonus": the chain accepted and the draft's second choice as the bonus; j: the tree rejected
    at depth j, the target taking there the draft's best token outside the tree. Every tree
    served is checked against a fresh draft of its context. Returns the service's stats."""
    service = DraftService(_drafter(model_dir, tree_width=width), overlap=True, budget=BUDGET, runner_ups=runner_ups)
    service.capacity = _MeasuredCapacity()
    ranks = _drafter(model_dir, tree_width=width + 1)  # a level of width + 1 nodes: the draft's choices there, best first
    fresh = _drafter(model_dir, tree_width=width)
    service.apply_updates(update_arrays([ContextUpdate(1, 0, PROMPT)]))
    service.catch_up(lambda: None)
    context = list(PROMPT)
    for step in range(steps):
        tree = service.propose([(1, BUDGET)])[0]
        assert tree.token_list == _fresh_tree(fresh, context, BUDGET)  # no KV left corrupt by forks, copies or swaps
        chain = list(service.drafter.last_chain(1))
        service.draft_ahead([(1, BUDGET)], lambda: None)
        outcome = pattern[step % len(pattern)]
        if outcome in ("full", "bonus"):
            ranked = _fresh_tree(ranks, context + chain, width + 1)
            new = chain + [ranked[0] if outcome == "full" else ranked[1]]
        else:
            ranked = _fresh_tree(ranks, context + chain[:outcome], width + 1)
            assert ranked[0] == chain[outcome]
            new = chain[:outcome] + [ranked[width]]
        service.apply_updates(update_arrays([ContextUpdate(1, len(context), new)]))
        context += new
    service.propose([(1, BUDGET)])
    return service.stats


@pytest.mark.parametrize("width, pattern", [(1, ["full", 0, "full", 1, "bonus", 2, "full", 3]),
                                            (2, ["full", 0, "full", 1, "bonus", 0, "full", 1])])
def test_runner_up_guesses_serve_the_steps_the_main_guess_misses(tiny_llama_dir, width, pattern):
    alone = _scripted_run(tiny_llama_dir, runner_ups=0, pattern=pattern, width=width)
    assert alone.runner_up_guesses == 0
    assert (alone.predraft_hits, alone.predraft_misses) == (1 + 6, 10)  # the prompt's tree, then the steps after "full"
    both = _scripted_run(tiny_llama_dir, runner_ups=5, pattern=pattern, width=width)
    assert (both.predraft_hits, both.predraft_misses) == (1 + 16, 0)  # every step drafted ahead
    assert both.rejected_guess_hits == 8 and both.bonus_guess_hits == 2
    depth = BUDGET // width
    assert both.runner_up_guesses == 16 * (depth + 1)  # a guess per level, and the bonus


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
    guessed = service.drafter.context(1)
    likeliest = sorted(service.drafter.runner_up_guesses(1), key=lambda g: -g.prob)[:2]
    assert len(service.drafter.runner_up_guesses(1)) == 5  # one per level of the chain, and the bonus
    assert [g.context for g in service.runner_up[1]] == [guessed[: g.prefix] + [g.token] for g in likeliest]


def _propose_message(updates, batch):
    arrays = update_arrays(updates)
    arrays["batch"] = [seq_id for seq_id, _ in batch]
    return SimpleNamespace(kind=PROPOSE, arrays=arrays)


@pytest.mark.parametrize("reply", ["a runner-up", "another"])
def test_drafting_ahead_goes_on_only_for_a_proposal_that_asks_for_a_guess(tiny_llama_dir, reply):
    service = DraftService(_drafter(tiny_llama_dir), overlap=True, budget=BUDGET, runner_ups=5)
    service.capacity = _MeasuredCapacity()
    service.apply_updates(update_arrays([ContextUpdate(1, 0, PROMPT)]))
    service.catch_up(lambda: None)
    chain = service.propose([(1, BUDGET)])[0].token_list
    polls = []

    def pending():  # nothing waits at first; from the first depth level on, the proposal of the step's real outcome
        polls.append(1)
        if len(polls) <= 2:
            return None
        rejected = min(service.drafter.runner_up_guesses(1), key=lambda g: g.prefix)  # the first node rejected
        token = rejected.token if reply == "a runner-up" else next(t for t in range(320) if t not in (rejected.token, chain[0]))
        return _propose_message([ContextUpdate(1, len(PROMPT), [token])], [(1, BUDGET)])

    rows = []  # per forward: (rows, whether the message was waiting)
    forward = service.drafter.kv.forward
    service.drafter.kv.forward = lambda handles, *args: (rows.append((len(handles), len(polls) >= 3)), forward(handles, *args))[1]
    service.draft_ahead([(1, BUDGET)], pending)
    assert len(polls) >= 3  # the message was seen while drafting ahead
    if reply == "another":  # stopped: nothing drafted ahead is kept
        assert 1 not in service.predrafted and not service.runner_up.get(1) and service.stats.runner_up_guesses == 0
        return
    # Finished for the guess asked for only, the others dropped: they would delay the reply.
    assert rows[1][0] == 6 and {n for n, waiting in rows if waiting} == {1}
    assert 1 not in service.predrafted and [g.kind for g in service.runner_up[1]] == ["rejected"]
    service.apply_updates(pending().arrays)  # and served
    tree = service.propose([(1, BUDGET)])[0]
    assert service.stats.rejected_guess_hits == 1 and service.stats.predraft_hits == 2
    assert tree.token_list == _fresh_tree(_drafter(tiny_llama_dir), service.contexts[1], BUDGET)


def test_a_level_with_siblings_is_rejected_with_the_best_token_outside_it():
    builder = TreeBuilder([2, 1])  # chain node and a sibling, then a chain node
    builder.add_level([10, 11, 12], [0.5, 0.3, 0.1])
    builder.add_level([20, 21], [0.8, 0.1])
    assert builder.tree().token_list == [10, 11, 20]
    outcomes = runner_ups(7, builder.levels, builder.runner_ups, builder.path_probs, [(30, 0.25)])
    expected = [RunnerUp("rejected", 0.1, 7, 12), RunnerUp("rejected", 0.5 * 0.1, 8, 21), RunnerUp("bonus", 0.5 * 0.8 * 0.25, 9, 30)]
    assert [(o.kind, o.prefix, o.token) for o in outcomes] == [(e.kind, e.prefix, e.token) for e in expected]
    assert [o.prob for o in outcomes] == pytest.approx([e.prob for e in expected])


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


# ------------------------------------------------------------- through the engine
GREEDY_TOKENS = 48
ENGINE_PROMPTS = ["The capital of France is", "Hello, my name is", "def add(a, b):", "Speculative decoding drafts tokens on the CPU and"]


@pytest.fixture(scope="module")
def near_draft_dir(tiny_llama_dir, tmp_path_factory):
    """The target with noise on its weights: agrees with it often, and where not, often on its second choice."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * NEAR_DRAFT_NOISE * parameter.std())
    path = tmp_path_factory.mktemp("near-draft")
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(path)
    return path


NEAR_DRAFT_NOISE = 0.3


def _generate(model_dir, draft_dir, runner_ups: int, monkeypatch) -> tuple[list[list[int]], dict]:
    from hetero import LLM, SamplingParams

    monkeypatch.setenv("HETERO_DRAFT_RUNNER_UPS", str(runner_ups))
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    kwargs = dict(device="cpu", model=str(model_dir), dtype="float32")
    if draft_dir is not None:
        kwargs.update(speculative_model=str(draft_dir), num_speculative_tokens=BUDGET, cpu_draft_worker=True,
                      speculative_config={"dtype": "float32"})
    llm = LLM(**kwargs)
    if draft_dir is not None:
        llm.llm_engine.spec_control.always_speculate = True  # the tiny draft may measure slower than plain decoding
    try:
        outputs = [list(o.outputs[0].token_ids) for p in ENGINE_PROMPTS for o in llm.generate(p, greedy, use_tqdm=False)]
        stats = llm.llm_engine.proposer.stats() if draft_dir is not None else {}
    finally:
        if draft_dir is not None:
            llm.llm_engine.proposer.close()
    return outputs, stats


def test_outputs_are_the_same_with_and_without_runner_up_guesses(tiny_llama_dir, near_draft_dir, monkeypatch):
    plain, _ = _generate(tiny_llama_dir, None, 0, monkeypatch)
    without, alone = _generate(tiny_llama_dir, near_draft_dir, 0, monkeypatch)
    with_guesses, both = _generate(tiny_llama_dir, near_draft_dir, 4, monkeypatch)
    assert without == plain and with_guesses == plain
    assert alone["runner_up_guesses"] == 0 and both["runner_up_guesses"] > 0
    assert both["rejected_guess_hits"] + both["bonus_guess_hits"] > 0


def test_forks_give_way_to_sequences_and_take_no_room_from_them(tiny_llama_dir):
    per_slot = _drafter(tiny_llama_dir).kv.cache.bytes_per_token * 256  # a slot's smallest capacity
    drafter = _drafter(tiny_llama_dir, kv_cache_bytes=2 * per_slot)  # room for two sequences
    drafter.set_context(1, PROMPT)
    drafter.draft([(1, BUDGET)])
    assert drafter.fork(1, "fork", PROMPT + [3])
    assert len(drafter.draft([("fork", BUDGET)])[0]) == BUDGET
    drafter.set_context(2, PROMPT[:20])
    assert len(drafter.draft([(2, BUDGET)])[0]) == BUDGET  # room made by evicting the fork, not sequence 1
    assert drafter.kv_length("fork") == 0 and drafter.kv_length(1) > 0
    assert not drafter.fork(1, "another", PROMPT + [5])  # no room, and none taken
    assert drafter.kv_length(1) > 0 and drafter.kv_length(2) > 0
