import json
import logging
import random
import tracemalloc

import pytest

from hetero.core.protocols import MAX_TREE_NODES, ProposalRequest, SpecStats, Verdict
from lookahead import LookaheadCache, LookaheadConfig, default_memory_budget
from lookahead.trie import NODE_BYTES, HistoryAppender, Trie

BIG = 10**8  # a memory budget that never binds


def make(budget=BIG, **overrides):
    return LookaheadCache(LookaheadConfig(**{"is_debug": False, **overrides}), memory_budget_bytes=budget)


def propose(cache, request_id, tokens, num_prompt=None, max_nodes=16):
    request = ProposalRequest(request_id, list(tokens), len(tokens) if num_prompt is None else num_prompt, max_nodes)
    return cache.propose([request])[0]


def finish(cache, request_id, tokens, num_prompt=None):
    """Run a request through the cache once and release it into the global history."""
    propose(cache, request_id, tokens, num_prompt)
    cache.release(request_id)


def paths(tree):
    """Token tuple from the root to every node."""
    return [tuple(int(tree.tokens[i]) for i in tree.path_to(n)) for n in range(len(tree))]


def chain(tree):
    assert list(tree.parents) == list(range(-1, len(tree) - 1)), "expected a chain"
    return [int(t) for t in tree.tokens]


PROMPT = list(range(100, 140))


# ------------------------------------------------------------------ insert / match


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_copies_a_continuation_from_the_requests_own_prompt(mode):
    cache = make(cache_mode=mode, copy_length=6)
    tree = propose(cache, "a", PROMPT + PROMPT[10:13], num_prompt=len(PROMPT))
    assert chain(tree) == PROMPT[13:19]


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_copies_a_continuation_from_another_requests_output(mode):
    cache = make(cache_mode=mode, threshold=1.0, copy_length=5)
    output = list(range(500, 520))
    propose(cache, "a", PROMPT, num_prompt=len(PROMPT))
    cache.commit([Verdict("a", output[:-1], output[-1], 0)])
    cache.release("a")
    tree = propose(cache, "b", [7, 8, 9] + output[4:6])
    assert chain(tree) == output[6:11]


def test_learns_accepted_tokens_from_verdicts():
    cache = make(cache_mode=0, copy_length=3)
    propose(cache, "a", [1, 2, 3])
    cache.commit([Verdict("a", [4, 5], 6, 0)])  # history is now 1..6
    cache.commit([Verdict("a", [], 1, 0)])
    assert chain(propose(cache, "a", [1, 2, 3, 4, 5, 6, 1, 2])) == [3, 4, 5]


def test_nothing_matches_gives_an_empty_tree():
    cache = make()
    finish(cache, "a", PROMPT)
    tree = propose(cache, "b", [1, 2, 3, 4])
    assert len(tree) == 0 and tree.tokens.dtype.name == "int64"


def test_longer_context_wins_over_shorter():
    cache = make(cache_mode=0, match_length=3, min_match_length=1, copy_length=1)
    # "9 1 2" was followed by 7 long ago, "1 2" most recently by 8.
    history = [9, 1, 2, 7, 0, 1, 2, 8, 0]
    assert chain(propose(cache, "a", history + [9, 1, 2])) == [7]
    assert chain(propose(cache, "b", history + [5, 1, 2])) == [8]


def test_raw_copies_the_most_recent_occurrence_whole():
    cache = make(cache_mode=0, copy_length=3)
    history = [1, 2, 3, 4, 6, 0, 1, 2, 3, 5, 7, 0, 9, 9]
    assert chain(propose(cache, "a", history + [1, 2])) == [3, 5, 7]


def test_proposals_never_run_past_eos():
    cache = make(cache_mode=0, copy_length=6, eos_token_id=120)
    assert chain(propose(cache, "a", PROMPT + PROMPT[15:17])) == [117, 118, 119, 120]


