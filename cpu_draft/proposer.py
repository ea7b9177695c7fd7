"""Draft-model proposers: the CPU worker process, or the same Drafter in the engine's process.

Both keep no state the engine must trust: each ``propose`` carries every sequence's real
tokens, and the drafter diffs them against what its KV holds. That is what makes
``commit`` a no-op and recovery simple: after a worker fault the new worker is sent each
sequence's full token ids with its next proposal and rebuilds its KV from them.

Faults (worker mode): a worker that dies, answers garbage or stays silent for
``reply_timeout_s`` is logged, killed and restarted in the background; until the new
one reports READY, proposals are empty trees, so the engine decodes plainly and no
request waits or changes. After ``MAX_CONSECUTIVE_FAILURES`` failed restarts the
proposer gives up and stays empty. A reply that is merely late (the worker's cores taken
from it for a while) is not waited for past `LATE_REPLY_STEPS` of the engine's steps:
the proposal is answered with empty trees (the step decodes one token a sequence, and the
controller judges speculation by it, wait included), and the late reply is read and
dropped before the next proposal is sent.

Settings: `hetero.core.config.DraftConfig` (``EngineConfig.draft``).
"""
from __future__ import annotations

import dataclasses
import logging
import subprocess
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from cpu_draft.affinity import default_draft_cpus, pin_coordinator
from cpu_draft.drafter import DraftModelOptions, Drafter, common_prefix_length
from cpu_draft.messages import (
    PROPOSE,
    READY,
    SHUTDOWN,
    STAT_NAMES,
    SYNC,
    TREES,
    ContextUpdate,
    max_update_tokens,
    read_trees,
    split_updates,
    update_arrays,
)
from cpu_draft.worker import WorkerOptions, launch_command
from gpu_target.loader import load_config, load_tokenizer, resolve_model_path
from gpu_target.model_config import ModelConfig
from hetero.core.config import EngineConfig
from hetero.core.protocols import ProposalRequest, Proposer, TokenTree, Verdict
from ipc import Channel, IPCError, RecvTimeoutError

logger = logging.getLogger("hetero.cpu_draft")

CHANNEL_PREFIX = "hetero-draft"
SLOT_BYTES = 1 << 20
NUM_SLOTS = 4
HEARTBEAT_TIMEOUT_S = 10.0
MAX_CONSECUTIVE_FAILURES = 5
_VOCAB_SAMPLE = 512
INITIAL_AHEAD_NODES = 4  # tree size drafted ahead before the engine first asks for one (then: its last budget)


REPLY_SPIN_S = 0.02  # the coordinator spins this long for the worker's trees before it sleeps (a wake-up costs more)
# A reply later than this many of the engine's steps between consecutive proposals (and at least
# LATE_REPLY_FLOOR_S) is not waited for: a tree drafted now costs under a step, a stalled worker more.
LATE_REPLY_STEPS = 3
LATE_REPLY_FLOOR_S = 0.02
DRAFT_START_TIMEOUT_S = 600.0  # a worker loading its weights (and building the native forward) may be slow


def build_draft_proposer(config: EngineConfig, target_config: ModelConfig, tokenizer):
    """The proposer for ``config.speculative_model``: a CPU worker process, or in-process on the target's device."""
    draft_path = resolve_model_path(config.speculative_model)
    check_vocabularies_match(target_config, tokenizer, load_config(draft_path), load_tokenizer(draft_path))
    settings = config.draft
    keep = _special_token_ids(tokenizer)
    if config.cpu_draft_worker:
        on_cuda = config.resolve_device().type == "cuda"
        tp_workers = config.tensor_parallel_size - 1 if on_cuda else 0  # each pinned to a core of its own
        cpus = tuple(default_draft_cpus(settings.cpus, tp_workers))
        if on_cuda:  # a CPU target computes on every core it has
            logger.info("coordinator pinned to cpus %s, the draft worker to %s", pin_coordinator(cpus, tp_workers), list(cpus))
        options = WorkerOptions(
            model=str(draft_path),
            draft=_model_options(config, torch.device("cpu"), resolve_cpu_dtype(cpu_dtype(settings.dtype)), keep),
            cpus=cpus,
            num_threads=settings.threads,
            overlap=settings.overlap,
            budget=min(config.num_speculative_tokens or INITIAL_AHEAD_NODES, INITIAL_AHEAD_NODES),
        )
        return WorkerDraftProposer(options, settings.reply_timeout_s, DRAFT_START_TIMEOUT_S)
    device = config.resolve_device()
    options = _model_options(config, device, config.resolve_dtype(device), keep)
    nodes = config.num_speculative_tokens or INITIAL_AHEAD_NODES
    return InProcessDraftProposer(Drafter.load(str(draft_path), options), warm_up_nodes=nodes if device.type == "cuda" else 0)


