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
(graph-capturable), ProcessGroupGloo on the CPU. A worker that dies is seen through its
process sentinel: before each call, and by a watchdog thread that aborts the group so that
rank 0 is not left waiting in a collective; the engine then raises `RankDiedError`. A worker
whose pipe closes (the coordinator is gone) exits; workers are daemonic and stopped by a
finalizer, so none outlives the engine. Gloo and NCCL here use TCP and CUDA IPC, no named
shared-memory segments of hetero's.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
import traceback
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from gpu_target.runner import ModelRunner, PickTokens, SequenceChunk
from gpu_target.target import CacheShape, TargetSpec, build_runner, load_model, make_kv_pool, rank_device
from gpu_target.tensor_parallel import TensorParallel, check_divisible

logger = logging.getLogger("hetero")

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
_START_TIMEOUT_S = 1800.0  # loading a large shard and capturing its graphs
_STOP_TIMEOUT_S = 10.0
_DEATH_GRACE_S = 5.0


class RankDiedError(RuntimeError):
    """A tensor-parallel worker exited; the target cannot run another step."""


def make_group(backend: str, rank: int, world_size: int, port: int, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT):
    """A process group over a TCPStore on this host (rank 0 hosts the store), outside torch's global state."""
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(spec: TargetSpec, rank: int, world_size: int, port: int, cpus: Optional[list[int]],
              num_threads: Optional[int], conn) -> None:
    """A worker's life: build the rank, then replay the coordinator's calls until told to stop."""
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if cpus or num_threads:
            torch.set_num_threads(num_threads or len(cpus))
        device = rank_device(spec, TensorParallel(rank, world_size))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp = TensorParallel(rank, world_size, make_group(_backend(spec), rank, world_size, port))
        model = load_model(spec, tp, device)
        conn.send(("loaded", None))
        _, shape = conn.recv()
        runner = build_runner(spec, model, make_kv_pool(spec, tp, shape.num_blocks, device), tp, shape)
        conn.send(("built", None))
        while True:
            try:
                call, args = conn.recv()
            except EOFError:  # the coordinator is gone
                return
            if call == "stop":
                return
            _replay(runner, tp, call, args)
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)


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
        port = free_port()
        self.world_size = world_size
        self.conns = []
        self.processes = []
        for rank in range(1, world_size):
            ours, theirs = context.Pipe()
            cpus = worker_cpus[rank - 1] if rank - 1 < len(worker_cpus) else None
            process = context.Process(target=_run_rank, args=(spec, rank, world_size, port, cpus, num_threads, theirs),
                                      name=f"hetero-tp-rank{rank}", daemon=True)
            process.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(process)
        self._finalizer = weakref.finalize(self, _stop, list(self.processes), list(self.conns))
        try:
            self.tp = TensorParallel(0, world_size, make_group(_backend(spec), 0, world_size, port))
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=_watch, args=(list(self.processes), self.tp.group), daemon=True,
                                          name="hetero-tp-watchdog")
        self._watchdog.start()

    def wait_for(self, state: str, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Block until every worker reports `state` ("loaded", "built"); RankDiedError if one fails first."""
        pending = dict(zip(self.conns, range(1, self.world_size)))
        sentinels = [p.sentinel for p in self.processes]
        while pending:
            ready = multiprocessing.connection.wait([*pending, *sentinels], timeout_s)
            if not ready:
                raise RankDiedError(f"tensor-parallel ranks {sorted(pending.values())} did not report {state!r} in {timeout_s:.0f} s")
            for item in ready:
                if item in pending:
                    reply, detail = item.recv()
                    if reply == "error":
                        raise RankDiedError(f"tensor-parallel rank {pending[item]} failed:\n{detail}")
                    del pending[item]
                else:  # a worker exited
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
        connection before the dying process is reaped)."""
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


def _watch(processes: list, group: Any) -> None:
    """Abort the process group once any worker exits, so that rank 0 leaves a collective it waits in."""
    multiprocessing.connection.wait([p.sentinel for p in processes])
    abort = getattr(group, "abort", None)
    if abort is not None and any(p.exitcode not in (0, None) for p in processes):
        try:
            abort()
        except Exception:  # the group may be gone already; rank 0 then sees the error itself
            logger.debug("aborting the tensor-parallel group failed", exc_info=True)


def _stop(processes: list, conns: list) -> None:
    for conn in conns:
        try:
            conn.send(("stop", ()))
        except OSError:
            pass
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

    def forward(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        self.ranks.send("forward", (list(chunks),))
        return self._guarded(lambda: self.runner.forward(chunks))

    def decode_steps(self, chunks: Sequence[SequenceChunk], num_steps: int, pick: PickTokens) -> list[list[int]]:
        self.ranks.send("decode_steps", (list(chunks), num_steps))
        tp = self.ranks.tp
        return self._guarded(lambda: self.runner.decode_steps(chunks, num_steps, lambda logits: tp.broadcast(pick(logits))))

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
