"""Tensor-parallel ranks 1..N-1 as worker processes, driven by rank 0 in the engine's process.

Rank 0 runs in the coordinator's process, so the engine keeps calling a `ModelRunner` as on
one GPU and gets its logits where they were computed, with no copy between processes. Before
each of its calls, `DrivingRunner` sends the same call (the step's `SequenceChunk`s) down a
pipe to every worker, which replays it on its own shard; the model's collectives then pair up
rank by rank. Between multi-step decode steps rank 0 broadcasts the tokens it picked, so the
sampling callback itself never leaves the coordinator (as vLLM's driver worker, with rank 0
in the engine process). `LLMEngine.collective_rpc` (vLLM's) sends a function the same way;
each worker runs it on its runner and sends back its result, or its exception's traceback.

Control goes over multiprocessing pipes, tensors over a torch.distributed process group made
from a TCPStore without touching torch's global default group: ProcessGroupNCCL on CUDA
(graph-capturable), ProcessGroupGloo on the CPU; unless `disable_custom_all_reduce`, the
all-reduces that fit go through the one-shot kernel instead (gpu_target/custom_all_reduce.py).
A worker that dies or a start-up that stalls ends rank 0's waits through the watchdog
(gpu_target/tp_watchdog.py): the engine raises `RankDiedError` or `RankStalledError`, naming
each rank's last start-up phase, or, when rank 0's device is stuck in a collective no abort
reaches, the process ends with an error naming the dead rank. A worker whose pipe closes
(the coordinator is gone) exits, as it does when stuck on its GPU once the coordinator's
process is gone; workers are daemonic and stopped by a finalizer, so none outlives the engine.
At that stop each rank frees its CUDA graphs before its process group (graphs that captured
NCCL collectives keep the communicator busy), then shuts the group down while its peers do
(`release`). Gloo and NCCL here use TCP and CUDA IPC, the one-shot all-reduce cuMem handles
passed over Unix sockets: no named shared-memory segments of hetero's.
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
import time
import traceback
import uuid
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from gpu_target.cuda_graphs import CudaGraphRunner
from gpu_target.custom_all_reduce import OneShotAllReduce, set_up_one_shot
from gpu_target.runner import ModelRunner, PickTokens, SequenceChunk, run_rpc
from gpu_target.target import CacheShape, TargetSpec, build_runner, load_model, make_kv_pool, rank_device
from gpu_target.tensor_parallel import TensorParallel, check_divisible
from gpu_target.tp_watchdog import (DEATH_GRACE_S, WATCH_PERIOD_S, DeviceWork, Watchdog, abort_group, exit_with_parent,
                                    report_phase)

logger = logging.getLogger("hetero")

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
_STOP_TIMEOUT_S = 10.0
DEATH_POLL_S = 0.02  # how often a death is looked for within DEATH_GRACE_S


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
            if call == "rpc":
                try:
                    conn.send(_rpc_reply(runner, *args))
                except Exception:  # a result that does not pickle (nothing was sent)
                    conn.send(("rpc_error", traceback.format_exc()))
                continue
            _replay(runner, tp, call, args)
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)


def _rpc_reply(runner: ModelRunner, method, args: tuple, kwargs: Optional[dict]) -> tuple[str, Any]:
    """("result", what `run_rpc` returned), or ("rpc_error", its exception's traceback): a
    function's error is the caller's to see, not the end of this rank."""
    try:
        return "result", run_rpc(runner, method, args, kwargs)
    except Exception:
        return "rpc_error", traceback.format_exc()


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
        self._late = dict.fromkeys(self.conns, 0)  # per worker: replies still due to RPCs that timed out
        self.resources = RankResources()
        resources = self.resources  # not `self`: the watchdog's thread would keep the group alive
        self.watchdog = Watchdog(list(self.processes), port, world_size, lambda: abort_group(resources.group))
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
                self.check_alive(grace_s=DEATH_GRACE_S)
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
        self._replies(f"waiting for the workers to report {state!r}")

    def gather(self, timeout: Optional[float] = None) -> list:
        """Each worker's result of the RPC just sent (`DrivingRunner.collective_rpc`), in rank
        order; RuntimeError with their tracebacks where the function raised, TimeoutError where
        not every worker replied within `timeout` seconds (their replies are dropped as they
        come), RankDiedError where one died."""
        replies = sorted(self._replies("waiting for the workers' RPC results", timeout).items())
        failed = [f"tensor-parallel rank {rank} raised:\n{detail}" for rank, (reply, detail) in replies if reply == "rpc_error"]
        if failed:
            raise RuntimeError("\n".join(failed))
        return [detail for _, (_, detail) in replies]

    def _replies(self, phase: str, timeout: Optional[float] = None) -> dict[int, tuple[str, Any]]:
        """Each worker's next message, (reply, detail) by rank, waited for as `running` watches a
        phase; the replies of earlier calls that timed out are skipped, and a worker's "error"
        (it failed and exits) is a RankDiedError."""
        pending = dict(zip(self.conns, range(1, self.world_size)))
        sentinels = [p.sentinel for p in self.processes]
        replies: dict[int, tuple[str, Any]] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.running(phase):
            while pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    for conn in pending:
                        self._late[conn] += 1
                    raise TimeoutError(f"tensor-parallel ranks {sorted(pending.values())} did not reply within {timeout} s")
                for item in multiprocessing.connection.wait([*pending, *sentinels], min(WATCH_PERIOD_S, left or WATCH_PERIOD_S)):
                    if item in pending:
                        try:
                            reply, detail = item.recv()
                        except (EOFError, OSError):  # the worker is gone, maybe not reaped yet
                            self.check_alive(grace_s=DEATH_GRACE_S)
                            raise RankDiedError(f"tensor-parallel rank {pending[item]} closed its pipe") from None
                        if reply == "error":
                            raise RankDiedError(f"tensor-parallel rank {pending[item]} failed:\n{detail}")
                        if self._late[item]:  # the reply to a call that timed out
                            self._late[item] -= 1
                            continue
                        replies[pending.pop(item)] = (reply, detail)
                    else:  # a worker exited
                        self.check_alive()
                self.check_alive()
        return replies

    def build(self, shape: CacheShape) -> None:
        """Have every worker allocate its KV cache and capture its graphs (rank 0 does the same meanwhile)."""
        self.send("build", shape)

    def send(self, call: str, args: Any) -> None:
        self.check_alive()
        for conn in self.conns:
            try:
                conn.send((call, args))
            except OSError:
                self.check_alive(grace_s=DEATH_GRACE_S)
                raise

    def check_alive(self, grace_s: float = 0.0) -> None:
        """RankDiedError naming the first worker that exited, with its own error when it sent one;
        `grace_s`: until then, keep looking for one to exit (a collective can fail on a closed
        connection before the dying process is reaped, and the watchdog's thread may be reaping
        it at that moment: `is_alive` reads True until that thread records the exit code);
        RankStalledError once the watchdog found a stall."""
        if self.watchdog.stalled is not None:
            raise RankStalledError(self.watchdog.stalled)
        deadline = time.monotonic() + grace_s
        while True:
            self._raise_if_one_exited()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            exited = multiprocessing.connection.wait([p.sentinel for p in self.processes], min(remaining, DEATH_POLL_S))
            for process in self.processes:
                if process.sentinel in exited:
                    process.join(DEATH_POLL_S)  # its pipes close before it can be reaped
            if exited:
                time.sleep(DEATH_POLL_S)  # reaped by the other thread: its exit code lands shortly

    def _raise_if_one_exited(self) -> None:
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
        abort_group(resources.group)


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
        abort_group(resources.group)
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

    def collective_rpc(self, method, timeout: Optional[float] = None, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """`run_rpc` on every rank, rank 0's here once the workers were sent theirs (a function
        that runs collectives finds its peers in them); the results in rank order."""
        with self.ranks.on_device("running a collective RPC"):
            self.ranks.send("rpc", (method, args, kwargs))
            try:
                own = run_rpc(self.runner, method, args, kwargs)
            except Exception:
                self.ranks.gather(timeout)  # the workers' replies, so that the next call's are its own
                raise
            return [own, *self.ranks.gather(timeout)]

    def _guarded(self, call: Callable[[], Any]) -> Any:
        """`call`, with a collective's failure reported as the worker death that caused it."""
        try:
            return call()
        except RuntimeError as error:
            self.ranks.check_alive(grace_s=DEATH_GRACE_S)
            raise RankDiedError(f"a tensor-parallel collective failed: {error}") from error
