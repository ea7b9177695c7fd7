"""The lookahead cache proposes exactly what its previous implementation did.

``lookahead_reference`` is the cache before its host-cost rework. Both are driven through
the same randomized runs (copy-heavy and open token streams, several requests at once,
steps with and without speculation, random acceptance, releases into the global cache,
budgets tight enough to evict and to stop learning); every tree must be equal, in
tokens, parents and scores, node for node, and so must the memory estimate.
"""
import random

import numpy as np
import pytest

from hetero.core.protocols import ProposalRequest, Verdict
from lookahead import LookaheadCache, LookaheadConfig
from lookahead_reference import ReferenceLookaheadCache

CONFIGS = [
    dict(),
    dict(cache_mode=0, top_k=3),
    dict(cache_mode=1, threshold=1.0),
    dict(cache_mode=2, is_hybrid=False, token_paths_top_k=3, top_k_in_cell=3),
    dict(cache_mode=2, copy_length=3, turbo_match_length=3, match_length=3, min_match_length=1, eos_token_id=5),
    dict(cache_mode=2, cache_size=300, cell_max_size=2, ignore_prompt=True),
    dict(global_cache_switch=False, decay=0.25),
]


def stream(rnd, vocab, length):
    """Copies of earlier spans between fresh tokens, as in rewrites and code edits."""
    tokens = [rnd.randrange(vocab) for _ in range(8)]
    while len(tokens) < length:
        span = rnd.randint(2, 12)
        if rnd.random() < 0.6:
            start = rnd.randrange(max(1, len(tokens) - span))
            tokens.extend(tokens[start:start + span])
        else:
            tokens.extend(rnd.randrange(vocab) for _ in range(span))
    return tokens[:length]


def follow(tree, truth, rnd):
    """The tree path ``truth`` follows, or (sometimes) a random path: some acceptance
    patterns no real target would give."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    accepted, parent = [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == parent]
        if not kids:
            return accepted
        if rnd.random() < 0.15:
            pick = rnd.choice(kids)
        else:
            want = truth[len(accepted)] if len(accepted) < len(truth) else None
            pick = next((i for i in kids if tokens[i] == want), None)
        if pick is None or len(accepted) >= len(truth):
            return accepted
        accepted.append(tokens[pick])
        parent = pick


def assert_same_tree(expected, actual, where):
    assert len(actual) == len(expected), where
    np.testing.assert_array_equal(actual.tokens, expected.tokens, err_msg=where)
    np.testing.assert_array_equal(actual.parents, expected.parents, err_msg=where)
    if expected.scores is None:
        assert actual.scores is None, where
    else:
        np.testing.assert_array_equal(actual.scores, expected.scores, err_msg=where)


def run_both(seed, overrides, budget, vocab, steps=60):
    rnd = random.Random(seed)
    config = LookaheadConfig(**{"is_debug": False, **overrides})
    reference, cache = ReferenceLookaheadCache(config, budget), LookaheadCache(config, budget)
    live, serial, checked, stopped = {}, 0, 0, 0
    for step in range(steps):
        while len(live) < 4:
            tokens = stream(rnd, vocab, rnd.randint(60, 240))
            prompt = rnd.randint(1, 40)
            live[f"r{serial}"] = [tokens[:prompt], tokens[prompt:], prompt]
            serial += 1
        batch = []
        for request_id, (history, _, prompt) in live.items():
            batch.append(ProposalRequest(request_id, list(history), prompt, rnd.choice([0, 1, 4, 16, 63, 200])))
        speculate = rnd.random() < 0.8
        if speculate:
            expected, actual = reference.propose(batch), cache.propose(batch)
            for request, want, got in zip(batch, expected, actual):
                assert_same_tree(want, got, f"seed {seed} step {step} {request.request_id}")
                checked += 1
        verdicts = []
        for index, (request_id, entry) in enumerate(list(live.items())):
            history, future, _ = entry
            if speculate:
                accepted = follow(expected[index], future[:-1], rnd)
                bonus = future[len(accepted)] if len(future) > 1 and rnd.random() < 0.95 else None
                verdicts.append(Verdict(request_id, accepted, bonus, len(expected[index])))
                taken = accepted + [bonus] if bonus is not None else None
            else:  # a plain stretch: tokens no verdict brings, caught up at the next proposal
                taken = future[:rnd.randint(1, 80)]
            if taken is None or len(taken) >= len(future):
                reference.release(request_id)
                cache.release(request_id)
                del live[request_id]
            else:
                entry[0], entry[1] = history + taken, future[len(taken):]
        if speculate:
            reference.commit(verdicts)
            cache.commit(verdicts)
        assert cache.memory_bytes() == reference.memory_bytes(), f"seed {seed} step {step}"
        assert cache.hit_stats == reference.hit_stats
        assert cache.global_trie.size == reference.global_trie.size
        frozen = [state.frozen for state in cache._requests.values()]
        assert frozen == [state.frozen for state in reference._requests.values()]
        stopped += sum(frozen)
    return checked, stopped


@pytest.mark.parametrize("overrides", CONFIGS)
@pytest.mark.parametrize("seed", range(3))
def test_trees_equal_the_reference_on_random_streams(overrides, seed):
    checked, _ = run_both(seed, overrides, budget=10**9, vocab=[8, 60, 5000][seed])
    assert checked > 100


@pytest.mark.parametrize("budget", [40_000, 150_000, 600_000])
@pytest.mark.parametrize("seed", range(2))
def test_memory_budget_stops_and_evictions_equal_the_reference(budget, seed):
    checked, stopped = run_both(seed, dict(cache_size=2_000), budget=budget, vocab=40)
    assert checked > 100 and stopped > 0
