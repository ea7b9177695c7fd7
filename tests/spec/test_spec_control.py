"""The speculation controller: node budget per sequence and the measured on/off decision."""
import random
import statistics
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest

from bench.spec_control_sim import Workload, speedups
from hetero.core.protocols import Proposer, TokenTree
from hetero.spec.controller import SpeculationController
from hetero.spec.draining import AcceptanceSpread, DrainingBatch, speculation_reach
from hetero.spec.tree_sizer import TreeSizer


def drive(controller, num_seqs, spec_tps, plain_tps, steps, spec_tokens_per_seq=2, plain_tokens_per_seq=2, draining=False):
    """Run `steps` decisions against fixed measured throughputs; return how many speculated.

    Each step emits the given tokens per sequence (speculation: 1 if no draft token was
    accepted; plain: a multi-step window's). ``draining``: the batch drains, one sequence far
    behind the rest, so that speculation's whole pace reaches its end (reach 1)."""
    batch = DrainingBatch([1000] + [10] * (num_seqs - 1), [0] * num_seqs, [0] * num_seqs, [0] * num_seqs) if draining else None
    speculated = 0
    for _ in range(steps):
        nodes = controller.nodes_per_sequence(num_seqs, draining=batch)
        emitted = num_seqs * (spec_tokens_per_seq if nodes else plain_tokens_per_seq)
        rate = spec_tps if nodes else plain_tps
        controller.record_step(num_seqs, bool(nodes), tokens_emitted=emitted, seconds=emitted / rate)
        speculated += bool(nodes)
    return speculated


def test_budget_shrinks_trees_as_the_batch_grows():
    controller = SpeculationController(max_nodes_per_seq=8, target_parallelism=64)
    assert controller.nodes_per_sequence(1) == 8
    assert controller.nodes_per_sequence(16) == 4
    assert controller.nodes_per_sequence(64) == 1
    assert controller.nodes_per_sequence(65) == 0


def test_losing_speculation_is_turned_off_and_probed_ever_more_rarely():
    controller = SpeculationController(8, 1024, probe_interval=4, max_probe_interval=256, window=4)
    first = drive(controller, 64, spec_tps=800.0, plain_tps=1000.0, steps=1000)
    assert controller.speculation_pays(64) is False
    # Exploring: 3 steps of each option, alternating. Then a probe once plain steps have taken
    # 4 speculative step times, until speculation's window of 4 is full, then 8, 16, ..., 256
    # of them (a plain step takes 0.8 of one here): 9 probes within 1000 steps.
    assert first <= 3 + 9
    later = drive(controller, 64, spec_tps=800.0, plain_tps=1000.0, steps=1024)
    assert later <= 1024 // 256


def test_drafts_that_accept_nothing_are_ruled_out_after_one_step_of_each():
    """No timing can make a step that accepts nothing pay: even measured faster per token
    (here 1200 vs 1000 tokens/s, say a slow first plain window), it loses at once, and the
    probes thin out as for any solid verdict."""
    nothing = dict(spec_tps=1200.0, plain_tps=1000.0, spec_tokens_per_seq=1, plain_tokens_per_seq=8)
    controller = SpeculationController(8, 1024, probe_interval=4, max_probe_interval=256, window=16)
    assert drive(controller, 64, steps=2, **nothing) == 1
    assert controller.speculation_pays(64) is False
    # Probed at the longest spacing at once, 256 speculative step times: a plain window takes
    # 9.6 of them, so no probe in the first 26 windows, and one per 27 windows after that.
    assert drive(controller, 64, steps=26, **nothing) == 0
    assert drive(controller, 64, steps=1000, **nothing) <= 1000 // 26
    # At batch 1 one miss is weak evidence (drafts right 3 times in 4 miss a quarter of the
    # time): the timed verdict decides there, after three steps of each.
    controller = SpeculationController(8, 1024, probe_interval=4)
    drive(controller, 1, steps=2, **nothing)
    assert controller.speculation_pays(1) is None
    # Drafts that start to fit: the probe that accepts is followed by exploration, not ignored.
    for _ in range(300):
        drive(controller, 64, spec_tps=1500.0, plain_tps=1000.0, steps=1)
        if controller.speculation_pays(64):
            break
    assert controller.speculation_pays(64) is True


def test_probes_stay_frequent_while_the_evidence_is_thin():
    controller = SpeculationController(8, 1024, probe_interval=4, window=16)
    first = drive(controller, 1, spec_tps=800.0, plain_tps=1000.0, steps=100)
    # Batch 1: 3 while exploring, then one every 4 speculative step times (5 plain steps here)
    # until the window of 16 is full: 13 probes.
    assert first >= 3 + 13


def test_speculation_that_lost_on_thin_evidence_is_probed_sooner_unless_it_accepted_nothing():
    """A verdict from 3 speculative steps at batch 8 is noisy: drafts that accepted something
    are probed every 16 of their step times (not 64) until their window fills; drafts that
    accepted nothing keep the base spacing."""
    accepting = SpeculationController(8, 1024, probe_interval=64, window=16)
    assert drive(accepting, 8, spec_tps=900.0, plain_tps=1000.0, steps=200, spec_tokens_per_seq=2) >= 3 + 8
    missing = SpeculationController(8, 1024, probe_interval=64, window=16)
    assert drive(missing, 8, spec_tps=900.0, plain_tps=1000.0, steps=200, spec_tokens_per_seq=1) <= 3 + 3


def test_a_large_batch_firms_up_the_evidence_in_a_few_steps():
    """At batch 64, the 3 speculative steps of the exploration hold 192 sequence-steps: a
    clear loss is solid evidence at once, and the probes thin out without a full window."""
    controller = SpeculationController(8, 1024, probe_interval=4, window=16)
    # 3 while exploring, then probes after 8, 16 and 32 speculative step times (a plain step
    # takes 0.8 of one): 3 probes within 100 plain steps, not 13.
    assert drive(controller, 64, spec_tps=800.0, plain_tps=1000.0, steps=100) <= 3 + 3
    # A close call (2 % apart) stays thin evidence however many sequences it spans.
    close = SpeculationController(8, 1024, probe_interval=4, window=16)
    assert drive(close, 64, spec_tps=980.0, plain_tps=1000.0, steps=100) >= 3 + 13


def test_a_draining_batch_probes_speculation_that_lost_a_close_call_ever_more_rarely():
    """In a batch that drains, a probe costs nearly a whole step (its slowest sequence gains one
    token from it, as from a plain token-step), not the 2 % by which speculation trails."""
    close = dict(spec_tps=980.0, plain_tps=1000.0, steps=400)
    serving = SpeculationController(8, 1024, probe_interval=4, window=16)
    # Probes every 4 speculative step times (a plain step takes 0.98 of one): one per 6 steps.
    assert drive(serving, 64, **close) >= 3 + 60
    draining = SpeculationController(8, 1024, probe_interval=4, window=16)
    # Probes after 8, 16, 32, 64, 128 and 256 speculative step times: 504 of them by the sixth.
    assert drive(draining, 64, draining=True, **close) <= 3 + 5
    assert draining.speculation_pays(64) is False
    # At batch 8 speculation that lost on a thin window is still probed every step until its
    # window of 16 is full (3 + 13 steps), draining or not; then from twice the base spacing
    # on (8, 16, ..., 256 speculative step times), not from twice the thin window's 1.
    eight = [drive(SpeculationController(8, 1024, probe_interval=4, window=16), 8, draining=d, **close) for d in (False, True)]
    assert 3 + 13 <= eight[1] <= 3 + 13 + 6 < 3 + 60 <= eight[0]
    # A lone sequence has no slower one to wait for: it keeps the base spacing.
    lone = [drive(SpeculationController(8, 1024, probe_interval=4, window=16), 1, draining=d, **close) for d in (False, True)]
    assert lone[0] == lone[1] >= 3 + 60
    # A verdict for speculation is not held back: plain decoding is probed as in a server.
    winning = dict(spec_tps=1030.0, plain_tps=1000.0, steps=400)
    runs = [drive(SpeculationController(8, 1024, probe_interval=4, window=16, margin=0.02), 64, draining=d, **winning)
            for d in (False, True)]
    assert runs[0] == runs[1] <= 400 - 3 - 4


def test_speculation_needs_a_lead_to_be_turned_on_but_none_to_be_turned_off():
    """A few percent either way is within a small batch's noise: speculation that is not
    running is turned on past `margin`, and running speculation is turned off as soon as
    plain decoding measures faster (plain decoding is the floor)."""
    slightly_faster = SpeculationController(8, 1024, probe_interval=4, window=4, margin=0.05)
    assert drive(slightly_faster, 8, spec_tps=1030.0, plain_tps=1000.0, steps=200) <= 3 + 50
    assert slightly_faster.speculation_pays(8) is False
    clearly_faster = SpeculationController(8, 1024, probe_interval=4, window=4, margin=0.05)
    assert drive(clearly_faster, 8, spec_tps=1100.0, plain_tps=1000.0, steps=200) >= 200 - 3 - 50
    assert clearly_faster.speculation_pays(8) is True
    # Acceptance drops so that speculation is 3 % slower: turned off within the window.
    drive(clearly_faster, 8, spec_tps=970.0, plain_tps=1000.0, steps=8)
    assert clearly_faster.speculation_pays(8) is False


