"""docker/Dockerfile, checked without a Docker engine."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parent.parent / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def test_image_runs_hetero_serve_on_a_cuda_runtime_with_the_model_mounted():
    steps = instructions()
    base = [rest for keyword, rest in steps if keyword == "FROM"]
    assert len(base) == 1 and base[0].startswith("nvidia/cuda:") and "runtime" in base[0]
    (entrypoint,) = [json.loads(rest) for keyword, rest in steps if keyword == "ENTRYPOINT"]
    assert entrypoint == ["hetero", "serve"]
    (volume,) = [json.loads(rest) for keyword, rest in steps if keyword == "VOLUME"]
    assert "/models" in volume
    (cmd,) = [json.loads(rest) for keyword, rest in steps if keyword == "CMD"]
    assert cmd[0].startswith("/models/")
    env = " ".join(rest for keyword, rest in steps if keyword == "ENV")
    assert "HETERO_DRAFT_CPUS=" in env and "HETERO_DRAFT_THREADS=" in env
    assert any(keyword == "RUN" and "pip install" in rest and rest.rstrip().endswith(" .") for keyword, rest in steps)


def test_the_entrypoint_command_works_in_this_venv():
    hetero = shutil.which("hetero", path=os.path.dirname(sys.executable))
    assert hetero, "the `hetero` console script is not installed"
    result = subprocess.run([hetero, "serve", "-h"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--speculative-model" in result.stdout


@pytest.mark.skipif(shutil.which("hadolint", path=os.path.dirname(sys.executable)) is None, reason="hadolint not installed")
def test_hadolint_is_clean():
    hadolint = shutil.which("hadolint", path=os.path.dirname(sys.executable))
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