def test_every_proposed_path_occurred_after_the_context():
    """Turbo trees merge many histories; every root-to-node path must still be a real
    continuation of the context's shortest matched suffix in some history."""
    rnd = random.Random(1)
    cache = make(cache_mode=2, threshold=1.0)
    histories = [[rnd.randrange(6) for _ in range(60)] for _ in range(8)]
    for i, history in enumerate(histories):
        finish(cache, f"h{i}", history)
    texts = [",".join(map(str, h)) for h in histories]
    for trial in range(40):
        context = [rnd.randrange(6) for _ in range(5)]
        tree = propose(cache, f"q{trial}", context, max_nodes=rnd.randrange(1, 70))
        assert len(tree) <= MAX_TREE_NODES
        own = ",".join(map(str, context))
        for path in paths(tree):
            needle = ",".join(map(str, context[-2:] + list(path)))
            assert any(needle in text for text in texts + [own]), (context, path)


# ------------------------------------------------------------------ trees


def test_multi_branch_tree_ranked_by_frequency(tmp_path):
    cache = make(cache_mode=1, threshold=0.5, token_paths_top_k=1)
    for i in range(3):
        finish(cache, f"x{i}", [1, 2, 3, 4, 5])
    finish(cache, "y", [1, 2, 3, 7, 8])
    tree = propose(cache, "q", [0, 1, 2, 3])
    assert [int(t) for t in tree.tokens] == [4, 5, 7, 8]
    assert list(tree.parents) == [-1, 0, -1, 2]
    assert list(tree.scores) == [3.0, 3.0, 1.0, 1.0]


def test_own_history_outweighs_global_history_by_start_freq():
    cache = make(cache_mode=1, threshold=0.5, token_paths_top_k=1, start_freq=10.0, copy_length=1)
    for i in range(4):
        finish(cache, f"x{i}", [1, 2, 3, 4])
    tree = propose(cache, "q", [1, 2, 3, 9, 0, 1, 2, 3])  # own: "1 2 3 9" once
    assert [int(t) for t in tree.tokens] == [9, 4]
    assert list(tree.scores) == [10.0, 4.0]


def test_budget_is_respected():
    cache = make(cache_mode=1, threshold=0.5, copy_length=7)
    rnd = random.Random(0)
    for i in range(40):  # 40 different continuations of "1 2"
        finish(cache, f"x{i}", [1, 2] + [rnd.randrange(1000, 2000) for _ in range(8)])
    for max_nodes in (0, 1, 5, 63, 200):
        tree = propose(cache, f"q{max_nodes}", [1, 2], max_nodes=max_nodes)
        assert len(tree) == min(max_nodes, MAX_TREE_NODES)
        assert max(tree.depths(), default=0) <= 7


def test_top_k_in_cell_bounds_each_nodes_fan_out():
    cache = make(cache_mode=1, threshold=0.5, copy_length=2, top_k_in_cell=3)
    for i in range(10):
        finish(cache, f"x{i}", [1, 2, 100 + i, 200 + i % 2])
    tree = propose(cache, "q", [1, 2], max_nodes=63)
    assert sum(int(p) == -1 for p in tree.parents) == 3
    assert len(tree) == 6


def test_raw_top_k_gives_distinct_most_recent_copies():
    cache = make(cache_mode=0, top_k=2, copy_length=2)
    history = [1, 2, 10, 11, 0, 1, 2, 20, 21, 0, 1, 2, 30, 31, 0]
    tree = propose(cache, "a", history + [1, 2], max_nodes=4)
    assert paths(tree) == [(30,), (30, 31), (20,), (20, 21)]


# ------------------------------------------------------------------ modes


def test_cache_modes_differ_on_a_single_global_occurrence():
    """Turbo needs ``threshold`` evidence; raw copies a single occurrence; hybrid falls back."""
    trees = {}
    for mode in (0, 1, 2):
        cache = make(cache_mode=mode, threshold=2.0, copy_length=3)
        finish(cache, "a", [1, 2, 3, 4, 5])
        trees[mode] = [int(t) for t in propose(cache, "b", [1, 2]).tokens]
    assert trees == {0: [3, 4, 5], 1: [], 2: [3, 4, 5]}