def test_winning_speculation_stays_on():
    controller = SpeculationController(8, 1024, probe_interval=4, window=4)
    speculated = drive(controller, 1, spec_tps=1500.0, plain_tps=1000.0, steps=500)
    assert controller.speculation_pays(1) is True
    assert speculated >= 500 - 3 - 7


def test_a_probe_that_beats_the_winner_is_repeated_at_once():
    controller = SpeculationController(8, 1024, probe_interval=64, window=4)
    assert drive(controller, 64, spec_tps=800.0, plain_tps=1000.0, steps=200) <= 3 + 2
    # Acceptance recovers. The first probe to see it is followed by more at once, which
    # overturn the verdict, instead of one probe per interval (128 speculative step times here).
    probes = []
    for step in range(1000):
        if drive(controller, 64, spec_tps=1500.0, plain_tps=1000.0, steps=1):
            probes.append(step)
        if controller.speculation_pays(64):
            break
    assert controller.speculation_pays(64) is True
    assert probes[-1] - probes[0] <= 2


def test_buckets_decide_independently():
    controller = SpeculationController(8, 1024, probe_interval=4)
    drive(controller, 1, spec_tps=1500.0, plain_tps=1000.0, steps=200)
    drive(controller, 64, spec_tps=500.0, plain_tps=1000.0, steps=200)
    assert controller.speculation_pays(1) is True
    assert controller.speculation_pays(64) is False


def test_a_shrinking_batch_keeps_speculating_without_exploring_again():
    """A batch of 64 finishing unevenly passes through buckets 32 ... 1: speculation measured to
    pay at 64 is kept there from their first step, with no plain window for a few last tokens."""
    controller = SpeculationController(8, 64, probe_interval=16)
    drive(controller, 64, spec_tps=1200.0, plain_tps=1000.0, steps=50)
    assert controller.speculation_pays(64) is True
    for num_seqs in (20, 9, 3, 1):
        assert drive(controller, num_seqs, spec_tps=2000.0, plain_tps=1000.0, steps=10) == 10


def test_plain_winning_at_a_batch_size_is_inherited_by_larger_ones_and_then_probed():
    controller = SpeculationController(8, 1024, probe_interval=8)
    drive(controller, 8, spec_tps=500.0, plain_tps=1000.0, steps=100)
    assert controller.speculation_pays(8) is False
    # Batch 64 starts plain; one probe per 8 steps until it has measured speculation itself.
    assert drive(controller, 64, spec_tps=500.0, plain_tps=1000.0, steps=8) == 0
    assert drive(controller, 64, spec_tps=500.0, plain_tps=1000.0, steps=9 * 3) == 3
    assert controller.speculation_pays(64) is False


def test_always_speculate_skips_the_measurement():
    controller = SpeculationController(8, 64, always_speculate=True)
    assert drive(controller, 1, spec_tps=1.0, plain_tps=1000.0, steps=50) == 50


class _Never:
    """Always decodes plainly: the baseline a controller must not fall behind."""

    def nodes_per_sequence(self, num_seqs, explore=True, draining=None):
        return 0

    def record_step(self, *args):
        pass


def simulate(controller, num_seqs, steps, plain_ms, spec_ms, nodes, p_accept, slow_first_plain=1.0, fast_first_spec=1.0):
    """Drive the controller against a fake clock, like bench.gpu_decode's spec section.

    Plain decoding runs windows of 8 token-steps of `plain_ms` each (one engine step emits 8
    tokens per sequence); a speculative step costs `spec_ms`, and each sequence emits 1 +
    the accepted part of a `nodes`-node chain whose nodes are right with probability
    `p_accept`. Step times carry ±5% noise; the first plain window is `slow_first_plain`
    times slower, the first speculative step `fast_first_spec` times faster (cold steps).
    Returns (ms per token, fraction of the steps that speculated).
    """
    rng = random.Random(0)
    total_ms = tokens = speculated = 0
    first_plain = first_spec = True
    for _ in range(steps):
        jitter = rng.uniform(0.95, 1.05)
        spec = bool(controller.nodes_per_sequence(num_seqs))
        if spec:
            emitted = sum(1 + _accepted(rng, nodes, p_accept) for _ in range(num_seqs))
            ms = spec_ms * jitter / (fast_first_spec if first_spec else 1.0)
            first_spec = False
        else:
            emitted = 8 * num_seqs
            ms = 8 * plain_ms * jitter * (slow_first_plain if first_plain else 1.0)
            first_plain = False
        controller.record_step(num_seqs, spec, emitted, ms / 1e3)
        total_ms += ms
        tokens += emitted
        speculated += spec
    return total_ms / tokens, speculated / steps


def _accepted(rng, nodes, p_accept):
    accepted = 0
    while accepted < nodes and rng.random() < p_accept:
        accepted += 1
    return accepted


# bench/results/gpu_decode-20261123-005459.json, batch 64 at draft_p 0.9: one node per sequence
# (target_parallelism 64), 1.89 tokens per sequence per 17.3 ms speculative step, against 8.0 ms
# per token-step of plain decoding in windows of 8: speculation is 13% slower.
BATCH_64 = dict(num_seqs=64, plain_ms=8.0, spec_ms=17.3, nodes=1, p_accept=0.89)
# Batch 1 at draft_p 0.9: 3.74 tokens per 7 ms speculative step against 5.9 ms per plain token.
BATCH_1 = dict(num_seqs=1, plain_ms=5.9, spec_ms=7.0, nodes=8, p_accept=0.755)


# ------------------------------------------------------------------- draining batches' reach


def _chain_dispersion(p, nodes):
    """Variance over mean of the accepted count of a chain whose drafts are each right with probability p."""
    at_least = [p**i for i in range(1, nodes + 1)]
    mean = sum(at_least)
    return (sum((2 * i - 1) * q for i, q in enumerate(at_least, 1)) - mean**2) / mean


def _steps_to_finish(num_seqs, remaining, p, nodes, trials, seed=0):
    """Monte Carlo: mean speculative steps until every sequence of a closed batch has emitted
    `remaining` tokens, each step 1 plus the accepted prefix of a chain cut to its room."""
    rng = np.random.default_rng(seed)
    steps = 0
    for _ in range(trials):
        rooms = np.full(num_seqs, remaining)
        while rooms.max() > 0:
            steps += 1
            right = rng.random((num_seqs, nodes)) < p
            prefix = np.where(right.all(axis=1), nodes, right.argmin(axis=1))
            accepted = np.minimum(prefix, np.maximum(rooms - 1, 0))
            rooms = np.where(rooms > 0, rooms - 1 - accepted, rooms)
    return steps / trials


def _trees(rng, num_trees, p, nodes):
    """Accepted draft tokens of `num_trees` chains of `nodes` tokens, each right with probability p."""
    counts = []
    for _ in range(num_trees):
        accepted = 0
        while accepted < nodes and rng.random() < p:
            accepted += 1
        counts.append(accepted)
    return counts


def _draining(remaining, per_sequence_trees):
    """A draining batch whose sequences verified the given trees (lists of accepted counts)."""
    return DrainingBatch(remaining, [len(t) for t in per_sequence_trees], [sum(t) for t in per_sequence_trees],
                         [sum(a * a for a in t) for t in per_sequence_trees])


@pytest.mark.parametrize("num_seqs,remaining,p,nodes", [(8, 127, 0.3, 3), (64, 127, 0.6, 3), (16, 40, 0.4, 3), (4, 64, 0.3, 3)])
def test_reach_matches_a_simulated_closed_batch(num_seqs, remaining, p, nodes):
    """Sequences alike in their drafts drift apart: the batch ends 3-16 % later than its mean
    pace says (the reach is that ratio), and the model says how much to within 3 %."""
    tokens_per_step = 1 + sum(p**i for i in range(1, nodes + 1))
    batch = DrainingBatch([remaining] * num_seqs, [0] * num_seqs, [0] * num_seqs, [0] * num_seqs)
    reach = speculation_reach(batch.remaining, tokens_per_step, AcceptanceSpread.of(batch, _chain_dispersion(p, nodes)))
    true_reach = remaining / tokens_per_step / _steps_to_finish(num_seqs, remaining, p, nodes, trials=400)
    assert true_reach < 0.97
    assert reach == pytest.approx(true_reach, rel=0.03)


