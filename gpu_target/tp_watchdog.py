"""The tensor-parallel ranks' watchdog: what ends a wait on a rank that will never answer.

Rank 0 (the engine's process) watches its workers: a worker's death aborts the process group
so that rank 0 leaves a collective it waits in, and a start-up in which no rank reports a new
phase for `STALL_TIMEOUT_S` is a stall (`Watchdog`). Collectives that an abort cannot reach
(the one-shot all-reduce's kernels) leave rank 0's device stuck; the watchdog then ends the
process (`DeviceWork`, `end_process`). A worker, for its part, ends itself once the engine's
process is gone (`exit_with_parent`). The engine then raises the errors of gpu_target/tp_worker.py.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger("hetero")

STALL_TIMEOUT_S = 600.0  # start-up: no rank reported a new phase for this long (one phase is one graph, one shard)
WATCH_PERIOD_S = 0.5
DEATH_GRACE_S = 5.0  # a dying worker's pipes close before it can be reaped
# After a worker's death, how long rank 0's device may take to finish the work it was given
# before it counts as stuck in a collective waiting for the dead rank (a one-shot all-reduce).
STUCK_GRACE_S = 10.0
STUCK_EXIT_CODE = 70  # the process's exit code then (BSD sysexits' EX_SOFTWARE)


def report_phase(store: dist.Store, rank: int, phase: str) -> None:
    """Publish the start-up phase `rank` enters, for the watchdog's progress check and its error."""
    store.set(_phase_key(rank), phase)


def _phase_key(rank: int) -> str:
    return f"hetero/phase/{rank}"


