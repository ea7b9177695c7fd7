"""Is a process still there? Used to tell a dead peer from a slow one and to find orphaned segments."""
from __future__ import annotations

import os


def process_start_ticks(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (/proc/<pid>/stat field 22); 0 if unknown.

    Stored next to the pid so that a recycled pid is not mistaken for the original process.
    """
    stat = _read_stat(pid)
    return 0 if stat is None else int(stat[19])


def process_alive(pid: int, start_ticks: int = 0) -> bool:
    """True while ``pid`` exists, is not a zombie and (when ``start_ticks`` is given) is the same process.

    ``os.kill(pid, 0)`` alone reports a killed but not yet reaped child as alive, so the
    process state in /proc is checked as well.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = _read_stat(pid)
    if stat is None:  # vanished since os.kill, or a system without /proc: trust os.kill there
        return not os.path.isdir("/proc/self")
    state, started = stat[0], int(stat[19])
    return state not in ("Z", "X") and (start_ticks == 0 or started == start_ticks)


def _read_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (index 0 is the state), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()