@pytest.mark.parametrize("is_hybrid, expected", [(True, [3, 4, 9, 9]), (False, [3, 4])])
def test_hybrid_fills_turbos_unused_budget_with_raws_copy(is_hybrid, expected):
    cache = make(cache_mode=2, is_hybrid=is_hybrid, threshold=2.0, token_paths_top_k=1, copy_length=2)
    finish(cache, "a", [1, 2, 3, 4])
    finish(cache, "b", [1, 2, 3, 4])
    finish(cache, "c", [1, 2, 9, 9])  # most recent, but seen once: below turbo's threshold
    assert [int(t) for t in propose(cache, "q", [1, 2], max_nodes=8).tokens] == expected


# ------------------------------------------------------------------ decay


def test_rejections_decay_a_path_until_it_is_pruned():
    cache = make(cache_mode=1, threshold=2.0, decay=0.5, start_freq=10.0, copy_length=1, token_paths_top_k=1)
    history = [1, 2, 3, 4, 2, 3]

    def score_of_4():
        tree = propose(cache, "a", history)
        return dict(zip(map(int, tree.tokens), map(float, tree.scores))).get(4)

    assert score_of_4() == 10.0
    for expected, bonus in ((5.0, 50), (2.5, 60), (None, 70)):
        cache.commit([Verdict("a", [], bonus, 0)])  # the verifier wanted `bonus`, not 4
        history += [bonus, 2, 3]
        assert score_of_4() == expected


def test_accepted_nodes_are_not_decayed():
    cache = make(cache_mode=1, threshold=2.0, copy_length=2, turbo_match_length=2, token_paths_top_k=1)
    history = [1, 2, 3, 4, 5, 1, 2]
    tree = propose(cache, "a", history)
    assert [int(t) for t in tree.tokens] == [3, 4]
    cache.commit([Verdict("a", [3, 4], 5, 0)])
    tree = propose(cache, "a", history + [3, 4, 5, 1, 2])
    assert list(tree.scores) == [20.0, 20.0]


# ------------------------------------------------------------------ memory


def test_cache_size_bounds_the_global_trie_and_evicts_the_oldest():
    cache = make(cache_mode=0, cache_size=300, copy_length=3)
    first = list(range(1000, 1030))
    finish(cache, "first", first)
    for i in range(30):
        finish(cache, f"x{i}", list(range(2000 + 100 * i, 2030 + 100 * i)))
        assert cache.global_trie.size <= 300
    last = list(range(2000 + 100 * 29, 2030 + 100 * 29))
    assert len(propose(cache, "q1", first[:5])) == 0
    assert chain(propose(cache, "q2", last[:5])) == last[5:8]


def test_cache_size_below_one_path_keeps_the_global_trie_empty():
    cache = make(cache_mode=0, cache_size=3)
    finish(cache, "a", list(range(50)))
    assert cache.global_trie.size == 0


def test_memory_estimate_never_exceeds_a_small_cap():
    cap = 2000 * NODE_BYTES
    cache = make(budget=cap, cache_mode=2, threshold=1.0)
    rnd = random.Random(0)
    recent = None
    for i in range(60):
        tokens = [rnd.randrange(5000) for _ in range(80)]
        tree = propose(cache, f"r{i}", tokens, num_prompt=40)
        assert cache.memory_bytes() <= cap
        cache.commit([Verdict(f"r{i}", [int(t) for t in tree.tokens[:1]], rnd.randrange(5000), len(tree))])
        assert cache.memory_bytes() <= cap
        cache.release(f"r{i}")
        assert cache.memory_bytes() <= cap
        recent = tokens
    assert 0 < cache.global_trie.size
    assert chain(propose(cache, "q", recent[50:53]))[:3] == recent[53:56]  # the latest survived


def test_a_request_larger_than_the_cap_stops_learning_within_it():
    cap = 300 * NODE_BYTES
    cache = make(budget=cap, cache_mode=0)
    propose(cache, "big", list(range(10_000)))
    assert cache.memory_bytes() <= cap
    cache.commit([Verdict("big", [1, 2], 3, 0)])
    assert cache.memory_bytes() <= cap
    cache.release("big")
    assert cache.memory_bytes() <= cap


