import json

from bench import lookahead_host


def test_lookahead_host_times_both_implementations_on_the_same_trees(tmp_path):
    lookahead_host.main(["--batches", "1", "3", "--prompt-len", "64", "--output-len", "40", "--steps", "4",
                         "--warm-requests", "2", "--repeats", "2", "--baseline", "HEAD", "--out", str(tmp_path)])
    (result,) = tmp_path.glob("lookahead_host-*.json")
    data = json.loads(result.read_text())
    assert data["command"].startswith("python -m bench.lookahead_host") and "--baseline HEAD" in data["command"]
    assert data["machine"]["hetero_commit"]
    rows = data["rows"]
    assert [(row["batch"], row["implementation"] == "working tree") for row in rows] == [
        (1, False), (1, True), (3, False), (3, True)]
    for row in rows:
        assert row["same_trees_as_first"] is True
        assert row["us_per_learned_token"] > 0 and row["us_per_proposal"] > 0 and row["tokens_per_step"] >= 1
