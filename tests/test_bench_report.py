"""Benchmark result files: tables over uneven rows, and every file names its command and machine."""
import csv
import json
from pathlib import Path

from bench._report import markdown_table, write_csv_with_context, write_markdown_and_json


def test_markdown_table_covers_the_union_of_keys_in_first_seen_order():
    lines = markdown_table([{"a": 1, "b": 2}, {"a": 3, "c": 4}])
    assert lines == ["| a | b | c |", "|---|---|---|", "| 1 | 2 |  |", "| 3 |  | 4 |"]


def test_markdown_and_json_carry_command_and_machine(tmp_path):
    rows = [{"batch": 1, "tokens_per_s": 10.5}]
    text = write_markdown_and_json(str(tmp_path / "sub" / "run"), "Title", "python -m bench.x --y", {"host": "h"}, rows,
                                   markdown_table(rows))
    assert text.startswith("# Title\n\ncommand: `python -m bench.x --y`")
    assert (tmp_path / "sub" / "run.md").read_text() == text
    saved = json.loads((tmp_path / "sub" / "run.json").read_text())
    assert saved == {"command": "python -m bench.x --y", "machine": {"host": "h"}, "rows": rows}


def test_csv_repeats_the_context_on_every_row(tmp_path):
    path = Path(tmp_path) / "d" / "r.csv"
    write_csv_with_context(path, [{"x": 1}, {"x": 2}], {"command": "c", "hostname": "h"})
    with path.open() as f:
        assert list(csv.DictReader(f)) == [{"x": "1", "command": "c", "hostname": "h"}, {"x": "2", "command": "c", "hostname": "h"}]