def test_sequences_whose_drafts_fit_worse_are_seen_once_their_trees_say_so():
    rng = random.Random(0)
    alike = [_trees(rng, 40, 0.3, 1) for _ in range(8)]
    # Eight alike sequences: 40 one-node trees each leave their raw rates up to 50 % off the
    # batch's; shrunk, they count as the batch give or take the noise of estimating the spread.
    # The spread counts once it stands a standard error clear of nought: two of eight drafting
    # at a quarter of the rest's rate show after 160 trees each (a lone one among 8 does not).
    raw = np.array([sum(t) for t in alike]) / np.mean([sum(t) for t in alike])
    assert np.abs(raw - 1).max() > 0.4
    spread = AcceptanceSpread.of(_draining([100] * 8, alike), _chain_dispersion(0.3, 1))
    assert np.allclose(spread.relative, 1.0, atol=0.12)
    assert spread.within_dispersion == pytest.approx(0.7, abs=0.1)  # Bernoulli: 1 - p
    rng = random.Random(0)
    worse = [_trees(rng, 160, 0.3, 1) for _ in range(6)] + [_trees(rng, 160, 0.075, 1) for _ in range(2)]
    spread = AcceptanceSpread.of(_draining([100] * 8, worse), _chain_dispersion(0.3, 1))
    assert spread.relative[-2:].max() < 0.7 and spread.relative[-2:].max() < spread.relative[:-2].min() - 0.2
    # The batch waits for them: little of speculation's mean pace reaches the end.
    assert speculation_reach([100] * 8, 1.3, spread) < 0.9
    # Before any tree, or for one sequence far behind the rest, speculation's pace all counts.
    fresh = DrainingBatch([1000] + [10] * 7, [0] * 8, [0] * 8, [0] * 8)
    assert speculation_reach(fresh.remaining, 1.3, AcceptanceSpread.of(fresh, 1.0)) == pytest.approx(1.0, abs=0.01)


def test_the_noise_within_a_sequence_is_told_from_the_spread_between_sequences():
    """A quarter of the sequences draft at 0.27 and the rest at 0.9, 8-node chains, 6 trees
    each. Every tree's spread around the batch's rate (the recent trees' dispersion) mostly
    measures that difference; taken for noise, it hid the laggards. Each sequence's own trees
    tell the noise within a sequence apart from the spread between them, and both come out
    near their true values."""
    good, bad = (sum(p**i for i in range(1, 9)) for p in (0.9, 0.27))
    batch_rate = 0.75 * good + 0.25 * bad
    true_within = (0.75 * _chain_dispersion(0.9, 8) * good + 0.25 * _chain_dispersion(0.27, 8) * bad) / batch_rate
    true_spread = 0.75 * 0.25 * (good - bad) ** 2 / batch_rate**2
    for seed in range(4):
        rng = random.Random(seed)
        trees = [_trees(rng, 6, 0.27 if i % 4 == 0 else 0.9, 8) for i in range(32)]
        pooled = [a for t in trees for a in t]
        pooled_dispersion = np.var(pooled) / np.mean(pooled)
        spread = AcceptanceSpread.of(_draining([120] * 32, trees), pooled_dispersion)
        assert pooled_dispersion > 1.4 * true_within
        assert spread.within_dispersion == pytest.approx(true_within, rel=0.25)
        assert spread.measured == pytest.approx(true_spread, abs=0.1)
        assert spread.relative[::4].max() < 0.6  # shrunk halfway to the batch at most, with no prior yet


def test_a_batch_with_no_trees_yet_expects_the_spread_earlier_batches_had():
    """Without a prior every fresh batch counts its sequences alike, and a quarter of laggards
    went unseen for its first dozen steps; the spread carried over (relative variance 0.28
    for 25 % of the sequences at a tenth of the rest's rate) makes the reach that of a batch
    with laggards in it from the first step."""
    fresh = DrainingBatch([127] * 32, [0] * 32, [0] * 32, [0] * 32)
    alike = speculation_reach(fresh.remaining, 4.9, AcceptanceSpread.of(fresh, 1.0))
    expected = speculation_reach(fresh.remaining, 4.9, AcceptanceSpread.of(fresh, 1.0, prior=0.28))
    true_reach = (127 / 4.9) / (127 / (1 + 3.9 * 0.1))  # the laggards' pace sets the end
    assert alike > 0.8
    assert expected == pytest.approx(true_reach, abs=0.08)


def _closed_batches(controller, num_batches, steps, right, seed=2):
    """Feed the controller's draining view `num_batches` closed batches of 32 sequences that
    speculate `steps` steps with 8-node chains, sequence i's drafts right with probability right(i)."""
    rng = random.Random(seed)
    for _ in range(num_batches):
        trees = [[] for _ in range(32)]
        controller.nodes_per_sequence(32, draining=_draining([128] * 32, trees))
        for _ in range(steps):
            for i, t in enumerate(trees):
                t.extend(_trees(rng, 1, right(i), 8))
            controller.record_acceptance([8] * 32, [t[-1] for t in trees])
            controller.record_step(32, True, 32 * 4, 0.012)
            controller.nodes_per_sequence(32, draining=_draining([100] * 32, trees))
    return trees


def test_the_controller_carries_the_spread_from_batch_to_batch():
    """Learned once per batch, from its last estimate while three quarters of it decode. A
    quarter of the sequences at a tenth of the rest's rate: relative variance 0.28, expected
    once a few batches have shown it. Alike sequences teach nothing: the estimates' noise
    is taken off."""
    uneven = SpeculationController(8, 512)
    _closed_batches(uneven, 5, 12, lambda i: 0.27 if i % 4 == 0 else 0.9)
    assert uneven.spread_prior.value == pytest.approx(0.28, abs=0.1)
    alike = SpeculationController(8, 512)
    _closed_batches(alike, 5, 12, lambda i: 0.6)
    assert alike.spread_prior.value <= 0.0


def test_plain_steps_do_not_teach_the_spread_again():
    """A batch that turned speculation off after a few trees verifies none after them: its
    last estimate is learned once, when the next batch starts, however long it runs plainly."""
    controller = SpeculationController(8, 512)
    trees = _closed_batches(controller, 1, 6, lambda i: 0.27 if i % 4 == 0 else 0.9)
    for _ in range(40):
        controller.nodes_per_sequence(32, draining=_draining([90] * 32, trees))
    assert controller.spread_prior.value == 0.0  # nothing learned before the batch ends
    controller.nodes_per_sequence(32, draining=_draining([128] * 32, [[] for _ in range(32)]))
    once = controller.spread_prior.value
    assert once > 0.0
    controller.nodes_per_sequence(32, draining=_draining([128] * 32, [[] for _ in range(32)]))
    assert controller.spread_prior.value == once


def test_a_bucket_judges_its_options_per_sequence():
    """A bucket spans batch sizes up to twice apart. Speculation measured at 32 sequences and
    plain decoding at 20 (the batch had drained) compare per sequence: plain decoding's
    3200 tokens a second would have lost to speculation's 4000, although each sequence got
    160 a second from it against 125."""
    controller = SpeculationController(8, 512, min_samples=3)
    for _ in range(4):
        controller.record_step(32, True, 48, 0.012)
        controller.record_step(20, False, 160, 0.050)
    assert controller.speculation_pays(32) is False


def test_spec_stats_keep_the_sum_of_squared_accepted_tokens():
    from hetero.core.protocols import SpecStats

    stats = SpecStats()
    stats.record(4, 3)
    stats.record_batch([4, 4], [0, 2])
    assert (stats.num_accepted_tokens, stats.sum_squared_accepted) == (5, 13)


def test_accepted_dispersion_follows_the_measured_acceptance():
    sizer = TreeSizer(8, GRAPH_QUERY_BUCKETS)
    assert sizer.accepted_dispersion(3) == pytest.approx(_chain_dispersion(TreeSizer.PRIOR_ACCEPTANCE, 3))
    rng = random.Random(0)
    for _ in range(64):
        sizer.record([1] * 64, [int(rng.random() < 0.3) for _ in range(64)])
    assert sizer.accepted_dispersion(1) == pytest.approx(0.7, abs=0.03)  # Bernoulli: 1 - p


@pytest.mark.parametrize("batch,workload,at_least", [
    (32, Workload(0.6, mixed_share=0.25, mixed_factor=0.3), 0.95),  # 0.82x judged by the mean pace
    (64, Workload(0.6, mixed_share=0.25, mixed_factor=0.3), 0.96),  # 0.81x
    (4, Workload(0.3), 1.05),  # speculation that pays is kept: 1.12x either way
    (8, Workload(0.6), 1.5),
])
def test_closed_batches_are_judged_by_their_slowest_sequence(batch, workload, at_least):
    """Closed batches on the GPU host's clock (bench.spec_control_sim): where a quarter of the
    sequences draft badly, speculation that won on the mean pace lost 11-19 %, since the batch
    waits for those; judged by its reach, it is turned off."""
    runs = [speedups(SpeculationController, batch, workload, seed, new_tokens=128, repeats=3) for seed in range(3)]
    assert statistics.median(runs) >= at_least


