"""The lookahead cache's memory budget: ``cpu_decoding_memory_utilization`` of RAM."""
from __future__ import annotations

import os

DEFAULT_CPU_DECODING_MEMORY_UTILIZATION = 0.15


def total_ram_bytes() -> int:
    """Physical memory of this host, from /proc/meminfo or, failing that, sysconf."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_memory_budget(fraction: float = DEFAULT_CPU_DECODING_MEMORY_UTILIZATION) -> int:
    if not 0 < fraction <= 1:
        raise ValueError(f"cpu_decoding_memory_utilization must be in (0, 1], got {fraction}")
    return int(fraction * total_ram_bytes())
