"""Tensor-parallel ranks 1..N-1 as worker processes, driven by rank 0 in the engine's process.

Rank 0 runs in the coordinator's process, so the engine keeps calling a `ModelRunner` as on
one GPU and gets its logits where they were computed, with no copy between processes. Before
each of its calls, `DrivingRunner` sends the same call (the step's `SequenceChunk`s) down a
pipe to every worker, which replays it on its own shard; the model's collectives then pair up
rank by rank. Between multi-step decode steps rank 0 broadcasts the tokens it picked, so the
sampling callback itself never leaves the coordinator (as vLLM's driver worker, with rank 0
in the engine process).

Control goes over multiprocessing pipes, tensors over a torch.distributed process group made
from a TCPStore without touching torch's global default group: ProcessGroupNCCL on CUDA
(graph-capturable), ProcessGroupGloo on the CPU; unless `disable_custom_all_reduce`, the
all-reduces that fit go through the one-shot kernel instead (gpu_target/custom_all_reduce.py).
A worker that dies is seen through its process sentinel: before each call, and by a watchdog
thread that aborts the group so that rank 0 is not left waiting in a collective; the engine
then raises `RankDiedError`. The one-shot all-reduce's kernels cannot be aborted: when rank 0's
device has not finished its work with the dead rank within `STUCK_GRACE_S` of the death, the
watchdog ends the process with `STUCK_EXIT_CODE` and an error naming the rank (`Watchdog`). During
start-up every rank reports the phase it enters (loading weights, compiling kernels, capturing
each CUDA graph) in the group's store, and the watchdog also ends a start-up in which no rank
has made progress for `STALL_TIMEOUT_S` (a deadlock, or a rank waiting for a message that never
comes): the engine raises `RankStalledError`, naming each
rank's last phase. A worker whose pipe closes (the coordinator is gone) exits, and a thread of
its own ends it when the coordinator's process is gone while it is stuck on its GPU; workers are
daemonic and stopped by a finalizer, so none outlives the engine. At that stop each rank frees
its CUDA graphs before its process group (graphs that captured NCCL collectives keep the
communicator busy), then shuts the group down while its peers do (`release`). Gloo and NCCL
here use TCP and CUDA IPC, the one-shot all-reduce cuMem handles passed over Unix sockets: no
named shared-memory segments of hetero's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import threading
import time
import traceback
import uuid
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from gpu_target.cuda_graphs import CudaGraphRunner
from gpu_target.custom_all_reduce import OneShotAllReduce, set_up_one_shot
from gpu_target.runner import ModelRunner, PickTokens, SequenceChunk
from gpu_target.target import CacheShape, TargetSpec, build_runner, load_model, make_kv_pool, rank_device
from gpu_target.tensor_parallel import TensorParallel, check_divisible

logger = logging.getLogger("hetero")

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
STALL_TIMEOUT_S = 600.0  # start-up: no rank reported a new phase for this long (one phase is one graph, one shard)
_WATCH_PERIOD_S = 0.5
_STOP_TIMEOUT_S = 10.0
_DEATH_GRACE_S = 5.0
# After a worker's death, how long rank 0's device may take to finish the work it was given
# before it counts as stuck in a collective waiting for the dead rank (a one-shot all-reduce).
STUCK_GRACE_S = 10.0
STUCK_EXIT_CODE = 70  # the process's exit code then (BSD sysexits' EX_SOFTWARE)


class RankDiedError(RuntimeError):
    """A tensor-parallel worker exited; the target cannot run another step."""


class RankStalledError(RankDiedError):
    """The tensor-parallel ranks stopped making progress during start-up; the group was aborted."""


def make_store(rank: int, world_size: int, port: int, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> dist.TCPStore:
    """The ranks' TCPStore on this host; rank 0 hosts it without waiting for the others to connect
    (the watchdog, not the store's constructor, bounds that wait)."""
    return dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)


def make_group(backend: str, store: dist.Store, rank: int, world_size: int,
               timeout: datetime.timedelta = COLLECTIVE_TIMEOUT):
    """A process group over `store`, outside torch's global state."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def report_phase(store: dist.Store, rank: int, phase: str) -> None:
    """Publish the start-up phase `rank` enters, for the watchdog's progress check and its error."""
    store.set(_phase_key(rank), phase)


