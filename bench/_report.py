"""Writing benchmark results: every file carries the rows, the command and the machine."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Iterable, Sequence


def markdown_table(rows: Sequence[dict]) -> list[str]:
    """A Markdown table over the union of the rows' keys, in first-seen order."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(key, "")) for key in keys) + " |" for row in rows]
    return lines


def section_tables(rows: Sequence[dict], sections: Iterable[str]) -> list[str]:
    """A "## section" heading and table per section, in order, over the rows whose "section" it is
    (the key itself left out); sections without rows are skipped."""
    lines: list[str] = []
    for section in sections:
        part = [{k: v for k, v in r.items() if k != "section"} for r in rows if r.get("section") == section]
        if part:
            lines += [f"## {section}", "", *markdown_table(part), ""]
    return lines


def write_markdown_and_json(stem: str, title: str, command: str, machine: dict, rows: Sequence[dict],
                            body: Iterable[str]) -> str:
    """`stem`.md (title, command, machine, then `body` lines) and `stem`.json; returns the Markdown."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    text = "\n".join([f"# {title}", "", f"command: `{command}`", "", f"machine: {json.dumps(machine)}", "", *body]) + "\n"
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(dict(command=command, machine=machine, rows=list(rows)), f, indent=1)
    return text


def write_csv_with_context(path: Path, rows: Sequence[dict], context: dict) -> None:
    """One CSV row per result row, each followed by the same context columns (command, machine...)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], *context])
        writer.writeheader()
        writer.writerows({**row, **context} for row in rows)
    print(f"wrote {path}")