def _special_token_ids(tokenizer) -> tuple[int, ...]:
    """Ids a reduced draft head always scores: the tokenizer's special tokens (EOS, chat markers)."""
    if tokenizer is None:
        return ()
    ids = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, token in added.items() if getattr(token, "special", False))
    return tuple(sorted(ids))


def cpu_dtype(requested: str) -> Optional[torch.dtype]:
    """The CPU draft worker's dtype for DraftConfig.dtype: ``auto`` (None; `resolve_cpu_dtype` picks), ``float32`` or ``bfloat16``."""
    return {"auto": None, "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16}[requested]


_logged_auto_dtype: Optional[torch.dtype] = None


def resolve_cpu_dtype(requested: Optional[torch.dtype]) -> torch.dtype:
    """``requested``, or for auto (None): BF16 where the native draft forward builds on this machine, else FP32.

    With the native forward (`cpu_draft.native_model`) BF16 reads half the weight bytes and runs
    faster than FP32 at every batch size; the lean torch forward it falls back to is the other way
    round (oneDNN's BF16 matmuls carry a fixed cost per call at a small draft's shapes), so there
    FP32 stays (bench/results/cpu_draft-h100host.csv). Logged once per choice.
    """
    global _logged_auto_dtype
    if requested is not None:
        return requested
    from cpu_draft import native  # the first call builds the library (cached on disk for the worker)

    dtype = torch.bfloat16 if native.available() else torch.float32
    if dtype != _logged_auto_dtype:
        logger.info("draft_dtype auto: %s (the native draft forward %s)", str(dtype).removeprefix("torch."),
                    "builds here" if dtype == torch.bfloat16 else "is unavailable")
        _logged_auto_dtype = dtype
    return dtype


def _model_options(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                   keep_token_ids: tuple[int, ...]) -> DraftModelOptions:
    settings = config.draft
    return DraftModelOptions(
        dtype=dtype,
        device=str(device),
        int8_weights=settings.quantization == "int8",
        tree_width=settings.tree_width,
        kv_cache_bytes=int(settings.kv_cache_gib * 2**30),
        max_num_seqs=config.max_num_seqs,
        block_size=config.block_size,
        draft_vocab_size=settings.draft_vocab_size,
        token_map=settings.speculative_token_map,
        keep_token_ids=keep_token_ids,
        max_model_len=config.max_model_len,
        cuda_graphs=not config.enforce_eager,
    )


def check_vocabularies_match(target_config: ModelConfig, target_tokenizer, draft_config: ModelConfig, draft_tokenizer) -> None:
    """ValueError unless the draft's vocabulary is the target's: same size, same token for sampled ids."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"speculative_model has a vocabulary of {draft_config.vocab_size} tokens but the target model has "
            f"{target_config.vocab_size}: the draft must share the target's tokenizer"
        )
    size = min(len(target_tokenizer), len(draft_tokenizer))
    if len(target_tokenizer) != len(draft_tokenizer):
        raise ValueError(
            f"speculative_model's tokenizer has {len(draft_tokenizer)} tokens but the target's has "
            f"{len(target_tokenizer)}: the draft must share the target's tokenizer"
        )
    ids = sorted(set(np.linspace(0, size - 1, num=min(size, _VOCAB_SAMPLE), dtype=np.int64).tolist()) | set(target_tokenizer.all_special_ids))
    ours, theirs = target_tokenizer.convert_ids_to_tokens(ids), draft_tokenizer.convert_ids_to_tokens(ids)
    for token_id, target_token, draft_token in zip(ids, ours, theirs):
        if target_token != draft_token:
            raise ValueError(
                f"speculative_model's tokenizer maps id {token_id} to {draft_token!r} but the target's maps it to "
                f"{target_token!r}: the draft must share the target's tokenizer"
            )


class InProcessDraftProposer(Proposer):
    """The Drafter run synchronously in the engine's process, on the engine's device (vLLM's arrangement)."""

    def __init__(self, drafter: Drafter, warm_up_nodes: int = 0):
        self.drafter = drafter
        if warm_up_nodes:
            drafter.warm_up(warm_up_nodes)

    def propose(self, batch: Sequence[ProposalRequest]) -> list[TokenTree]:
        for request in batch:
            self.drafter.set_context(request.request_id, request.token_ids)
        return self.drafter.draft([(r.request_id, r.max_nodes) for r in batch])

    def commit(self, verdicts: Sequence[Verdict]) -> None:
        """Nothing to do: the next ``propose`` carries the accepted tokens and the drafter rolls back to them."""

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)


class _WorkerProcess:
    """One draft worker process and the channel it serves."""

    def __init__(self, options: WorkerOptions):
        self.channel = Channel.create(CHANNEL_PREFIX, NUM_SLOTS, SLOT_BYTES, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        try:
            self.process = subprocess.Popen(launch_command(dataclasses.asdict(self.channel.spec), options), stdin=subprocess.DEVNULL)
        except BaseException:
            self.channel.close()
            raise
        self.ready = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def poll_ready(self) -> bool:
        """True once READY arrived; never waits."""
        if not self.ready:
            message = self.channel.try_recv()
            if message is not None:
                if message.kind != READY:
                    raise IPCError(f"draft worker sent message kind {message.kind} before READY")
                self.ready = True
        return self.ready

    def wait_ready(self, timeout_s: float, model: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if not self.is_alive():
                raise RuntimeError(f"the draft worker exited with code {self.process.returncode} while loading {model}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the draft worker did not load {model} within {timeout_s} s")
            try:
                message = self.channel.recv(timeout=0.2)
            except RecvTimeoutError:
                continue
            if message.kind != READY:
                raise IPCError(f"draft worker sent message kind {message.kind} before READY")
            self.ready = True

    def stop(self, graceful: bool) -> None:
        if graceful and self.ready and self.is_alive():
            try:
                self.channel.send(SHUTDOWN, {}, timeout=1.0)
                self.process.wait(5.0)
            except (IPCError, subprocess.TimeoutExpired):
                pass
        if self.is_alive():
            self.process.kill()
        self.process.wait()
        self.channel.close()


@dataclass
class _Slot:
    """The current worker, held apart from the proposer so that its finalizer can stop it."""

    worker: Optional[_WorkerProcess] = None

    def stop(self, graceful: bool = True) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.stop(graceful)


@dataclass
class _Counters:
    values: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAT_NAMES, 0.0))

    def add(self, other: dict[str, float]) -> None:
        for name in STAT_NAMES:
            self.values[name] += other.get(name, 0.0)


class WorkerDraftProposer(Proposer):
    """Proposals from a draft worker process over a shared-memory channel, with restart on failure."""

    def __init__(self, options: WorkerOptions, reply_timeout_s: float = 10.0, start_timeout_s: float = 600.0):
        self.options = options
        self.reply_timeout_s = reply_timeout_s
        self.restarts = 0
        self.faults = 0
        self._consecutive_failures = 0
        self._ids: dict[str, int] = {}
        self._next_id = 0
        self._sent: dict[int, list[int]] = {}  # what the current worker was told of each sequence
        self._released: list[int] = []
        self._past = _Counters()  # stats of workers that are gone
        self._current: dict[str, float] = {}
        self.late_replies = 0  # proposals answered with empty trees because the worker's reply was late
        self._outstanding: Optional[float] = None  # when the proposal whose reply is unread was sent
        self._replied: Optional[float] = None  # when the last reply came, while no SYNC went out since
        self._step_s: Optional[float] = None  # running mean of the time from a reply to the next proposal
        self._ready_at: Optional[float] = None  # when the last reply's pending trees should be ready (its estimate)
        self._slot = _Slot(_WorkerProcess(options))
        self._finalizer = weakref.finalize(self, self._slot.stop)
        try:
            self._slot.worker.wait_ready(start_timeout_s, options.model)
        except BaseException:
            self.close()
            raise

    @property
    def worker_pid(self) -> Optional[int]:
        worker = self._slot.worker
        return worker.pid if worker is not None else None

    def poll_ready(self) -> bool:
        """Whether a worker is up and has loaded its model; notices (and restarts) one that died starting."""
        return self._ensure_ready()

    def stats(self) -> dict[str, Any]:
        totals = _Counters()
        totals.add(self._past.values)
        totals.add(self._current)
        values = dict(totals.values)
        busy = values["hidden_s"] + values["exposed_s"]
        values["overlap_share"] = values["hidden_s"] / busy if busy else 0.0
        values.update(restarts=self.restarts, faults=self.faults, late_replies=self.late_replies)
        return values

    # ------------------------------------------------------------- protocol
    def observe(self, batch: Sequence[ProposalRequest]) -> None:
        """Send the sequences' new tokens (SYNC, no reply): the worker catches its KV up and drafts
        their next trees while the GPU runs plain steps, so the next `propose` finds them ready."""
        self._replied = None  # plain steps come between the last proposal and the next
        if not batch or not self._ensure_ready() or not self._slot.worker.channel.can_send():
            return  # a busy worker gets the tokens with a later message (`_sent` still holds what it has)
        _, messages = self._update_messages(batch)
        if not messages[0]["ids"].size and not messages[0]["released"].size:
            return
        try:
            for arrays in messages:
                self._slot.worker.channel.send(SYNC, arrays, timeout=self.reply_timeout_s)
            self._released = []
        except Exception as exc:  # noqa: BLE001 - a dead or hung worker must never stop the engine
            self._fail(exc)

    def propose(self, batch: Sequence[ProposalRequest]) -> list[TokenTree]:
        empty = [TokenTree.empty() for _ in batch]
        if not batch or not self._ensure_ready():
            return empty
        asked = time.monotonic()
        if self._replied is not None:
            step = asked - self._replied
            self._step_s = step if self._step_s is None else 0.7 * self._step_s + 0.3 * step
        worker = self._slot.worker
        try:
            if self._outstanding is not None:  # a late reply to drop first (its trees are for contexts since passed)
                late = self._await_reply(worker)
                if late is None:
                    return empty
                self._read_trees(worker, late)
            seq_ids, messages = self._update_messages(batch)
            messages[-1]["batch"] = np.asarray(seq_ids, np.int64)
            messages[-1]["max_nodes"] = np.asarray([r.max_nodes for r in batch], np.int64)
            for arrays in messages[:-1]:
                worker.channel.send(SYNC, arrays, timeout=self.reply_timeout_s)
            self._outstanding = time.monotonic()
            messages[-1]["sent_at"] = np.asarray([self._outstanding], np.float64)
            worker.channel.send(PROPOSE, messages[-1], timeout=self.reply_timeout_s)
            self._released = []
            reply = self._await_reply(worker)
            if reply is None:
                return empty
            trees = self._read_trees(worker, reply)
            if len(trees) != len(batch):
                raise IPCError(f"asked for {len(batch)} trees, got {len(trees)}")
        except Exception as exc:  # noqa: BLE001 - a dead, hung or garbled worker must never stop the engine
            self._fail(exc)
            return empty
        self._consecutive_failures = 0
        return trees

    def _late_after_s(self) -> float:
        """How long a reply is waited for before the proposal is answered empty (`LATE_REPLY_STEPS`);
        until the engine's step is measured, ``reply_timeout_s``."""
        if self._step_s is None:
            return self.reply_timeout_s
        return max(LATE_REPLY_FLOOR_S, LATE_REPLY_STEPS * self._step_s)

    def _await_reply(self, worker: "_WorkerProcess"):
        """The reply to the outstanding proposal, waited for up to `_late_after_s`; None when it is
        late (counted). A worker silent for ``reply_timeout_s`` since that proposal is hung
        (RecvTimeoutError)."""
        waited = time.monotonic() - self._outstanding
        if waited >= self.reply_timeout_s:
            raise RecvTimeoutError(f"no reply from the draft worker (pid {worker.pid}) within {self.reply_timeout_s} s")
        try:
            return worker.channel.recv(timeout=min(self._late_after_s(), self.reply_timeout_s - waited), spin_s=REPLY_SPIN_S)
        except RecvTimeoutError:
            if time.monotonic() - self._outstanding >= self.reply_timeout_s:
                raise  # hung, not late
            self.late_replies += 1
            self._replied = None  # the next proposal's distance from the last reply holds this wait: no step
            return None

    def _read_trees(self, worker: "_WorkerProcess", reply) -> list[TokenTree]:
        """A TREES reply's trees; takes its stats, frees its slot and marks the proposal answered."""
        if reply.kind != TREES:
            raise IPCError(f"expected TREES, got message kind {reply.kind}")
        trees = read_trees(reply.arrays)
        self._current = dict(zip(STAT_NAMES, reply.arrays["stats"].tolist()))
        ready_in = float(reply.arrays["ready_in_s"][0])
        self._ready_at = time.monotonic() + ready_in if ready_in > 0 else None
        worker.channel.release()
        self._outstanding = None
        self._replied = time.monotonic()
        return trees

    def ready_in(self) -> float:
        """Seconds until the trees the worker last answered pending should be ready: its estimate
        (its backlog of prompt tokens over its prefill pace), counted from its reply; 0 once passed."""
        return 0.0 if self._ready_at is None else max(0.0, self._ready_at - time.monotonic())

    def commit(self, verdicts: Sequence[Verdict]) -> None:
        """Nothing to send: the next ``propose`` carries the accepted tokens, and the worker rolls back to them."""

    def release(self, request_id: str) -> None:
        seq_id = self._ids.pop(request_id, None)
        if seq_id is not None and self._sent.pop(seq_id, None) is not None:
            self._released.append(seq_id)

    def close(self) -> None:
        """Stop the worker (SHUTDOWN, then SIGKILL if it lingers) and remove the channel."""
        self._finalizer()

    # ------------------------------------------------------------- internals
    def _update_messages(self, batch: Sequence[ProposalRequest]) -> tuple[list[int], list[dict[str, np.ndarray]]]:
        """The batch's worker ids, and its context updates (and the released ids) as the arrays
        of one or more messages, each within a ring slot; recorded as sent."""
        seq_ids = [self._seq_id(r.request_id) for r in batch]
        updates = [u for u in (self._update(s, r.token_ids) for s, r in zip(seq_ids, batch)) if u is not None]
        groups = split_updates(updates, max_update_tokens(SLOT_BYTES, len(batch)))
        return seq_ids, [update_arrays(group, self._released if index == 0 else ()) for index, group in enumerate(groups)]

    def _seq_id(self, request_id: str) -> int:
        seq_id = self._ids.get(request_id)
        if seq_id is None:
            seq_id = self._ids[request_id] = self._next_id
            self._next_id += 1
        return seq_id

    def _update(self, seq_id: int, token_ids: Sequence[int]) -> Optional[ContextUpdate]:
        """The change from what the worker holds for ``seq_id`` to ``token_ids``; None when there is none."""
        sent = self._sent.setdefault(seq_id, [])
        keep = common_prefix_length(sent, token_ids)
        if keep == len(sent) == len(token_ids):
            return None
        new_tokens = list(token_ids[keep:])
        del sent[keep:]
        sent.extend(new_tokens)
        return ContextUpdate(seq_id, keep, new_tokens)

    def _ensure_ready(self) -> bool:
        worker = self._slot.worker
        if worker is None:
            if self._consecutive_failures <= MAX_CONSECUTIVE_FAILURES:
                self._start_worker()  # a restart that failed to launch is retried here
            return False
        try:
            if worker.poll_ready():
                return True
        except IPCError as exc:
            self._fail(exc)
            return False
        if not worker.is_alive():
            self._fail(RuntimeError(f"it exited with code {worker.process.returncode} while starting"))
        return False

    def _fail(self, error: BaseException) -> None:
        """Log, kill, forget what the worker knew, and start a fresh one (or give up after repeated failures)."""
        worker = self._slot.worker
        self.faults += 1
        self._consecutive_failures += 1
        logger.warning(
            "draft worker (pid %s) failed: %s; decoding without drafts until it is restarted",
            worker.pid if worker else None,
            error,
        )
        self._past.add(self._current)
        self._current = {}
        self._slot.stop(graceful=False)
        self._sent.clear()
        self._released = []
        self._outstanding = self._replied = self._ready_at = None
        if self._consecutive_failures > MAX_CONSECUTIVE_FAILURES:
            logger.error("draft worker failed %d times in a row; speculative decoding stays off", self._consecutive_failures)
            return
        self._start_worker()

    def _start_worker(self) -> None:
        """Launch a fresh worker; if even that fails (e.g. /dev/shm full), stay without drafts for now."""
        try:
            self._slot.worker = _WorkerProcess(self.options)
        except Exception as exc:  # noqa: BLE001 - the engine must go on decoding
            logger.warning("draft worker restart failed: %s", exc)
            self._slot.worker = None
            self._consecutive_failures += 1
            return
        self.restarts += 1