def _phase_key(rank: int) -> str:
    return f"hetero/phase/{rank}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(spec: TargetSpec, rank: int, world_size: int, port: int, group_name: str, cpus: Optional[list[int]],
              num_threads: Optional[int], conn) -> None:
    """A worker's life: build the rank, then replay the coordinator's calls until told to stop.
    Its start-up takes the same steps, with the same collectives, as rank 0's in `RankGroup` and the engine."""
    exit_with_parent()
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if cpus or num_threads:
            torch.set_num_threads(num_threads or len(cpus))
        device = rank_device(spec, TensorParallel(rank, world_size))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = make_store(rank, world_size, port)
        report = functools.partial(report_phase, store, rank)
        report("joining the process group")
        group = make_group(_backend(spec), store, rank, world_size)
        report("setting up the all-reduce")
        one_shot = set_up_one_shot(spec.custom_all_reduce, group, store, group_name, rank, world_size, device, spec.dtype)
        tp = TensorParallel(rank, world_size, group, one_shot)
        report("loading weights")
        model = load_model(spec, tp, device)
        report("waiting for the KV cache shape from the coordinator")
        conn.send(("loaded", None))
        call, shape = conn.recv()
        if call == "stop":  # the coordinator's own start-up failed
            return
        report("allocating the KV cache")
        runner = build_runner(spec, model, make_kv_pool(spec, tp, shape.num_blocks, device), tp, shape, report)
        report("serving")
        conn.send(("built", None))
        while True:
            try:
                call, args = conn.recv()
            except EOFError:  # the coordinator is gone: no peer joins a graceful teardown
                release(RankResources(group, one_shot, runner.graph_runner), graceful=False)
                return
            if call == "stop":
                release(RankResources(group, one_shot, runner.graph_runner))
                return
            _replay(runner, tp, call, args)
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)


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


def _replay(runner: ModelRunner, tp: TensorParallel, call: str, args: tuple) -> None:
    if call == "forward":
        runner.forward(*args)
        if runner.device.type == "cuda":
            # The graph runner reuses its pinned staging buffers each step; rank 0 waits for
            # its logits before staging the next, and so must a worker that never reads its own.
            torch.cuda.current_stream(runner.device).synchronize()
    elif call == "decode_steps":
        chunks, num_steps = args
        picked = torch.empty(len(chunks), dtype=torch.int64, device=runner.device)
        runner.decode_steps(chunks, num_steps, lambda logits: tp.broadcast(picked).clone())
    elif call == "copy_kv_slots":
        runner.copy_kv_slots(*args)
    else:
        raise ValueError(f"unknown tensor-parallel call {call!r}")


def _backend(spec: TargetSpec) -> str:
    return "nccl" if spec.device_type == "cuda" else "gloo"