def test_node_bytes_bounds_the_real_allocation():
    rnd = random.Random(0)
    for tokens in ([rnd.randrange(1000, 60_000) for _ in range(6000)], [rnd.randrange(3) for _ in range(6000)]):
        for appender in (True, False):
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            trie = Trie(14, None if appender else 16)
            if appender:
                grow, i = HistoryAppender(trie), 0
                while i < len(tokens):  # a verdict's tokens at a time
                    step = rnd.randint(1, 6)
                    grow.extend(tokens[i:i + step], i)
                    i += step
            else:
                for i in range(len(tokens)):
                    trie.insert(tokens[i:i + 14], 1.0, i + 1)
            used = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            assert used <= trie.size * NODE_BYTES, used / trie.size


def test_default_memory_budget_is_a_fraction_of_ram():
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert default_memory_budget() == int(0.15 * total)
    assert default_memory_budget(0.5) == int(0.5 * total)
    with pytest.raises(ValueError, match="cpu_decoding_memory_utilization"):
        default_memory_budget(0)
    assert LookaheadCache(LookaheadConfig(is_debug=False)).memory_budget_bytes == default_memory_budget()


# ------------------------------------------------------------------ warm-up, switches


def write_warmup(path, records):
    path.write_text(json.dumps(records))
    return path


def test_warmup_file_feeds_the_global_cache(tmp_path):
    records = [{"prompt": [1, 2, 3], "output": [4, 5, 6, 7]}] * 2
    warm = write_warmup(tmp_path / "warm.json", records)
    (tmp_path / "lookahead_cache_config.json").write_text(json.dumps({"warmup_file": "warm.json", "is_debug": False}))
    cache = LookaheadCache(LookaheadConfig.from_dir(tmp_path), memory_budget_bytes=BIG)
    assert chain(propose(cache, "q", [9, 3, 4])) == [5, 6, 7]
    assert make().warmup(warm) == 2


@pytest.mark.parametrize(
    "records, message",
    [
        ({"prompt": [1]}, "JSON list"),
        ([{"prompt": [1], "output": "abc"}], "record 0 output"),
        ([{"prompt": [1], "output": [2]}, {"prompt": [-1], "output": []}], "record 1 prompt"),
        ([{"prompt": [1], "output": [200_000]}], "record 0 output"),
        ([{"prompt": [1], "outputs": [2]}], "record 0"),
    ],
)
def test_bad_warmup_file_is_an_error_naming_the_file(tmp_path, records, message):
    warm = write_warmup(tmp_path / "warm.json", records)
    with pytest.raises(ValueError, match=message) as error:
        make().warmup(warm)
    assert "warm.json" in str(error.value)


def test_ignore_prompt_keeps_prompts_out_of_the_global_cache_only():
    prompt, output = list(range(100, 120)), list(range(500, 520))
    for ignore, prompt_hits in ((False, True), (True, False)):
        cache = make(cache_mode=0, ignore_prompt=ignore, copy_length=2)
        assert chain(propose(cache, "a", prompt + prompt[:2], num_prompt=20)) == prompt[2:4]  # own prompt
        cache.commit([Verdict("a", output[:-1], output[-1], 0)])
        cache.release("a")
        assert bool(len(propose(cache, "b", prompt[5:7]))) is prompt_hits
        assert chain(propose(cache, "c", output[5:7])) == output[7:9]


def test_global_cache_switch_off_keeps_requests_apart(tmp_path):
    cache = make(cache_mode=0, global_cache_switch=False, copy_length=2)
    assert chain(propose(cache, "a", PROMPT + PROMPT[:2])) == PROMPT[2:4]
    cache.release("a")
    assert cache.global_trie.size == 0
    assert len(propose(cache, "b", PROMPT[:2])) == 0
    warm = write_warmup(tmp_path / "warm.json", [{"prompt": [1, 2], "output": [3]}])
    assert cache.warmup(warm) == 0 and cache.global_trie.size == 0


