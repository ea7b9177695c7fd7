import csv

from bench import host_step


def test_host_step_accepts_as_the_drafts_say_and_splits_the_step_into_its_phases(tmp_path):
    out = tmp_path / "host_step.csv"
    assert host_step.main(["--batches", "4", "--nodes", "3", "--draft-p", "0.0,1.0", "--steps", "5", "--vocab", "64", "--out", str(out)]) == 0
    rows = {float(row["draft_p"]): row for row in csv.DictReader(out.open())}
    # Drafts that are all right are accepted whole (3 nodes + the bonus token); random ones almost never.
    assert float(rows[1.0]["tokens_per_seq_step"]) == 4.0
    assert float(rows[0.0]["tokens_per_seq_step"]) < 1.3
    for row in rows.values():
        phases = [float(row[f"{name}_ms"]) for name in ("schedule", "propose", "forward", "sample_and_verify", "append")]
        assert all(ms > 0 for ms in phases)
        assert sum(phases) <= float(row["step_ms"])
        assert row["command"].startswith("python") and "bench.host_step" in row["command"]


def test_host_step_times_the_critical_path_between_verification_and_the_next_launch(tmp_path):
    out = tmp_path / "host_step.csv"
    assert host_step.main(["--batches", "4", "--nodes", "3", "--draft-p", "0.5", "--steps", "6", "--vocab", "64",
                           "--async-scheduling", "on,off", "--clock", "cpu", "--out", str(out)]) == 0
    rows = {row["async_scheduling"]: row for row in csv.DictReader(out.open())}
    assert set(rows) == {"True", "False"}
    for row in rows.values():
        critical = float(row["critical_ms"])
        assert 0 < float(row["critical_host_ms"]) <= critical
        inside = [float(row[f"crit_{name}_ms"]) for name in ("schedule", "propose", "commit", "sample_and_verify", "append")]
        assert all(ms > 0 for ms in inside) and sum(inside) <= critical
        assert float(row["crit_logits_argmax_ms"]) <= float(row["crit_sample_and_verify_ms"])
    # With async scheduling the outputs are built after the launch, off the critical path; without, inside it.
    assert float(rows["True"]["crit_request_outputs_ms"]) == 0 < float(rows["False"]["crit_request_outputs_ms"])
    assert float(rows["True"]["critical_ms"]) < float(rows["True"]["step_ms"])
