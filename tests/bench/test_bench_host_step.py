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
        phases = [float(row[f"{name}_ms"]) for name in ("schedule", "propose", "forward", "sample_and_verify", "append_tokens")]
        assert all(ms > 0 for ms in phases)
        assert sum(phases) <= float(row["step_ms"])
        assert row["command"].startswith("python") and "bench.host_step" in row["command"]