class RankGroup:
    """The worker processes of ranks 1..N-1 and rank 0's end of their process group."""

    def __init__(self, spec: TargetSpec, world_size: int, worker_cpus: Sequence[Optional[list[int]]] = (),
                 num_threads: Optional[int] = None):
        """`worker_cpus[r - 1]`: the cores rank r is pinned to (none: not pinned); `num_threads`:
        each worker's torch intra-op threads (default: as many as its cores)."""
        context = multiprocessing.get_context("spawn")
        # The store's host binds a free port itself before any worker looks for it: a port picked
        # and released first could be taken meanwhile, and a worker then join a stranger's store.
        self.store = make_store(0, world_size, 0)
        port = self.store.port
        group_name = f"hetero-tp-{uuid.uuid4().hex[:12]}"  # the one-shot all-reduce's symmetric-memory group
        self.world_size = world_size
        self.conns = []
        self.processes = []
        for rank in range(1, world_size):
            ours, theirs = context.Pipe()
            cpus = worker_cpus[rank - 1] if rank - 1 < len(worker_cpus) else None
            process = context.Process(target=_run_rank,
                                      args=(spec, rank, world_size, port, group_name, cpus, num_threads, theirs),
                                      name=f"hetero-tp-rank{rank}", daemon=True)
            process.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(process)
        self.resources = RankResources()
        self.watchdog = Watchdog(list(self.processes), port, world_size, self.resources)
        self._finalizer = weakref.finalize(self, _stop, list(self.processes), list(self.conns), self.watchdog,
                                           self.resources)
        try:
            with self.running("joining the process group"):
                self.resources.group = make_group(_backend(spec), self.store, 0, world_size)
            self.device = rank_device(spec, TensorParallel(0, world_size))
            with self.running("setting up the all-reduce"):
                self.resources.one_shot = set_up_one_shot(spec.custom_all_reduce, self.resources.group, self.store,
                                                          group_name, 0, world_size, self.device, spec.dtype)
            self.watchdog.one_shot_in_use = self.resources.one_shot is not None
            self.tp = TensorParallel(0, world_size, self.resources.group, self.resources.one_shot)
        except BaseException:
            self.close()
            raise

    def report(self, phase: str) -> None:
        """Rank 0's start-up phase, for the watchdog."""
        report_phase(self.store, 0, phase)

    @contextlib.contextmanager
    def running(self, phase: str, collectives: bool = False):
        """Rank 0 runs start-up `phase` (its collectives pair with the workers'), watched: a
        worker's death or a stall ends it with RankDiedError / RankStalledError, not a hang.
        `collectives`: the phase runs the model's collectives on the device (warm-up, capture)."""
        self.report(phase)
        self.watchdog.busy(phase)
        try:
            with self.on_device(phase) if collectives else contextlib.nullcontext():
                yield
        except RuntimeError as error:  # a collective's failure: say which rank caused it
            if not isinstance(error, RankDiedError):
                self.check_alive(grace_s=_DEATH_GRACE_S)
            raise
        finally:
            self.watchdog.idle()
        self.check_alive()  # an aborted collective may have returned without an error

    @contextlib.contextmanager
    def on_device(self, what: str):
        """Rank 0 gives its device `what`, work with the ranks' collectives in it, until the block
        ends; the watchdog tells from it whether the device is stuck after a worker's death."""
        work = DeviceWork(what, self.device)
        self.watchdog.work = work
        try:
            yield
        finally:
            work.end()

    def wait_for(self, state: str) -> None:
        """Block until every worker reports `state` ("loaded", "built"); RankDiedError if one fails
        first, RankStalledError if none makes progress for `STALL_TIMEOUT_S`."""
        pending = dict(zip(self.conns, range(1, self.world_size)))
        sentinels = [p.sentinel for p in self.processes]
        with self.running(f"waiting for the workers to report {state!r}"):
            while pending:
                for item in multiprocessing.connection.wait([*pending, *sentinels], _WATCH_PERIOD_S):
                    if item in pending:
                        try:
                            reply, detail = item.recv()
                        except (EOFError, OSError):  # the worker is gone, maybe not reaped yet
                            self.check_alive(grace_s=_DEATH_GRACE_S)
                            raise RankDiedError(f"tensor-parallel rank {pending[item]} closed its pipe") from None
                        if reply == "error":
                            raise RankDiedError(f"tensor-parallel rank {pending[item]} failed:\n{detail}")
                        del pending[item]
                    else:  # a worker exited
                        self.check_alive()
                self.check_alive()

    def build(self, shape: CacheShape) -> None:
        """Have every worker allocate its KV cache and capture its graphs (rank 0 does the same meanwhile)."""
        self.send("build", shape)

    def send(self, call: str, args: Any) -> None:
        self.check_alive()
        for conn in self.conns:
            try:
                conn.send((call, args))
            except OSError:
                self.check_alive(grace_s=_DEATH_GRACE_S)
                raise

    def check_alive(self, grace_s: float = 0.0) -> None:
        """RankDiedError naming the first worker that exited, with its own error when it sent one;
        `grace_s`: first wait that long for one to exit (a collective can fail on a closed
        connection before the dying process is reaped); RankStalledError once the watchdog found a stall."""
        if self.watchdog.stalled is not None:
            raise RankStalledError(self.watchdog.stalled)
        if grace_s:
            exited = multiprocessing.connection.wait([p.sentinel for p in self.processes], grace_s)
            for process in self.processes:
                if process.sentinel in exited:
                    process.join(grace_s)  # its pipes close before it can be reaped
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            if not process.is_alive():
                detail = ""
                try:
                    if conn.poll():
                        _, detail = conn.recv()
                except (EOFError, OSError):
                    pass
                raise RankDiedError(
                    f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}; "
                    f"the target cannot continue{': ' + detail if detail else ''}"
                )

    def close(self) -> None:
        self._finalizer()


