"""The lookahead cache's memory budget: ``cpu_decoding_memory_utilization`` of RAM."""
from __future__ import annotations

import os

DEFAULT_CPU_DECODING_MEMORY_UTILIZATION = 0.15


CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def total_ram_bytes(limit_files: tuple[str, ...] = CGROUP_LIMIT_FILES) -> int:
    """Memory this process may use: the host's RAM, or a container's cgroup limit if lower.

    Inside Docker, /proc/meminfo shows the host's RAM; a budget taken from it could exceed
    the container's limit and get the server OOM-killed.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            host = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min([host, *(limit for limit in map(_cgroup_limit, limit_files) if limit)])


def _cgroup_limit(path: str) -> int | None:
    """A cgroup memory limit in bytes, or None where there is none ("max", absurdly large, unreadable)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < 1 << 60 else None


def default_memory_budget(fraction: float = DEFAULT_CPU_DECODING_MEMORY_UTILIZATION) -> int:
    if not 0 < fraction <= 1:
        raise ValueError(f"cpu_decoding_memory_utilization must be in (0, 1], got {fraction}")
    return int(fraction * total_ram_bytes())