# ------------------------------------------------------------------ statistics


def test_statistics_after_a_scripted_sequence_of_verdicts(caplog):
    cache = make(cache_mode=0, is_debug=True, log_interval=2, copy_length=4)
    for request_id in ("a", "b"):
        propose(cache, request_id, PROMPT + PROMPT[:2])
    script = [
        Verdict("a", [102, 103], 7, 4),  # 2 of 4 accepted
        Verdict("a", [], 8, 3),  # a miss
        Verdict("b", [], 9, 0),  # nothing proposed: the last draft had 4 nodes
        Verdict("b", [1, 2, 3, 4, 5], 6, 5),  # all of 5
    ]
    with caplog.at_level(logging.INFO, logger="hetero.lookahead"):
        cache.commit(script)
    stats = cache.hit_stats
    assert (stats.num_iters, stats.hit_iters, stats.hit_len, stats.invalid_len) == (4, 2, 7, 2 + 3 + 4 + 0)
    assert stats.hit_rate == 0.5
    assert stats.global_average_hit_len == 7 / 4
    assert stats.valid_average_hit_len == 3.5
    assert stats.hit_valid_rate == 7 / 16
    assert cache.log_line() == (
        "[LookaheadCache] num_iters: 4, hit_iters: 2, hit_len: 7, invalid_len: 9, hit_rate: 0.5000, "
        "global_average_hit_len: 1.7500, valid_average_hit_len: 3.5000, hit_valid_rate: 0.4375"
    )
    after_two = (
        "[LookaheadCache] num_iters: 2, hit_iters: 1, hit_len: 2, invalid_len: 5, hit_rate: 0.5000, "
        "global_average_hit_len: 1.0000, valid_average_hit_len: 2.0000, hit_valid_rate: 0.2857"
    )
    assert [r.getMessage() for r in caplog.records if r.name == "hetero.lookahead"] == [after_two, cache.log_line()]
    spec = cache.spec_stats
    assert (spec.num_steps, spec.num_draft_tokens, spec.num_accepted_tokens) == (4, 16, 7)
    assert spec.accepted_per_position == [2, 2, 1, 1, 1]
    assert spec.mean_accepted_length == (7 + 4) / 4
    a, b = cache.request_stats("a"), cache.request_stats("b")
    assert (a.num_steps, a.num_draft_tokens, a.num_accepted_tokens) == (2, 7, 2)
    assert (b.num_steps, b.num_draft_tokens, b.num_accepted_tokens) == (2, 9, 5)
    cache.release("a")
    assert cache.request_stats("a") is None


def test_unknown_requests_are_harmless():
    cache = make()
    cache.release("nobody")
    cache.commit([Verdict("nobody", [1], 2, 3)])
    assert cache.hit_stats.num_iters == 1 and cache.request_stats("nobody") is None


def test_memory_budget_honours_a_container_limit(tmp_path):
    from lookahead.memory import total_ram_bytes

    host = total_ram_bytes(limit_files=())
    limited = tmp_path / "memory.max"
    limited.write_text(f"{host // 4}\n")
    unlimited = tmp_path / "unlimited"
    unlimited.write_text("max\n")
    assert total_ram_bytes(limit_files=(str(limited), str(unlimited))) == host // 4
    assert total_ram_bytes(limit_files=(str(unlimited), str(tmp_path / "absent"))) == host


def test_spec_stats_of_a_batch_equal_its_trees_recorded_one_by_one():
    sizes, accepted = [4, 1, 8, 3, 0], [2, 0, 5, 3, 0]
    one_by_one, batch = SpecStats(), SpecStats()
    for n, a in zip(sizes, accepted):
        one_by_one.record(n, a)
    batch.record_batch(sizes[:2], accepted[:2])
    batch.record_batch(sizes[2:], accepted[2:])
    assert batch == one_by_one
    assert batch.accepted_per_position == [3, 3, 2, 1, 1]
    assert (batch.num_steps, batch.num_draft_tokens, batch.num_accepted_tokens) == (5, 16, 10)