@pytest.mark.parametrize("outlier", [dict(slow_first_plain=2.0), dict(fast_first_spec=2.0), {}])
def test_losing_speculation_costs_at_most_a_few_percent(outlier):
    ms_per_token, _ = simulate(SpeculationController(8, 64), steps=50, **BATCH_64, **outlier)
    plain_ms_per_token, _ = simulate(_Never(), steps=50, **BATCH_64, **outlier)
    assert ms_per_token <= 1.03 * plain_ms_per_token


@pytest.mark.parametrize("outlier", [dict(fast_first_spec=0.25), dict(slow_first_plain=0.5), {}])
def test_winning_speculation_is_used_most_of_the_time(outlier):
    ms_per_token, speculated = simulate(SpeculationController(8, 64), steps=50, **BATCH_1, **outlier)
    plain_ms_per_token, _ = simulate(_Never(), steps=50, **BATCH_1, **outlier)
    assert speculated >= 0.8
    assert ms_per_token <= 0.6 * plain_ms_per_token


# bench/results/gpu_decode-20261123-094712.json, batch 8 at draft_p 0.3: 3-node chains, 1.41 tokens
# per sequence per speculative step. At 8.08 ms a step speculation is 8 % faster than plain windows of
# 6.16 ms per token-step, with a step's tokens varying by about 18 %.
BATCH_8_NOISY = dict(num_seqs=8, plain_ms=6.16, spec_ms=8.08, nodes=3, p_accept=0.3)


def test_noisy_speculation_that_wins_stays_on():
    """An unlucky window of a small batch's speculative steps must not hand the verdict back to
    plain decoding: it returns only when it is faster by more than the speculative estimate's
    standard error. Returning as soon as it measured faster speculated 37 % of the steps here and
    kept 0.6 % of the 8 %."""
    ms_per_token, speculated = simulate(SpeculationController(8, 512), steps=800, **BATCH_8_NOISY)
    plain_ms_per_token, _ = simulate(_Never(), steps=800, **BATCH_8_NOISY)
    assert speculated >= 0.8
    assert ms_per_token <= plain_ms_per_token / 1.025


class _PlainSpy(SpeculationController):
    """Always chooses plain decoding and keeps what the engine asks and records."""

    def __init__(self):
        super().__init__(8, 64)
        self.asked = []  # (batch size, the draining batch or None) of each decision
        self.records = []
        self.not_judged = []  # batch sizes of the steps the engine said were not judged (`probe_not_judged`)
        self.switches = []  # (batch size, draft wait) of the speculative steps right after plain ones (`record_switch`)

    def nodes_per_sequence(self, num_seqs, explore=True, draining=None):
        self.asked.append((num_seqs, draining))
        return 0

    def record_step(self, *args):
        self.records.append(args)

    def record_switch(self, num_seqs, draft_wait):
        self.switches.append((num_seqs, draft_wait))

    def probe_not_judged(self, num_seqs):
        self.not_judged.append(num_seqs)


class _IdleProposer(Proposer):
    def propose(self, batch):
        raise AssertionError("the spy never speculates")

    def commit(self, verdicts):
        pass

    def release(self, request_id):
        pass


class _StepClock:
    """Every engine step takes 10 ms; the test moves time on between steps (the caller's work)."""

    def __init__(self):
        self.now, self.reads = 0.0, 0

    def __call__(self):
        self.reads += 1
        if self.reads % 2 == 0:  # a step reads the clock when it starts and when it ends
            self.now += 0.010
        return self.now


def test_a_step_is_cut_short_when_ending_requests_take_a_tenth_of_it():
    from hetero.spec.controller import cut_short

    assert not cut_short([100] * 63 + [2], tokens_per_seq=8)  # one request of 64 ending: a server's usual step
    assert cut_short([100] * 8 + [1] * 56, tokens_per_seq=8)  # the batch's last window
    assert cut_short([5], tokens_per_seq=8)
    assert not cut_short([9], tokens_per_seq=9)


def test_engine_counts_the_callers_time_and_leaves_out_windows_cut_short(tiny_llama_dir):
    from hetero.core.config import EngineConfig
    from hetero.engine import LLMEngine
    from hetero.core.sampling_params import SamplingParams

    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", num_scheduler_steps=4)
    engine = LLMEngine(config, proposer=_IdleProposer())
    engine.spec_control = spy = _PlainSpy()
    engine.clock = clock = _StepClock()
    engine.add_request("r", "Hello, my name is", SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True))
    engine.step()  # the prefill samples the first token; not a decode step, not recorded
    # 22 tokens follow in windows of 4, 4, 4, 4, 4 and a last one cut to 2 by max_tokens.
    for gap in [0.003, 0.003, 0.050, 0.003, 0.003, 0.003]:
        clock.now += gap
        engine.step()
    assert not engine.has_unfinished_requests()
    seconds = [round(s, 6) for _, _, _, s, _ in spy.records]
    # Caller time up to the step's own counts; a longer gap is idle time and does not.
    assert seconds == [0.013, 0.013, 0.010, 0.013, 0.013]
    assert [(n, speculated, tokens) for n, speculated, tokens, _, _ in spy.records] == [(1, False, 4)] * 5


class _AlternatingSpy(_PlainSpy):
    """Speculates (2 nodes) at every other step, plainly between; keeps what the engine records."""

    def nodes_per_sequence(self, num_seqs, explore=True, draining=None):
        self.asked.append((num_seqs, draining))
        return 2 if len(self.asked) % 2 else 0


class _SlowProposer(_IdleProposer):
    """Empty trees after a draft wait of 40 ms on the engine's clock."""

    def __init__(self, clock):
        self.clock = clock

    def propose(self, batch):
        self.clock.now += 0.040
        return [TokenTree.empty() for _ in batch]


