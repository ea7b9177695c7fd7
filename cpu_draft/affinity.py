"""Which CPU cores the draft runs on, and pinning the current process to them.

The GPU process keeps the first cores (one in eight, at least one) for its own Python loop,
kernel launches and server threads, and pins itself there (`pin_coordinator`), so the
draft worker's spinning threads and the coordinator never take each other's cores; the
worker defaults to every other core it may use. With tensor parallelism on CUDA, each
worker rank (ranks 1..N-1; rank 0 is the coordinator) gets one core of its own right after
the coordinator's (`tp_worker_cpus`) and the draft the cores after those. ``DraftConfig.cpus``
(a Linux cpulist such as ``"4-15"`` or ``"2,4-7"``; default $HETERO_DRAFT_CPUS) overrides the
draft's default.

The default draft takes at most `MAX_DEFAULT_DRAFT_CORES` cores. A draft of ≤ 150 M parameters
has too little work per layer to split further: past that its forward stops getting faster, its
step times spread, and the engine ends up waiting on drafts (bench/results:
cpu_draft-h200x4-threads-70b7cf6.csv; e2e_speculation-20261128-183915 against -190749).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

MAX_DEFAULT_DRAFT_CORES = 16


def parse_cpu_list(text: str) -> list[int]:
    """``"4-7,10"`` -> ``[4, 5, 6, 7, 10]``; raises ValueError naming the bad part."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"bad CPU list entry {part!r} in {text!r}: expected N or N-M") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"CPU list {text!r} names no CPU")
    return sorted(cpus)


_process_cpus: Optional[frozenset[int]] = None


def usable_cpus() -> list[int]:
    """The cores this process may use, as first read: `pin_coordinator` narrows the calling
    thread's own set later, which must not shrink the next engine's draft."""
    global _process_cpus
    if _process_cpus is None:
        _process_cpus = frozenset(os.sched_getaffinity(0))
    return sorted(_process_cpus)


def _coordinator_cores(usable: Sequence[int]) -> int:
    return max(1, len(usable) // 8)


def tp_worker_cpus(num_workers: int) -> list[list[int]]:
    """One core for each tensor-parallel worker rank, after the coordinator's; none (no pinning)
    when the host has too few cores to leave the draft at least one."""
    usable = usable_cpus()
    keep = _coordinator_cores(usable)
    if num_workers < 1 or len(usable) < keep + num_workers + 1:
        return []
    return [[cpu] for cpu in usable[keep:keep + num_workers]]


def default_draft_cpus(spec: Optional[str] = None, tp_workers: int = 0) -> list[int]:
    """The cores for the draft: ``spec`` (a cpulist), else the usable cores after the first one in
    eight (at least one) and those of the `tp_worker_cpus(tp_workers)`, at most
    `MAX_DEFAULT_DRAFT_CORES` of them."""
    usable = usable_cpus()
    if spec:
        cpus = parse_cpu_list(spec)
        unusable = sorted(set(cpus) - set(usable))
        if unusable:
            raise ValueError(f"draft CPUs {unusable} are not usable by this process (usable: {usable})")
        return cpus
    keep = _coordinator_cores(usable) + len(tp_worker_cpus(tp_workers))
    return usable[keep:keep + MAX_DEFAULT_DRAFT_CORES] if len(usable) > keep else usable[:MAX_DEFAULT_DRAFT_CORES]


def _thread_ids() -> list[int]:
    """This process's threads (Linux: /proc/self/task); else the calling thread alone (0)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def pin_coordinator(draft_cpus: Sequence[int], tp_workers: int = 0) -> list[int]:
    """Bind every thread of this process (and the threads started later) to the usable cores
    neither the draft nor a tensor-parallel worker uses, and size torch's intra-op pool to them;
    returns those cores (empty, and nothing changed, when the others use them all).

    Every thread, not only the caller: threads started before (OpenMP's pool, grown to all the
    cores while the model loaded; CUDA's and the loaders') would otherwise still run and spin on
    the draft's cores, and one of the draft's threads preempted stalls its whole forward at the
    next barrier."""
    workers = {cpu for cpus in tp_worker_cpus(tp_workers) for cpu in cpus}
    rest = sorted(set(usable_cpus()) - set(draft_cpus) - workers)
    if rest:
        for tid in _thread_ids():
            try:
                os.sched_setaffinity(tid, rest)
            except OSError:  # a thread that ended meanwhile
                pass
        torch.set_num_threads(len(rest))
    return rest


def pin_current_process(cpus: Sequence[int], num_threads: Optional[int] = None) -> int:
    """Bind this process to ``cpus`` and size torch's intra-op pool; returns the thread count."""
    os.sched_setaffinity(0, set(cpus))
    threads = num_threads or len(cpus)
    torch.set_num_threads(threads)
    return threads