# ------------------------------------------------------------------ catching up after plain steps


def test_a_long_plain_stretch_is_learned_only_in_its_last_tokens():
    from lookahead.cache import MAX_CATCH_UP_TOKENS

    cache = make(cache_mode=0, copy_length=3, global_cache_switch=False)
    rng = random.Random(0)
    output = [rng.randrange(1000, 10**6) for _ in range(MAX_CATCH_UP_TOKENS * 20)]
    old, recent = output[:100], output[-20:]
    tree = propose(cache, "a", PROMPT + output + recent[:5], num_prompt=len(PROMPT))
    assert chain(tree) == recent[5:8]  # a copy within the tail is found
    assert len(propose(cache, "a", PROMPT + output + recent[:5] + old[:5], num_prompt=len(PROMPT))) == 0  # the skipped part was not learned
    assert chain(propose(cache, "a", PROMPT + output + recent[:5] + old[:5] + PROMPT[:4], num_prompt=len(PROMPT))) == PROMPT[4:7]
    state = cache._requests["a"]
    assert len(state.history) == len(PROMPT) + len(output) + 5 + 5 + 4
    depth = state.trie.depth
    assert state.trie.size <= depth * (len(PROMPT) + MAX_CATCH_UP_TOKENS + 5 + 5 + 4)


def test_no_trie_path_spans_a_skipped_stretch():
    from lookahead.cache import MAX_CATCH_UP_TOKENS

    cache = make(cache_mode=0, copy_length=2, global_cache_switch=False)
    output = list(range(5000, 5000 + MAX_CATCH_UP_TOKENS + 50))
    propose(cache, "a", PROMPT + output, num_prompt=len(PROMPT))
    trie = cache._requests["a"].trie
    # the prompt's last token is followed by a skipped one: no continuation of it was learned
    assert trie.match([PROMPT[-1]], 1, 1, 1) == []


def test_release_puts_only_the_learned_spans_into_the_global_cache():
    from lookahead.cache import MAX_CATCH_UP_TOKENS, _learned_spans

    assert _learned_spans([(5, 10), (12, 20)], 0, 25) == [(0, 5), (10, 12), (20, 25)]
    assert _learned_spans([(5, 10)], 7, 9) == []
    assert _learned_spans([(5, 10)], 0, 8) == [(0, 5)]
    cache = make(cache_mode=0, copy_length=3, threshold=1.0)
    output = list(range(7000, 7000 + MAX_CATCH_UP_TOKENS * 3))
    finish(cache, "a", PROMPT + output, num_prompt=len(PROMPT))
    assert chain(propose(cache, "b", [1, 2] + output[-10:-8])) == output[-8:-5]
    assert len(propose(cache, "c", [1, 2] + output[10:12])) == 0
    assert chain(propose(cache, "d", [1, 2] + PROMPT[3:5])) == PROMPT[5:8]


def test_a_large_batch_shares_the_catch_up_budget():
    from lookahead.cache import CATCH_UP_TOKENS, MAX_CATCH_UP_TOKENS, MIN_CATCH_UP_TOKENS

    cache = make(cache_mode=0, copy_length=3, global_cache_switch=False)
    prompts = {f"r{i}": [10_000 * (i + 1) + j for j in range(10)] for i in range(64)}
    outputs = {rid: [p[0] + 1000 + j for j in range(MAX_CATCH_UP_TOKENS * 2)] for rid, p in prompts.items()}
    cache.propose([ProposalRequest(rid, prompts[rid] + outputs[rid], len(prompts[rid]), 4) for rid in prompts])
    per_request = max(MIN_CATCH_UP_TOKENS, CATCH_UP_TOKENS // 64)
    assert per_request < MAX_CATCH_UP_TOKENS
    depth = cache.config.trie_depth
    for rid, state in cache._requests.items():
        assert state.gaps == [(10, 10 + 2 * MAX_CATCH_UP_TOKENS - per_request)]
        assert state.trie.size <= depth * (10 + per_request)
