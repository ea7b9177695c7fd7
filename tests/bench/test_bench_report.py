"""Benchmark result files: tables over uneven rows, and every file names its command and machine."""
import csv
import json
from pathlib import Path

from bench._report import markdown_table, section_tables, write_csv_with_context, write_markdown_and_json


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


def test_the_recorded_commit_is_marked_dirty_when_tracked_files_differ_from_it(tmp_path):
    import subprocess

    from bench._machine import git_commit

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    (tmp_path / "untracked.txt").write_text("results\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "f.py").write_text("a = 2\n")
    assert git_commit(tmp_path) == head + "-dirty"


def test_section_tables_head_each_section_in_order_and_skip_empty_ones():
    rows = [dict(section="decode", batch=1), dict(section="machine", gpu="x"), dict(section="decode", batch=8)]
    lines = section_tables(rows, ("machine", "verify", "decode"))
    assert lines == ["## machine", "", "| gpu |", "|---|", "| x |", "",
                     "## decode", "", "| batch |", "|---|", "| 1 |", "| 8 |", ""]
