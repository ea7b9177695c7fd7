"""bench.worker_timeline: the draft worker's DEBUG lines, sorted by how each proposal's trees were made."""
from __future__ import annotations

from bench.worker_timeline import parse, summary

PREFIX = "2026-11-28 06:35:27,406 draft-worker DEBUG "


def _line(cycle, queued, replied, ahead, again, pending, empty, drafted, n=8):
    return (PREFIX + f"PROPOSE of {n}, sent {cycle} ms after the last reply: queued {queued} ms, replied in {replied} ms "
            f"({ahead} drafted ahead, {again} drafted again, {pending} pending, {empty} empty); then drafted ahead for {drafted} ms")


def test_each_proposal_is_sorted_by_how_its_trees_were_made_and_its_wait_summed():
    lines = [
        PREFIX + "SYNC queued 0.01 ms, caught up in 6.37 ms",
        _line("nan", 0.5, 0.4, 0, 0, 8, 0, 9.0),  # after a SYNC: pending
        _line("8.00", 0.2, 0.6, 8, 0, 0, 0, 7.0),  # every guess held
        _line("8.00", 1.0, 0.5, 5, 3, 0, 3, 9.0),  # hits beside misses left for later
        _line("8.00", 0.8, 10.2, 0, 0, 0, 0, 8.5),  # the draft-ahead was dropped: all drafted before the reply
        _line("57.00", 0.6, 14.4, 0, 8, 0, 0, 11.0),  # a probe after a plain window, all drafted again
        _line("7.00", 0.1, 0.4, 0, 0, 0, 8, 6.0),  # nothing drafted now
        "an engine line that is not the worker's",
    ]
    proposals = parse(lines)
    assert [p.kind for p in proposals] == ["pending", "ahead", "mixed", "redrafted", "redrafted", "empty"]
    row = summary(proposals, "log")
    assert row["proposals"] == 6 and row["wait_ms"] == 29.7
    assert row["redrafted"] == "2 / 26.0" and row["ahead"] == "1 / 0.8" and row["pending"] == "1 / 0.9"
    assert row["after_plain"] == "2 / 15.9"  # the one after a SYNC and the one 57 ms after its last reply
    assert row["step_ms_p50"] == 8.0 and row["overrun_share"] == 0.67  # 4 of 6 draft-aheads (9.0, 9.0, 8.5, 11.0 ms) past the 8 ms step


def test_a_log_without_the_workers_lines_has_no_row():
    assert summary(parse(["nothing here"])) is None
