"""The one-way import layers (pyproject.toml's import-linter contract): hetero.core at the
bottom, then ipc / gpu_target / lookahead, cpu_draft, the engine, the entry points, bench."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_imports_run_one_way():
    lint_imports = pathlib.Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout
