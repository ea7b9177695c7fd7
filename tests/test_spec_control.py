"""The speculation controller: node budget per sequence and the measured on/off decision."""
from hetero.spec_control import SpeculationController


def drive(controller, num_seqs, spec_tps, plain_tps, steps):
    """Run `steps` decisions against fixed measured throughputs; return how many speculated."""
    speculated = 0
    for _ in range(steps):
        nodes = controller.nodes_per_sequence(num_seqs)
        rate = spec_tps if nodes else plain_tps
        controller.record_step(num_seqs, bool(nodes), tokens_emitted=num_seqs, seconds=num_seqs / rate)
        speculated += bool(nodes)
    return speculated


def test_budget_shrinks_trees_as_the_batch_grows():
    controller = SpeculationController(max_nodes_per_seq=8, target_parallelism=64)
    assert controller.nodes_per_sequence(1) == 8
    assert controller.nodes_per_sequence(16) == 4
    assert controller.nodes_per_sequence(64) == 1
    assert controller.nodes_per_sequence(65) == 0


def test_losing_speculation_is_turned_off_and_probed_ever_more_rarely():
    controller = SpeculationController(8, 1024, probe_interval=4, max_probe_interval=256)
    first = drive(controller, 64, spec_tps=800.0, plain_tps=1000.0, steps=1000)
    assert controller.speculation_pays(64) is False
    # 1 speculative sample, then probes after 4, 4, 8, 16, ..., 256 plain steps (9 within 1000 steps).
    assert first <= 1 + 9
    later = drive(controller, 64, spec_tps=800.0, plain_tps=1000.0, steps=1024)
    assert later <= 1024 // 256


def test_winning_speculation_stays_on():
    controller = SpeculationController(8, 1024, probe_interval=4)
    speculated = drive(controller, 1, spec_tps=1500.0, plain_tps=1000.0, steps=500)
    assert controller.speculation_pays(1) is True
    assert speculated >= 500 - 3 - 10


def test_buckets_decide_independently():
    controller = SpeculationController(8, 1024, probe_interval=4)
    drive(controller, 1, spec_tps=1500.0, plain_tps=1000.0, steps=200)
    drive(controller, 64, spec_tps=500.0, plain_tps=1000.0, steps=200)
    assert controller.speculation_pays(1) is True
    assert controller.speculation_pays(64) is False


def test_always_speculate_skips_the_measurement():
    controller = SpeculationController(8, 64, always_speculate=True)
    assert drive(controller, 1, spec_tps=1.0, plain_tps=1000.0, steps=50) == 50
