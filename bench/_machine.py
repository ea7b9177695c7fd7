"""Describe the machine a benchmark ran on, for the result file."""
from __future__ import annotations

import functools
import importlib.util
import os
import platform
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Optional


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """GPU names from nvidia-smi, else from torch.cuda; empty when there is no GPU."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout
            return [line.strip() for line in out.splitlines() if line.strip()]
        except (subprocess.SubprocessError, OSError):
            pass
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return []


def git_commit(directory: Path) -> Optional[str]:
    """HEAD, with "-dirty" when tracked files differ from it.

    A copy of the tree on another machine (the GPU host) can carry an older repository
    than its files: the mark keeps a result from claiming a commit it did not run.
    """
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=5, check=True).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        return head + "-dirty" if git("status", "--porcelain", "--untracked-files=no") else head
    except (subprocess.SubprocessError, OSError):
        return None


@functools.lru_cache(maxsize=1)
def describe_machine() -> dict:
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": gpu_names(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "hetero_commit": git_commit(Path(__file__).resolve().parent),
    }