class _SlowDraftingAheadProposer(_SlowProposer):
    """As `_SlowProposer`, told of steps without trees (`DraftsAhead`), as the CPU draft worker is."""

    def observe(self, batch):
        pass


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("drafts_ahead", [True, False])
def test_a_draft_wait_counts_for_the_step_that_waited_for_it(tiny_llama_dir, async_scheduling, drafts_ahead):
    """Under async scheduling the next step is proposed (and waits for drafts) before this
    one is recorded: that wait must not make a plain window look slow. A proposer that
    drafts ahead shows the wait of its first step after plain steps as a switch's; one with
    nothing to catch up on (the lookahead cache) has that step judged as any other."""
    from hetero.core.config import EngineConfig
    from hetero.engine import LLMEngine
    from hetero.core.sampling_params import SamplingParams

    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", num_scheduler_steps=4,
                          async_scheduling=async_scheduling)
    clock = SimpleNamespace(now=0.0)
    engine = LLMEngine(config, proposer=(_SlowDraftingAheadProposer if drafts_ahead else _SlowProposer)(clock))
    engine.spec_control = spy = _AlternatingSpy()
    engine.clock = lambda: clock.now
    engine.add_request("r", "Hello, my name is", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    recorded = [(speculated, round(seconds, 6), round(waited, 6)) for _, speculated, _, seconds, waited in spy.records]
    assert {True, False} <= {speculated for speculated, _, _ in recorded}
    # The step's time holds its own wait, and the controller is told which part of it that was.
    assert all(seconds == waited == (0.040 if speculated else 0.0) for speculated, seconds, waited in recorded), recorded
    # Each speculative step after a plain one shows its wait as a switch's (`record_switch`), or is recorded.
    if drafts_ahead:
        assert len(spy.switches) >= 3 and all(round(wait, 6) == 0.040 for _, wait in spy.switches), spy.switches
    else:
        assert spy.switches == [] and sum(speculated for speculated, _, _ in recorded) >= 3


def test_offline_generate_drains_its_batch_once_no_request_waits(tiny_llama_dir):
    """`LLM.generate` returns when its last request is done, so once no request waits for a
    slot its batch drains; a server's engine (the engine alone) never does."""
    from hetero import LLM
    from hetero.core.sampling_params import SamplingParams

    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", device="cpu", max_num_seqs=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    llm.llm_engine.spec_control = spy = _PlainSpy()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 12, 6)]
    llm.generate(["Hello, my name is", "The capital of France is", "One, two,"], params, use_tqdm=False)
    # Two requests decode while the third waits; from the step that admits it, nothing waits.
    first = [draining is not None for _, draining in spy.asked].index(True)
    assert first > 0 and spy.asked[:first] == [(2, None)] * first
    assert all(draining is not None for _, draining in spy.asked[first:])
    # Each decision sees the decoding sequences' tokens left under their max_tokens: the one of
    # 12 tokens runs on alone, from 11 left (its first token came from prefill) down to 1.
    # Each sees the decoding sequences' tokens left under their max_tokens: the 12-token request
    # alone at 8 left while the 6-token one is admitted (prefill gives it its first token), then both.
    assert [(n, draining.remaining) for n, draining in spy.asked[first:]] == [
        (1, [8]), (2, [7, 5]), (2, [6, 4]), (2, [5, 3]), (2, [4, 2]), (2, [3, 1]), (1, [2]), (1, [1])]

    engine = llm.llm_engine
    engine.waits_for_all = False
    engine.spec_control = spy = _PlainSpy()
    engine.add_request("alone", "Hello, my name is", params[1])
    while engine.has_unfinished_requests():
        engine.step()
    assert spy.asked and all(draining is None for _, draining in spy.asked)


# --------------------------------------------------------------- per-sequence draft back-off

def _outcomes(backoff, accepted_by_tree):
    """Feed a DraftBackoff decode steps; `accepted_by_tree` gives the accepted count of each tree
    it grants, in order. Returns the steps as 'T' (a tree) or '.' (withheld)."""
    from hetero.spec.backoff import DraftBackoff

    assert isinstance(backoff, DraftBackoff)
    steps = []
    for accepted in accepted_by_tree:
        while not backoff.grants_tree():
            steps.append(".")
        steps.append("T")
        backoff.record(accepted)
    return "".join(steps)


def test_draft_backoff_grows_while_the_drafts_keep_missing():
    from hetero.spec.backoff import DraftBackoff

    backoff = DraftBackoff()
    misses = DraftBackoff.MISSES_BEFORE_BACKOFF
    # The run of misses, then 4 steps without a tree, a probe that misses, 8, a probe, 16, a probe, 32, a probe, 32 (capped).
    got = _outcomes(backoff, [0] * (misses + 5))
    assert got == "T" * misses + "." * 4 + "T" + "." * 8 + "T" + "." * 16 + "T" + "." * 32 + "T" + "." * 32 + "T"
    assert DraftBackoff.MAX_BACKOFF == 32


def test_an_accepted_probe_ends_the_backoff():
    from hetero.spec.backoff import DraftBackoff

    backoff = DraftBackoff()
    misses = DraftBackoff.MISSES_BEFORE_BACKOFF
    got = _outcomes(backoff, [0] * (misses + 1) + [2] + [0] * misses + [0])
    # After the accepting probe the sequence speculates again, and the next run of misses
    # starts over: the whole run before a back-off, which is the first one's length again.
    assert got == "T" * misses + "...." + "T" + "........" + "T" + "T" * misses + "...." + "T"


def test_any_acceptance_resets_the_run_of_misses():
    from hetero.spec.backoff import DraftBackoff

    backoff = DraftBackoff()
    run = [0] * (DraftBackoff.MISSES_BEFORE_BACKOFF - 1)
    assert _outcomes(backoff, run + [1] + run + [1] + run) == "T" * (3 * len(run) + 2)


def test_drafts_right_a_third_of_the_time_keep_their_trees():
    """Chance runs of misses must not withhold trees that pay: at p = 0.3 a 3-node tree brings
    0.42 tokens a step. A back-off after 8 misses withheld them 28 % of a 90-step run."""
    from hetero.spec.backoff import DraftBackoff

    rng = random.Random(0)
    granted = total = 0
    for _ in range(200):
        backoff = DraftBackoff()
        for _ in range(90):
            total += 1
            if backoff.grants_tree():
                granted += 1
                backoff.record(int(rng.random() < 0.3))
    assert granted >= 0.95 * total


class _AlwaysSpeculate(SpeculationController):
    """Grants the node budget at every step, as a measured verdict of "speculate" would,
    without always_speculate (which turns the per-sequence back-off off)."""

    def nodes_per_sequence(self, num_seqs, explore=True, draining=False):
        return min(self.max_nodes_per_seq, self.target_parallelism // max(num_seqs, 1))

    def record_step(self, *args):
        pass


class _RightOrWrongProposer(Proposer):
    """Chains along the known greedy continuation for requests named 'right*', and of wrong tokens for the rest."""

    def __init__(self, truth):
        self.truth = truth  # prompt token ids -> greedy output token ids
        self.requests = []  # (request id, max_nodes) of every proposal request

    def propose(self, batch):
        import numpy as np

        from hetero.core.protocols import TokenTree

        trees = []
        for request in batch:
            self.requests.append((request.request_id, request.max_nodes))
            if request.max_nodes == 0:
                trees.append(TokenTree.empty())
                continue
            truth = self.truth[tuple(request.token_ids[: request.num_prompt_tokens])]
            done = len(request.token_ids) - request.num_prompt_tokens
            want = (truth[done:] + [0] * request.max_nodes)[: request.max_nodes]
            tokens = want if request.request_id.startswith("right") else [(t + 1) % 256 for t in want]
            trees.append(TokenTree(np.array(tokens), np.arange(-1, len(tokens) - 1)))
        return trees

    def commit(self, verdicts):
        pass

    def release(self, request_id):
        pass

    def budgets(self, request_id):
        return [n for r, n in self.requests if r == request_id]


def _greedy_truth(model_dir, prompts, max_tokens):
    from hetero import LLM
    from hetero.core.sampling_params import SamplingParams

    plain = LLM(model=str(model_dir), max_model_len=256, dtype="float32", device="cpu")
    outs = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outs}


def _spec_engine(model_dir, truth, **kwargs):
    from hetero.core.config import EngineConfig
    from hetero.engine import LLMEngine

    proposer = _RightOrWrongProposer(truth)
    config = EngineConfig(model=str(model_dir), max_model_len=256, dtype="float32", device="cpu", **kwargs)
    engine = LLMEngine(config, proposer=proposer)
    engine.spec_control = _AlwaysSpeculate(engine.spec_control.max_nodes_per_seq, engine.spec_control.target_parallelism)
    return engine, proposer


def _run(engine):
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                outputs[tuple(out.prompt_token_ids)] = out.outputs[0].token_ids
    return outputs, steps


def test_a_sequence_whose_drafts_always_miss_stops_getting_trees(tiny_llama_dir):
    from hetero.core.sampling_params import SamplingParams

    prompts = ["Hello, my name is", "The capital of France is"]
    truth = _greedy_truth(tiny_llama_dir, prompts, 90)
    engine, proposer = _spec_engine(tiny_llama_dir, truth, num_speculative_tokens=2)
    params = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    engine.add_request("wrong", prompts[0], params)
    engine.add_request("right", prompts[1], params)
    outputs, _ = _run(engine)
    assert outputs == truth
    # The right one speculates at every decode step until its last token: 2 accepted nodes and a bonus each.
    right = proposer.budgets("right#0")
    assert right[:19] == [2] * 19 and 0 not in right[:-1]
    # The wrong one is withheld its tree after its run of misses, for 4 steps, then probed, then 8 steps ...
    from hetero.spec.backoff import DraftBackoff

    misses = DraftBackoff.MISSES_BEFORE_BACKOFF
    wrong = proposer.budgets("wrong#0")
    assert wrong[: misses + 11] == [2] * misses + [0] * 4 + [2] + [0] * 6
    assert engine.num_trees_withheld >= 10
    # Once the right one has finished, the wrong one's withheld steps are plain: the proposer is not asked.
    assert len(wrong) < len(right) + 3


def test_a_lone_sequence_whose_drafts_miss_decodes_in_multi_step_windows(tiny_llama_dir):
    from hetero.core.sampling_params import SamplingParams

    prompt = "Hello, my name is"
    truth = _greedy_truth(tiny_llama_dir, [prompt], 100)
    engine, proposer = _spec_engine(tiny_llama_dir, truth, num_speculative_tokens=4, num_scheduler_steps=8)
    windows = []
    decode_steps = engine.runner.decode_steps

    def spy(chunks, num_steps, pick):
        windows.append(num_steps)
        return decode_steps(chunks, num_steps, pick)

    engine.runner.decode_steps = spy
    engine.add_request("wrong", prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    outputs, steps = _run(engine)
    assert outputs == truth
    assert engine.spec_stats.num_accepted_tokens == 0
    # After the prefill's token: the run of missing trees, 4 windows of 8, a probe that misses, then
    # windows of 8 to the end (8 of them before the next probe). Without the back-off every one of
    # the 99 decode steps speculates, one token each.
    from hetero.spec.backoff import DraftBackoff

    assert engine.spec_stats.num_steps <= DraftBackoff.MISSES_BEFORE_BACKOFF + 4
    assert windows[:4] == [8] * 4 and sum(windows) >= 80
    assert steps <= 1 + (DraftBackoff.MISSES_BEFORE_BACKOFF + 4) + 12


def test_always_speculate_keeps_every_tree(tiny_llama_dir):
    """Tests and cost benchmarks that force speculation verify trees whatever they hold."""
    from hetero.core.sampling_params import SamplingParams

    prompt = "Hello, my name is"
    truth = _greedy_truth(tiny_llama_dir, [prompt], 20)
    engine, proposer = _spec_engine(tiny_llama_dir, truth, num_speculative_tokens=2)
    engine.spec_control.always_speculate = True
    engine.add_request("wrong", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    outputs, _ = _run(engine)
    assert outputs == truth
    assert proposer.budgets("wrong#0") == [2] * 17 + [1]  # the last token has no room for a tree
    assert engine.num_trees_withheld == 0


def test_an_unmeasured_step_follows_the_verdict_without_exploring_or_probing():
    controller = SpeculationController(8, 64, probe_interval=4, window=4)
    assert controller.nodes_per_sequence(8, explore=False) == 0  # no verdict yet: plain
    assert controller._buckets == {}  # and nothing started: exploring is for measured steps
    drive(controller, 8, spec_tps=2000.0, plain_tps=1000.0, steps=6)
    assert controller.speculation_pays(8) is True
    state = controller._buckets[controller.bucket(8)]
    countdown = state.countdown
    assert all(controller.nodes_per_sequence(8, explore=False) == 8 for _ in range(50))
    assert state.countdown == countdown  # fifty unmeasured steps brought no probe nearer
    assert controller.nodes_per_sequence(4, explore=False) == 8  # a smaller batch inherits speculation
    drive(controller, 32, spec_tps=500.0, plain_tps=1000.0, steps=6)
    assert controller.nodes_per_sequence(32, explore=False) == 0
    assert controller.nodes_per_sequence(64, explore=False) == 0  # plain at 32 is kept at 64


GRAPH_QUERY_BUCKETS = [1, 2, 4, 8, 9]  # the CUDA-graph query ladder of max_num_seqs 64, 8 nodes


def _sizer_after(p_accept, tree_nodes=8, trees=4096, query_buckets=GRAPH_QUERY_BUCKETS, seed=0):
    """A TreeSizer that has verified `trees` chains of `tree_nodes` nodes, each node right with probability p."""
    from hetero.spec.tree_sizer import TreeSizer

    rng = random.Random(seed)
    sizer = TreeSizer(8, query_buckets)
    for _ in range(trees // 64):
        sizer.record([tree_nodes] * 64, [_accepted(rng, tree_nodes, p_accept) for _ in range(64)])
    return sizer


def test_tree_size_starts_from_a_prior_until_acceptance_is_measured():
    """Until measured: the whole chain at batch 1, where rows are nearly free, three nodes (a
    4-row graph) at batch 64."""
    from hetero.spec.tree_sizer import TreeSizer

    sizer = TreeSizer(8, GRAPH_QUERY_BUCKETS)
    assert sizer.best_size(8, 1) == 8 and sizer.best_size(8, 64) == 3
    sizer.record([8] * 15, [0] * 15)  # fewer trees than a measurement takes
    assert sizer.best_size(8, 64) == 3
    sizer.record([8] * 2, [0] * 2)
    assert sizer.best_size(8, 64) == 1


def test_tree_size_follows_acceptance_and_batch_size():
    """The sizes the verification costs measured on the GPU host favour: at batch 64 one node
    at p = 0.3 and three (a full 4-row graph) at p = 0.6; at batch 8, where rows cost less,
    three at p = 0.3 and the whole chain at p = 0.9."""
    assert _sizer_after(0.3).best_size(8, 64) == 1
    assert _sizer_after(0.6).best_size(8, 64) == 3
    assert _sizer_after(0.9).best_size(8, 64) == 8
    assert _sizer_after(0.3).best_size(8, 8) == 3
    assert _sizer_after(0.9).best_size(8, 8) == 8
    # Within the budget only, and rows rounded to the graph bucket: 2 nodes fill a 4-row graph as 3 would.
    assert _sizer_after(0.9).best_size(2, 64) == 2
    # Without graphs (the CPU) the cost model does not apply: the budget alone decides.
    assert _sizer_after(0.3, query_buckets=None).best_size(8, 64) == 8


def test_measured_acceptance_by_position():
    sizer = _sizer_after(0.5, trees=64 * 200)
    assert sizer.acceptance_at_least()[:4] == pytest.approx([0.5, 0.25, 0.125, 0.0625], abs=0.03)


def test_a_tree_cut_short_grows_back_when_its_nodes_are_accepted():
    """Positions past the trees' length are extrapolated at the last measured rate: one-node
    trees accepted 90 % of the time predict deeper ones worth verifying."""
    sizer = _sizer_after(0.9, tree_nodes=1)
    assert sizer.acceptance_at_least()[:3] == pytest.approx([0.9, 0.81, 0.729], abs=0.03)
    assert sizer.best_size(8, 64) == 8


def test_tree_size_follows_a_change_of_workload():
    sizer = _sizer_after(0.9)
    assert sizer.best_size(8, 64) == 8
    rng = random.Random(1)
    for _ in range(64):  # 4096 sequence-steps of drafts that are right 30 % of the time: 8 half-lives
        sizer.record([8] * 64, [_accepted(rng, 8, 0.3) for _ in range(64)])
    assert sizer.best_size(8, 64) == 1


def test_the_controller_sizes_trees_within_the_budget():
    controller = SpeculationController(8, 512, query_buckets=GRAPH_QUERY_BUCKETS)
    rng = random.Random(2)
    for _ in range(64):
        controller.record_acceptance([8] * 64, [_accepted(rng, 8, 0.6) for _ in range(64)])
    assert controller.tree_sizer.best_size(8, 64) == 3
    speculated = [controller.nodes_per_sequence(64) for _ in range(2)]
    assert 3 in speculated and set(speculated) <= {0, 3}
    assert SpeculationController(8, 512, always_speculate=True).nodes_per_sequence(64) == 8


def test_engine_records_how_deep_each_tree_was_accepted(tiny_llama_dir):
    from hetero.core.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": [3 + i, 7, 11 + i]} for i in range(8)]
    truth = _greedy_truth(tiny_llama_dir, prompts, 48)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for kind, expected in (("right", 1.0), ("wrong", 0.0)):
        engine, _ = _spec_engine(tiny_llama_dir, truth)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{kind}-{i}", prompt, params)
        _run(engine)
        sizer = engine.spec_control.tree_sizer
        assert sizer.offered[1] >= sizer.MIN_TREES
        assert sizer.acceptance_at_least()[0] == pytest.approx(expected)


class _SpeculatingSpy(_PlainSpy):
    def nodes_per_sequence(self, num_seqs, explore=True, draining=None):
        return 4


class _WarmingProposer(_IdleProposer):
    """Not ready for its first four proposals (a draft worker prefilling the prompt), then ready with nothing."""

    def __init__(self):
        self.asked = 0

    def observe(self, batch):
        pass

    def propose(self, batch):
        self.asked += 1
        return [TokenTree.pending() if self.asked <= 4 else TokenTree.empty() for _ in batch]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_without_a_tree_because_the_proposer_was_not_ready_are_not_judged(tiny_llama_dir, async_scheduling):
    from hetero.core.config import EngineConfig
    from hetero.engine import LLMEngine
    from hetero.core.sampling_params import SamplingParams

    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", async_scheduling=async_scheduling,
                          num_scheduler_steps=4)
    engine = LLMEngine(config, proposer=_WarmingProposer())
    engine.spec_control = spy = _SpeculatingSpy()
    engine.add_request("r", "Hello, my name is", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    emitted = []
    for _ in range(8):
        engine.step()  # the prefill, four steps whose trees were pending, three whose proposer had nothing
        emitted.append(engine.num_generation_tokens_total)
    assert engine.proposer.asked == (8 if async_scheduling else 7)  # async: the eighth call launched the next step too
    # The second pending answer in a row runs a plain window of 4 instead of a single step.
    assert emitted == [1, 2, 6, 7, 11, 12, 13, 14]
    # An empty answer is what speculation delivered (one token at a verification's cost); a pending one is not.
    # The first after the window is a switch (its wait the proposer's catch-up), told apart.
    assert [(n, speculated, tokens) for n, speculated, tokens, _, _ in spy.records] == [(1, True, 1)] * 2
    assert [n for n, _ in spy.switches] == [1]
    assert spy.not_judged == [1] * 4  # and the controller hears of each pending one (a probe is taken again)
    assert engine.num_unready_steps == 4  # counted (hetero:spec_decode_unready_steps)


class _PrefillingProposer(_WarmingProposer):
    """Pending for another second (`KnowsWhenReady`: a draft worker prefilling a batch's
    prompts) until the test sets ``ready``."""

    def __init__(self):
        super().__init__()
        self.told = 0
        self.ready = False

    def observe(self, batch):
        self.told += 1

    def ready_in(self):
        return 0.0 if self.ready else 1.0

    def propose(self, batch):
        self.asked += 1
        return [TokenTree.empty() if self.ready else TokenTree.pending() for _ in batch]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_proposer_that_says_when_it_will_be_ready_is_not_asked_before_then(tiny_llama_dir, async_scheduling):
    """Without the estimate a worker prefilling prompts is asked at every other step, each time
    a wait for nothing and a single step in place of a window (a loss at batch 64); with it,
    after the second pending answer in a row, not until it expects to be ready."""
    from hetero.core.config import EngineConfig
    from hetero.engine import LLMEngine
    from hetero.core.sampling_params import SamplingParams

    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", async_scheduling=async_scheduling,
                          num_scheduler_steps=4)
    proposer = _PrefillingProposer()
    engine = LLMEngine(config, proposer=proposer)
    engine.spec_control = _SpeculatingSpy()
    now = [0.0]
    engine.clock = lambda: now[0]  # time stands still until the test moves it
    engine.add_request("r", "Hello, my name is", SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    for _ in range(6):
        engine.step()  # the prefill, a single step and a window answered pending, then plain windows
    assert proposer.asked == 2
    assert engine.num_generation_tokens_total >= 2 + 4 * 3 and proposer.told >= 4  # windows, the proposer told of each
    now[0] += 1.5  # past the estimate
    proposer.ready = True
    engine.step()
    engine.step()
    assert proposer.asked > 2  # asked again once its estimate has passed


def _plain_verdict_at_batch_1() -> SpeculationController:
    """A controller that measured speculation slower than plain decoding at batch 1."""
    controller = SpeculationController(max_nodes_per_seq=4, target_parallelism=64)
    for _ in range(40):
        speculate = controller.nodes_per_sequence(1) > 0
        controller.record_step(1, speculate, 2 if speculate else 1, 0.012 if speculate else 0.005)
        if controller.speculation_pays(1) is False:
            return controller
    raise AssertionError("no plain verdict")


def _run_plain_until_the_probe(controller: SpeculationController) -> int:
    for step in range(10_000):
        if controller.nodes_per_sequence(1):
            return step
        controller.record_step(1, False, 1, 0.005)
    raise AssertionError("no probe")


def test_a_probe_that_got_only_pending_trees_is_taken_again_at_the_next_step():
    """A draft worker told of plain windows answers the probe after them with pending trees;
    with more plain windows before the next probe, that one would be pending too, for ever."""
    controller = _plain_verdict_at_batch_1()
    _run_plain_until_the_probe(controller)
    controller.probe_not_judged(1)
    assert controller.nodes_per_sequence(1) == 4  # probed again at once
    controller.record_step(1, True, 2, 0.012)  # judged this time: it lost again
    assert controller.nodes_per_sequence(1) == 0
    assert _run_plain_until_the_probe(controller) > 8  # and the next probe comes at its spacing


def test_a_probe_is_taken_again_once_only():
    """A worker prefilling prompts answers pending for many steps: the second probe not judged
    either waits for the next spaced probe, not a probe every other step."""
    controller = _plain_verdict_at_batch_1()
    _run_plain_until_the_probe(controller)
    controller.probe_not_judged(1)
    assert controller.nodes_per_sequence(1) == 4  # the second probe
    controller.probe_not_judged(1)  # not judged either
    assert controller.nodes_per_sequence(1) == 0
    assert _run_plain_until_the_probe(controller) > 8


def test_a_judged_probe_or_a_speculating_verdict_is_not_probed_again():
    controller = _plain_verdict_at_batch_1()
    _run_plain_until_the_probe(controller)
    controller.record_step(1, True, 2, 0.012)  # the probe was judged
    assert controller.nodes_per_sequence(1) == 0
    speculating = SpeculationController(max_nodes_per_seq=4, target_parallelism=64)
    for _ in range(40):
        speculate = speculating.nodes_per_sequence(1) > 0
        speculating.record_step(1, speculate, 5 if speculate else 1, 0.008 if speculate else 0.005)
    assert speculating.speculation_pays(1) is True
    speculating.probe_not_judged(1)  # a speculative step that got pending trees: nothing to probe
    decisions = [speculating.nodes_per_sequence(1) for _ in range(3)]
    assert decisions == [4, 4, 4]
    SpeculationController(max_nodes_per_seq=4, target_parallelism=64).probe_not_judged(1)  # nothing measured yet: a no-op


class _CatchingUpProposer(_IdleProposer):
    """As the draft worker: told of plain steps (`observe`), its next answer is pending (the
    proposal arrives before its catch-up ran); otherwise a chain for each sequence."""

    def __init__(self):
        self.told, self.chains = False, 0

    def observe(self, batch):
        self.told = True

    def propose(self, batch):
        if self.told:
            self.told = False
            return [TokenTree.pending() for _ in batch]
        self.chains += len(batch)
        return [TokenTree.chain([1, 2]) for _ in batch]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_proposer_pending_after_each_plain_window_still_gets_to_speculate(tiny_llama_dir, async_scheduling):
    """The first pending answer gets a single step, not a window: a window would tell the
    worker of more plain tokens, and its next answer would be pending again, for ever."""
    from hetero.core.config import EngineConfig
    from hetero.engine import LLMEngine
    from hetero.core.sampling_params import SamplingParams

    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", async_scheduling=async_scheduling,
                          num_scheduler_steps=4)
    engine = LLMEngine(config, proposer=_CatchingUpProposer())
    engine.spec_control = _SpeculatingSpy()
    engine.add_request("r", "Hello, my name is", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()  # the prefill (the worker is told of it), a pending answer, then chains
    assert engine.proposer.chains >= 2 and engine.spec_stats.num_draft_tokens >= 2


class _ObservingProposer(_IdleProposer):
    """Told of plain steps (`observe`); records it in a shared event list."""

    def __init__(self, events):
        self.events = events

    def observe(self, batch):
        self.events.append("observe")


def test_a_drafting_ahead_proposer_hears_of_a_plain_step_after_the_next_launch(tiny_llama_dir):
    """Under async scheduling the device idles from a step's results to the next launch: the
    message telling the draft worker of a plain step's tokens is built after that launch."""
    from hetero.core.config import EngineConfig
    from hetero.engine import LLMEngine
    from hetero.core.sampling_params import SamplingParams

    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", async_scheduling=True,
                          num_scheduler_steps=4)
    events = []
    engine = LLMEngine(config, proposer=_ObservingProposer(events))
    engine.spec_control = _PlainSpy()
    for name in ("forward", "decode_steps"):
        original = getattr(engine.runner, name)
        setattr(engine.runner, name, lambda *a, _f=original, **kw: events.append("launch") or _f(*a, **kw))
    engine.add_request("r", "Hello, my name is", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    while engine.has_unfinished_requests():
        events.append("step")
        engine.step()
    steps = " ".join(events).split("step")[1:]
    told = [step.split() for step in steps if "observe" in step]
    assert len(told) >= 4  # the prefill and the plain windows
    # Each told after its step launched the next (the first step also launched its own prefill);
    # the last step launches nothing.
    assert all(step[-2:] == ["launch", "observe"] for step in told[:-1]) and told[-1] == ["observe"]


def test_step_times_leave_out_a_rare_pause_but_keep_frequent_waits():
    from hetero.spec.controller import trimmed_mean_seconds

    assert trimmed_mean_seconds([0.010] * 15 + [0.5]) == pytest.approx(0.010)  # one pause in 16 steps
    assert trimmed_mean_seconds([0.010, 0.011, 0.3]) == pytest.approx(0.0105)  # a cold start among the first three
    waits = [0.008] * 11 + [0.020] * 5  # a draft worker that makes every third step wait 12 ms
    assert trimmed_mean_seconds(waits) == pytest.approx((11 * 0.008 + 3 * 0.020) / 14)
    assert trimmed_mean_seconds(waits) > statistics.median(waits) * 1.3


def test_speculation_whose_steps_often_wait_for_drafts_loses_to_plain_decoding():
    """Speculative steps emit 1.75 tokens a sequence in 9 ms, but every third one waits 12 ms more
    for its drafts: 1.75 / 13 ms on average against plain decoding's 1 / 5.8 ms. By the median
    step (9 ms) speculation would look 12 % ahead."""
    controller = SpeculationController(max_nodes_per_seq=4, target_parallelism=64)
    speculated = 0
    for step in range(400):
        nodes = controller.nodes_per_sequence(8)
        if nodes:
            seconds = 0.009 + (0.012 if speculated % 3 == 2 else 0.0)
            controller.record_step(8, True, tokens_emitted=14, seconds=seconds)
            speculated += 1
        else:
            controller.record_step(8, False, tokens_emitted=64, seconds=8 * 0.0058)
    assert controller.speculation_pays(8) is False
    assert speculated < 80  # exploration and probes only



def _speculation_with_stalls(stalls_wait_for_drafts: bool) -> tuple[int, Optional[bool]]:
    """Speculative steps emit 1.5 tokens in 7 ms, and 2 in 16 take 25 ms more; plain decoding
    emits 1 in 5 ms. On average a speculative step takes 7 + 2 x 25 / 16 = 10.1 ms: 0.15 tokens
    a ms against plain's 0.2. Without its slow steps speculation would look 7 % ahead."""
    controller = SpeculationController(max_nodes_per_seq=4, target_parallelism=64)
    speculated = 0
    for _ in range(400):
        if controller.nodes_per_sequence(1):
            stall = 0.025 if speculated % 16 in (5, 13) else 0.0
            controller.record_step(1, True, tokens_emitted=1 + speculated % 2, seconds=0.007 + stall,
                                   draft_wait=stall if stalls_wait_for_drafts else 0.0)
            speculated += 1
        else:
            controller.record_step(1, False, tokens_emitted=8, seconds=8 * 0.005)
    return speculated, controller.speculation_pays(1)


def test_a_draft_workers_stalls_count_where_pauses_of_the_engine_do_not():
    """A CPU draft worker's stalls (its late replies) are the draft's cost: 0.96x plain on a lent
    H100 host, with speculation left on, when they were trimmed as pauses were."""
    speculated, pays = _speculation_with_stalls(stalls_wait_for_drafts=True)
    assert pays is False and speculated < 80  # exploration and probes only
    speculated, pays = _speculation_with_stalls(stalls_wait_for_drafts=False)  # the engine's own pauses: left out
    assert pays is True and speculated > 300


def _batch_8_after_a_burst_of_stalls(switches_told: bool) -> list[bool]:
    """Batch 8 on a fake clock: a speculative step emits 2 tokens a sequence in 6.3 ms plus a
    1 ms wait for drafts, a plain window 8 a sequence in 8 x 4.5 ms (speculation 1.23x ahead).
    Speculative steps 100-104 stall (15 ms waits, half the tokens), which turns speculation
    off. The first speculative step after plain steps waits 8 ms more: the draft worker
    catching up on the window's tokens. ``switches_told``: the engine shows that step as a
    switch (`record_switch`), not as a step. Returns whether each step speculated."""
    controller = SpeculationController(max_nodes_per_seq=4, target_parallelism=64)
    decisions, previous_plain = [], False
    for step in range(1500):
        speculate = controller.nodes_per_sequence(8) > 0
        if speculate:
            stall = 100 <= step < 105
            wait = (0.015 if stall else 0.001) + (0.008 if previous_plain else 0.0)
            if previous_plain and switches_told:
                controller.record_switch(8, wait)
            else:
                controller.record_step(8, True, 8 if stall else 16, 0.0063 + wait, draft_wait=wait)
        else:
            controller.record_step(8, False, 64, 8 * 0.0045)
        previous_plain = not speculate
        decisions.append(speculate)
    return decisions


def test_speculation_turned_off_by_a_burst_of_stalls_comes_back_once_its_probes_are_judged_past_the_switch():
    """A probe's first step after plain windows waits for the worker's catch-up (7.6 ms at
    batch 8 on an H200 host, 2026-11-28), which speculation that pays 1.2-1.3x cannot absorb:
    judged with it, every probe lost, and speculation stayed off for the rest of the run."""
    decisions = _batch_8_after_a_burst_of_stalls(switches_told=True)
    assert not all(decisions[105:200])  # the burst turned it off
    assert sum(decisions[-500:]) > 0.95 * 500
    decisions = _batch_8_after_a_burst_of_stalls(switches_told=False)
    assert sum(decisions[-500:]) < 0.05 * 500


def _probes_of_losing_speculation(switch_wait) -> list[float]:
    """Batch 8 on a fake clock for 60 s: speculation that loses (1.125 tokens a sequence in
    6.3 ms plus a 1 ms wait, against plain's 1 in 4.5 ms), whose first step after plain steps
    waits ``switch_wait(probes so far)`` for the draft worker to catch up. Returns when each
    probe against the plain verdict began."""
    controller = SpeculationController(max_nodes_per_seq=4, target_parallelism=64)
    now, previous_plain, probes = 0.0, False, []
    while now < 60.0:
        if controller.nodes_per_sequence(8):
            if previous_plain:
                if controller.speculation_pays(8) is False:
                    probes.append(now)
                wait = switch_wait(len(probes))
                controller.record_switch(8, wait)
                seconds = 0.0063 + wait
            else:
                seconds = 0.0063 + 0.001
                controller.record_step(8, True, 9, seconds, draft_wait=0.001)
            previous_plain = False
        else:
            seconds = 8 * 0.0045
            controller.record_step(8, False, 64, seconds)
            previous_plain = True
        now += seconds
    return probes


def test_a_switch_to_speculation_costs_at_most_a_hundredth_of_the_time_between_its_probes():
    """Switches that wait 21 ms (20 ms past the steady 1 ms): a probe every 16 step times, as
    for a thin window, would spend a fifth of the time switching."""
    from hetero.spec.controller import SWITCH_COST_SHARE

    probes = _probes_of_losing_speculation(lambda _: 0.021)
    assert len(probes) >= 5
    assert min(np.diff(probes)) >= 0.020 / SWITCH_COST_SHARE


def test_a_switch_that_fed_new_prompts_does_not_keep_speculation_off_for_long():
    """A switch whose catch-up also fed prompts just admitted (80 ms at a new batch) is not
    what switching costs: once a switch waited 8 ms (7 ms past the steady 1 ms), probes are
    0.7 s apart, not 7.5 s after every third switch (a new batch's)."""
    from hetero.spec.controller import SWITCH_COST_SHARE

    probes = _probes_of_losing_speculation(lambda count: 0.080 if count <= 1 or count % 3 == 0 else 0.008)
    gaps = np.diff(probes)
    assert len(probes) >= 6
    # (later, speculation that keeps losing is probed ever more rarely, as any solid verdict)
    assert max(gaps[1:8]) < 2 * (0.008 - 0.001) / SWITCH_COST_SHARE and min(gaps[1:8]) >= (0.008 - 0.001) / SWITCH_COST_SHARE


class _CatchUpAfterPlainStepsProposer(_RightOrWrongProposer):
    """Right chains, each answer 1 ms on the engine's clock, but 30 ms where a sequence grew by
    more than one speculative step since the last answer: the draft worker feeding a plain
    window's tokens before it can draft (the first answer, to a prompt, is 1 ms: the real
    worker answers pending until the prompt is prefilled)."""

    def __init__(self, truth, clock, cold_answers=0):
        super().__init__(truth)
        self.clock, self.lengths, self.cold_answers = clock, {}, cold_answers

    def observe(self, batch):
        pass  # told of plain steps, as the worker is: it feeds their tokens at the next proposal

    def propose(self, batch):
        behind = any(len(r.token_ids) - self.lengths.get(r.request_id, len(r.token_ids)) > r.max_nodes + 1 for r in batch)
        self.lengths.update((r.request_id, len(r.token_ids)) for r in batch)
        self.clock.now += 0.050 if len(self.requests) < self.cold_answers else 0.030 if behind else 0.001
        return super().propose(batch)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("cold_answers", [0, 3])
def test_speculation_whose_first_step_after_plain_steps_waits_for_a_catch_up_is_judged_past_it(tiny_llama_dir, async_scheduling,
                                                                                                 cold_answers):
    """A speculative step (10 ms) emits 5 tokens where a plain window of 4 steps (2.5 ms each)
    emits 4: speculation leads by 14 % at a 1 ms wait, and loses at the 30 ms catch-up after
    plain steps. Judged past that switch it is turned on, also after a cold start (the first
    answers 50 ms) turned it off: under async scheduling the probe after a switch must be the
    very next step, which is decided before the switch is recorded."""
    from hetero.core.config import EngineConfig
    from hetero.core.sampling_params import SamplingParams
    from hetero.engine import LLMEngine

    prompt = "Hello, my name is"
    truth = _greedy_truth(tiny_llama_dir, [prompt], 200)
    clock = SimpleNamespace(now=0.0)
    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", device="cpu", num_scheduler_steps=4,
                          num_speculative_tokens=4, async_scheduling=async_scheduling)
    engine = LLMEngine(config, proposer=_CatchUpAfterPlainStepsProposer(truth, clock, cold_answers))
    engine.spec_control = SpeculationController(engine.spec_control.max_nodes_per_seq, engine.spec_control.target_parallelism,
                                                probe_interval=8)
    engine.clock = lambda: clock.now
    forward, decode_steps = engine.runner.forward, engine.runner.decode_steps

    def timed_forward(*args, **kwargs):
        clock.now += 0.010
        return forward(*args, **kwargs)

    def timed_decode_steps(chunks, num_steps, *args, **kwargs):
        clock.now += 0.0025 * num_steps
        return decode_steps(chunks, num_steps, *args, **kwargs)

    engine.runner.forward, engine.runner.decode_steps = timed_forward, timed_decode_steps
    engine.add_request("right", prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    outputs, _ = _run(engine)
    assert list(outputs.values())[0] == list(truth.values())[0]
    assert engine.spec_control.speculation_pays(1) is True
    assert engine.spec_stats.num_draft_tokens > 0.5 * 200