def start_ranks(spec: TargetSpec, world_size: int, worker_cpus: list[list[int]]) -> RankGroup:
    """The worker processes of tensor-parallel ranks 1..N-1: on CUDA each pinned to its core
    of ``worker_cpus`` (none: unpinned); on the CPU every rank computes, so the cores are
    shared out, or the ranks' OpenMP threads would spin on each other's cores while they
    wait in a collective. Checks that N divides the model and fits the visible GPUs first."""
    check_divisible(spec.model_config, world_size)
    if spec.device_type == "cuda":
        if world_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={world_size} exceeds the {torch.cuda.device_count()} visible GPUs")
        return RankGroup(spec, world_size, worker_cpus)
    threads = max(1, len(os.sched_getaffinity(0)) // world_size)
    torch.set_num_threads(threads)
    return RankGroup(spec, world_size, num_threads=threads)


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

    def __init__(self, processes: list, port: int, world_size: int, resources: "RankResources"):
        self.processes = processes
        self.resources = resources  # its group, once made, is aborted on a death or a stall
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
            exited = multiprocessing.connection.wait(sentinels, _WATCH_PERIOD_S)
            if exited:
                for process in self.processes:
                    if process.sentinel in exited:
                        process.join(_DEATH_GRACE_S)  # its pipes close before it can be reaped
                died = [(rank, p) for rank, p in enumerate(self.processes, start=1) if p.exitcode not in (0, None)]
                if died:
                    # Watched from a thread of its own: an abort can itself hang (NCCL's, with graphs alive).
                    threading.Thread(target=self._end_process_if_stuck, args=died[0], daemon=True,
                                     name="hetero-tp-stuck-watch").start()
                    self._abort()
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
                self._abort()
                return

    def _abort(self) -> None:
        _abort(self.resources.group)

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
            time.sleep(_WATCH_PERIOD_S)
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


@dataclasses.dataclass
class RankResources:
    """What a rank tears down when the engine stops, in this order: its CUDA graphs (they hold
    the communicator's resources), the one-shot all-reduce, its process group."""
    group: Any = None
    one_shot: Optional[OneShotAllReduce] = None
    graph_runner: Optional[CudaGraphRunner] = None


def release(resources: RankResources, graceful: bool = True) -> None:
    """Tear a rank's communicators down. `graceful`: every rank does it at the same point and
    shuts its group down, as torch.distributed.destroy_process_group has them do (NCCL's teardown
    synchronises the ranks of a node); otherwise (a peer is gone) the group is aborted."""
    if resources.graph_runner is not None:
        resources.graph_runner.release()
    if resources.one_shot is not None:
        resources.one_shot.close()
    if resources.group is None:  # start-up failed before the group was made
        return
    if graceful:
        resources.group.shutdown()
    else:
        _abort(resources.group)


def _abort(group) -> None:
    """Abort `group`'s collectives: the teardown when a peer cannot join a graceful one (it died
    or stalled), and the watchdog's way to free rank 0 from a collective it waits in."""
    abort = getattr(group, "abort", None)
    if abort is None:
        return
    try:
        abort()
    except Exception:  # the group may be gone already; rank 0 then sees the error itself
        logger.debug("aborting the tensor-parallel group failed", exc_info=True)


def _stop(processes: list, conns: list, watchdog: Watchdog, resources: RankResources) -> None:
    watchdog.close()
    for conn in conns:
        try:
            conn.send(("stop", ()))
        except OSError:
            pass
    graceful = all(process.is_alive() for process in processes)  # the workers release theirs meanwhile
    try:
        release(resources, graceful)
    except Exception:  # a peer that failed mid-teardown
        logger.debug("releasing the tensor-parallel group failed; aborting it", exc_info=True)
        _abort(resources.group)
    for process in processes:
        process.join(_STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(_STOP_TIMEOUT_S)
    for conn in conns:
        conn.close()


class DrivingRunner:
    """Rank 0's `ModelRunner`, each call of which the workers replay on their shards first."""

    def __init__(self, runner: ModelRunner, ranks: RankGroup):
        self.runner = runner
        self.ranks = ranks
        self.model = runner.model
        self.kv_pool = runner.kv_pool
        self.device = runner.device
        self.graph_runner = runner.graph_runner
        ranks.resources.graph_runner = runner.graph_runner  # freed before rank 0's group at teardown

    def forward(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        with self.ranks.on_device("running a forward step"):
            self.ranks.send("forward", (list(chunks),))
            return self._guarded(lambda: self.runner.forward(chunks))

    def decode_steps(self, chunks: Sequence[SequenceChunk], num_steps: int, pick: PickTokens) -> list[list[int]]:
        tp = self.ranks.tp
        with self.ranks.on_device(f"running {num_steps} decode steps"):
            self.ranks.send("decode_steps", (list(chunks), num_steps))
            return self._guarded(lambda: self.runner.decode_steps(chunks, num_steps,
                                                                  lambda logits: tp.broadcast(pick(logits))))

    def copy_kv_slots(self, moves) -> None:
        if moves:
            self.ranks.send("copy_kv_slots", (list(moves),))
        self.runner.copy_kv_slots(moves)

    def _guarded(self, call: Callable[[], Any]) -> Any:
        """`call`, with a collective's failure reported as the worker death that caused it."""
        try:
            return call()
        except RuntimeError as error:
            self.ranks.check_alive(grace_s=_DEATH_GRACE_S)
            raise RankDiedError(f"a tensor-parallel collective failed: {error}") from error