def exit_with_parent() -> None:
    """End this process as soon as the one that spawned it (the engine's) is gone, from a thread
    of its own: a worker whose thread is stuck on its GPU (in a one-shot all-reduce waiting for
    a rank 0 that was killed) never reads its pipe's end, and no one else would stop it."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="hetero-tp-parent-watch").start()


class Watchdog:
    """Ends rank 0's waits on ranks that will never answer.

    A thread that checks every half second whether a worker exited and, while rank 0 is in a
    start-up phase (`busy`), whether any rank reported a new phase in the store. A worker that
    exits with an error, or no progress for `STALL_TIMEOUT_S` while busy, aborts the process
    group so that rank 0 leaves a collective it waits in; a stall is described in `stalled`, and
    the workers are killed, since a live but stalled peer keeps gloo waiting despite the abort.
    Steps are not timed: a worker's death is what ends one (vLLM's rule too).

    The abort reaches NCCL's kernels, not the one-shot all-reduce's (`one_shot_in_use`): those
    spin on the device until the dead rank's signal arrives, and rank 0's thread, waiting for
    the step's outputs, with them. So a death is also followed by a look at rank 0's latest
    `DeviceWork`: if the device has not finished it within `STUCK_GRACE_S`, nothing will free
    the device or the thread, and the watchdog ends the process (`end_process`), as vLLM's
    executor shuts the engine down when a worker dies (vllm/v1/executor/multiproc_executor.py).
    Work that finishes means no kernel waits for the dead rank: the engine raises RankDiedError
    and the process lives on."""

    def __init__(self, processes: list, port: int, world_size: int, abort: Callable[[], None]):
        self.processes = processes
        self.abort = abort  # aborts rank 0's group (once made): on a death or a stall
        # A client of its own: a store client serves one request at a time, and rank 0's may be
        # blocked in a wait for a peer's key (NCCL's or symmetric memory's rendezvous).
        self.store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=datetime.timedelta(seconds=60),
                                   wait_for_workers=False)
        self.world_size = world_size
        self.stalled: Optional[str] = None
        self.one_shot_in_use = False
        self.work: Optional[DeviceWork] = None  # rank 0's latest work with collectives on its device
        self._busy: Optional[tuple[str, float]] = None  # (phase, since)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hetero-tp-watchdog")
        self._thread.start()

    def busy(self, phase: str) -> None:
        self._busy = (phase, time.monotonic())

    def idle(self) -> None:
        self._busy = None

    def close(self) -> None:
        self._closed.set()

    def phases(self) -> dict[int, str]:
        """The start-up phase each rank last reported."""
        keys = {rank: _phase_key(rank) for rank in range(self.world_size)}
        return {rank: self.store.get(key).decode() for rank, key in keys.items() if self.store.check([key])}

    def _run(self) -> None:
        sentinels = [p.sentinel for p in self.processes]
        seen: Optional[dict[int, str]] = None
        progressed = time.monotonic()
        while not self._closed.is_set():
            exited = multiprocessing.connection.wait(sentinels, WATCH_PERIOD_S)
            if exited:
                for process in self.processes:
                    if process.sentinel in exited:
                        process.join(DEATH_GRACE_S)  # its pipes close before it can be reaped
                died = [(rank, p) for rank, p in enumerate(self.processes, start=1) if p.exitcode not in (0, None)]
                if died:
                    # Watched from a thread of its own: an abort can itself hang (NCCL's, with graphs alive).
                    threading.Thread(target=self._end_process_if_stuck, args=died[0], daemon=True,
                                     name="hetero-tp-stuck-watch").start()
                    self.abort()
                return
            busy = self._busy
            if busy is None or self._closed.is_set():
                continue
            try:
                phases = self.phases()
            except RuntimeError:  # the store is closing with the engine
                continue
            now = time.monotonic()
            if phases != seen:
                seen, progressed = phases, now
            phase, since = busy
            if now - max(since, progressed) > STALL_TIMEOUT_S:
                where = "; ".join(f"rank {rank}: {text}" for rank, text in sorted(phases.items()))
                self.stalled = (f"tensor-parallel start-up stalled: no rank made progress for {STALL_TIMEOUT_S:.0f} s "
                                f"while rank 0 was {phase}; last phase of each rank: {where}")
                logger.error(self.stalled)
                for process in self.processes:  # a stalled worker holds its connections open: gloo would wait on
                    process.kill()
                self.abort()
                return

    def _end_process_if_stuck(self, rank: int, process) -> None:
        """End the process if rank 0's latest device work does not finish within `STUCK_GRACE_S`
        of `process` (tensor-parallel rank `rank`) dying. Not cut short by the engine's close:
        its teardown would wait for the stuck device too."""
        deadline = time.monotonic() + STUCK_GRACE_S
        while True:
            work = self.work
            if work is None or work.finished():
                return
            if time.monotonic() > deadline:
                break
            time.sleep(WATCH_PERIOD_S)
        why = (" (the one-shot all-reduce cannot be aborted; disable_custom_all_reduce=True keeps every all-reduce on "
               "NCCL, whose collectives can)" if self.one_shot_in_use else "")
        end_process(
            f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode} while rank 0's "
            f"device was {work.what}, which it has not finished {STUCK_GRACE_S:.0f} s later: its collectives wait for "
            f"the dead rank and the abort did not free them{why}, so neither the device nor the engine's thread would "
            f"be free again. Ending the process (exit code {STUCK_EXIT_CODE}).",
            self.processes)


class DeviceWork:
    """Work rank 0 gave its device with the ranks' collectives in it (a step, a start-up phase
    that warms up and captures graphs), and whether the device has finished it: on CUDA, once
    it ran everything queued on rank 0's stream up to `end` (an event, which any thread may
    query without waiting); on the CPU, where collectives run on the calling thread, at `end`."""

    def __init__(self, what: str, device: torch.device):
        self.what = what
        self.device = device
        self._ended = False
        self._event: Optional[torch.cuda.Event] = None

    def end(self) -> None:
        """The work is all queued (or its call failed): it finishes once the device has run it."""
        if self.device.type == "cuda":
            try:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                self._event = event
            except RuntimeError:  # a device already in error runs nothing more: no kernel is left waiting
                pass
        self._ended = True

    def finished(self) -> bool:
        if not self._ended:
            return False
        try:
            return self._event is None or self._event.query()
        except RuntimeError:  # the device failed meanwhile: its kernels are gone
            return True


def end_process(message: str, processes: Sequence) -> None:
    """Log `message`, kill the surviving workers (their GPUs are stuck as rank 0's, and no
    atexit handler runs to stop them) and end this process with `STUCK_EXIT_CODE`, skipping
    the teardown that would wait for the device."""
    logger.critical(message)
    for process in processes:
        if process.is_alive():
            process.kill()
    logging.shutdown()  # flushes every handler
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(STUCK_EXIT_CODE)


def abort_group(group) -> None:
    """Abort `group`'s collectives: the teardown when a peer cannot join a graceful one (it died
    or stalled), and the watchdog's way to free rank 0 from a collective it waits in."""
    abort = getattr(group, "abort", None)
    if abort is None:
        return
    try:
        abort()
    except Exception:  # the group may be gone already; rank 0 then sees the error itself
        logger.debug("aborting the tensor-parallel group failed", exc_info=True)
