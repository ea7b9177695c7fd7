"""The engine: requests in, one batched target forward per step, RequestOutputs out.

`LLMEngine.step()` reads schedule -> propose -> run -> verify -> output: the scheduler
picks a batch, the proposer (if any) drafts a token tree per decoding sequence (or the
batch runs several plain decode steps ahead), the model runner runs the target once over
everything, `BatchVerifier` samples and verifies, and `OutputProcessor` appends the tokens
with stop handling and builds the outputs. `LLM` (offline) and the server both drive it.

With `async_scheduling` (vLLM V1's name) the next step is scheduled, proposed and launched
on the device as soon as this step's tokens are appended, before this step's outputs are
rendered and handed to the caller: the device computes step t+1 while the host builds
step t's text and `RequestOutput`s and the caller streams them.

Hooks that tests and benchmarks may replace: `proposer`, `spec_control`, `runner.forward`
and `runner.decode_steps`, `verifier.sample_and_verify`, `clock` (the controller's step
timer) and `observer` (told of tokens of steps without trees).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import pathlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from cpu_draft.affinity import tp_worker_cpus
from gpu_target.hf_checkpoint import sampling_defaults
from gpu_target.kv_cache import BlockAllocator
from gpu_target.kv_offload import HitCountLog, PrefixCacheOffload
from gpu_target.loader import load_config, load_tokenizer, resolve_model_path
from gpu_target.runner import num_kv_blocks
from gpu_target.sampler import sample, target_probs
from gpu_target.target import CacheShape, TargetSpec, build_runner, load_model, make_kv_pool
from gpu_target.tensor_parallel import SINGLE, local_config
from gpu_target.tp_worker import DrivingRunner, start_ranks
from hetero.core.config import EngineConfig
from hetero.core.protocols import (
    DEFAULT_TARGET_PARALLELISM,
    MAX_TREE_NODES,
    DraftsAhead,
    KnowsWhenReady,
    ProposalRequest,
    Proposer,
    SpecStats,
)
from hetero.core.sampling_params import SamplingParams, generation_config_overrides
from hetero.input_layout import ChunkRows, SampleRow, build_chunks, row_offsets
from hetero.input_processor import InputProcessor
from hetero.output_processor import OutputProcessor
from hetero.outputs import RequestOutput
from hetero.proposers import build_proposer
from hetero.scheduler import ScheduledSeq, Scheduler, Sequence, SequenceGroup
from hetero.spec.controller import SpeculationController, cut_short
from hetero.spec.draining import DrainingBatch
from hetero.spec.step_trees import StepTrees
from hetero.spec.verifier import BatchVerifier

logger = logging.getLogger("hetero")


def _generation_defaults(config: EngineConfig, model_path) -> dict:
    """The sampling parameters requests default to, as vLLM's `generation_config` and
    `override_generation_config` give them: the model directory's generation_config.json for
    "auto", none for "vllm", else the given directory's; then the overrides over those. Logged
    when there are any, as vLLM does, since they change unset fields' outputs."""
    defaults, sources = {}, []
    if config.generation_config != "vllm":
        directory = pathlib.Path(model_path if config.generation_config == "auto" else config.generation_config)
        defaults = sampling_defaults(directory) if directory.is_dir() else {}
        if defaults:
            sources.append(f"{directory / 'generation_config.json'} (generation_config='vllm' leaves it out)")
    overrides = generation_config_overrides(config.override_generation_config)
    if overrides:
        sources.append("override_generation_config")
    defaults.update(overrides)
    if defaults:
        logger.info("default sampling parameters: %s, from %s", defaults, " then ".join(sources))
    return defaults


_DEFAULT_TREE_NODES = 16


def _unwatched(phase: str, collectives: bool = False) -> contextlib.AbstractContextManager:
    """One GPU: a start-up phase with no other rank to wait for."""
    return contextlib.nullcontext()


def _unreported(phase: str) -> None:
    """One GPU: no watchdog to tell of start-up phases."""


@functools.lru_cache(maxsize=None)
def _freeze_startup_heap() -> None:
    """Take the objects alive once the first engine is built (torch, transformers, the engine
    itself) out of the cyclic garbage collector's scans, as vLLM does after start-up.

    A full collection walks every tracked object, and the steps that allocate most would
    otherwise set one off in the middle of a step, with the GPU waiting. An engine dropped
    later is still freed, by reference counting: it holds no reference cycles
    (`test_an_engine_is_freed_without_the_cyclic_collector`). Once per process; the objects
    are handed back at exit, for extension modules that check for leaks then.
    """
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


@dataclass
class _StepPlan:
    """A scheduled step, what the engine decided to run for it, and its device work once launched."""

    scheduled: list[ScheduledSeq]
    decode_only: bool  # no prefill chunk: a step the controller may measure
    nodes_per_seq: int = 0  # tree nodes granted per sequence (0: no speculation)
    unready: bool = False  # asked for trees, none came back because the proposer was not ready (`TokenTree.pending`): not judged
    draft_wait_s: float = 0.0  # the time the launch waited for the proposer's trees
    switch: bool = False  # the first speculative step after steps without trees: a drafting-ahead proposer caught up on their tokens
    num_steps: int = 1  # decode steps run ahead (1: a single step)
    rooms: list[int] = field(default_factory=list)  # the sequences' remaining lengths, for `cut_short`
    tokens_before: int = 0  # generated tokens before the step, to count what it emitted
    layout: Optional[list[ChunkRows]] = None  # the logits rows each sequence gets (a single step)
    result: Optional[torch.Tensor] = None  # launched: the rows' logits, or the window's tokens [B, num_steps]
    trees: Optional[StepTrees] = None  # the trees proposed for the step, flat (those attached, unless some were dropped)
    verified: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # verified: the trees' node counts and accepted drafts
    filled: list[Sequence] = field(default_factory=list)  # verified: sequences that took tokens and go on


class LLMEngine:
    def __init__(self, config: EngineConfig, proposer: Optional[Proposer] = None):
        self.config = config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        real_weights = config.load_format != "dummy"
        model_path = resolve_model_path(config.model, require_weights=real_weights)
        self.model_config = load_config(model_path, require_weights=real_weights, hf_overrides=config.hf_overrides)
        self.tokenizer = (
            None if config.skip_tokenizer_init else load_tokenizer(model_path, config.tokenizer, config.trust_remote_code)
        )
        self.default_sampling_fields = _generation_defaults(config, model_path)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's "
                f"max_position_embeddings ({self.model_config.max_position_embeddings})"
            )
        self.inputs = InputProcessor(self.tokenizer, self.model_config, self.max_model_len, self.device, config.max_logprobs)
        self.eos_token_ids = self.inputs.eos_token_ids
        spec = TargetSpec(str(model_path), self.model_config, self.dtype, self.device.type, real_weights, config.seed,
                          config.quantization, config.batch_invariant, config.block_size, config.enforce_eager,
                          custom_all_reduce=not config.disable_custom_all_reduce)
        # Tensor parallelism: ranks 1..N-1 in worker processes, rank 0 here (gpu_target/tp_worker.py);
        # rank 0's start-up phases run watched, so that a stalled or dead worker is an error, not a hang.
        world_size = config.tensor_parallel_size
        self._ranks = start_ranks(spec, world_size, tp_worker_cpus(world_size - 1)) if world_size > 1 else None
        tp = self._ranks.tp if self._ranks is not None else SINGLE
        rank0_phase = self._ranks.running if self._ranks is not None else _unwatched
        with rank0_phase("loading weights"):
            self.model = load_model(spec, tp, self.device)
        if self._ranks is not None:
            self._ranks.wait_for("loaded")
        # Each rank holds its own KV heads of every block: sized by rank 0's share.
        num_blocks = num_kv_blocks(config, local_config(self.model_config, config.tensor_parallel_size), self.max_model_len,
                                   self.dtype, self.device)
        reserved = 1 if self.device.type == "cuda" else 0  # the CUDA-graph padding's null block
        self.kv_pool = make_kv_pool(spec, tp, num_blocks + reserved, self.device)
        offload = (
            PrefixCacheOffload.sized(self.kv_pool, config.cpu_offload_gib, config.apc_offload_min_access_threshold)
            if config.enable_prefix_cache_offload else None
        )
        allocator = BlockAllocator(
            num_blocks, config.block_size, config.enable_prefix_caching, first_block=reserved,
            offload=offload, hit_count_log=HitCountLog() if config.apc_offload_enable_hit_cnt else None,
        )
        max_batched = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
        self.scheduler = Scheduler(allocator, config.max_num_seqs, max_batched)
        self.proposer = proposer if proposer is not None else build_proposer(config, self.model_config, self.tokenizer)
        # Told of the tokens of steps without trees, so that it drafts the next tree meanwhile.
        self.observer = self.proposer if isinstance(self.proposer, DraftsAhead) else None
        # Says how long its pending trees stay pending (`_propose`: not asked again before then).
        self.readiness = self.proposer if isinstance(self.proposer, KnowsWhenReady) else None
        max_tree_nodes = min(config.num_speculative_tokens or _DEFAULT_TREE_NODES, MAX_TREE_NODES)
        self.num_scheduler_steps = config.resolve_scheduler_steps(self.device)
        target_parallelism = self.proposer.target_parallelism if self.proposer is not None else DEFAULT_TARGET_PARALLELISM
        # A step's tokens: the scheduler's budget, plus the tree nodes verified beside it.
        step_tokens = self.scheduler.max_num_batched_tokens + (target_parallelism if self.proposer is not None else 0)
        shape = CacheShape(num_blocks + reserved, config.max_num_seqs, 1 + max_tree_nodes if self.proposer is not None else 1,
                           self.max_model_len, step_tokens)
        if self._ranks is not None:
            self._ranks.build(shape)  # the workers capture their graphs alongside rank 0: the collectives pair up
        with rank0_phase("building the runner", collectives=True):  # warm-up and capture run the collectives
            self.runner = build_runner(spec, self.model, self.kv_pool, tp, shape,
                                       self._ranks.report if self._ranks is not None else _unreported)
        graph_runner = self.runner.graph_runner
        if graph_runner is not None:  # stages the block tables from the scheduler's rows (rank 0's runner)
            graph_runner.table_rows = self.scheduler.table_rows
        self.cuda_graph_capture_seconds = graph_runner.capture_seconds if graph_runner is not None else 0.0
        if self._ranks is not None:
            self._ranks.wait_for("built")
            self.runner = DrivingRunner(self.runner, self._ranks)
        self.spec_control = SpeculationController(
            max_tree_nodes, target_parallelism, query_buckets=graph_runner.query_buckets if graph_runner is not None else None
        )
        self.verifier = BatchVerifier(self.scheduler, self.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len, self.scheduler)
        self.spec_stats = SpecStats()
        self.num_trees_withheld = 0  # sequence-steps whose tree DraftBackoff withheld (drafts that kept missing)
        self.draft_wait_seconds = 0.0  # time the engine waited for the proposer's trees
        self.num_unready_steps = 0  # steps whose proposal came back only pending (the proposer not ready yet)
        self._proposer_pending = False  # the last proposal had trees the proposer was not ready to draft
        self._unready_steps = 0  # single steps in a row that got only pending trees (then a plain window)
        self._proposals_held_until = 0.0  # (self.clock()) no proposal before then: the proposer said it is not ready
        self._decoded_plainly = False  # the last step with decoding sequences gave them no trees
        self.clock = time.perf_counter  # step timing for the controller (tests replace it)
        self.async_scheduling = config.async_scheduling
        self._in_flight: Optional[_StepPlan] = None  # the step launched ahead (async scheduling)
        self._last_step_end: Optional[float] = None  # None: idle since, or nothing ran yet
        # Whether the caller takes its outputs only once every request is done (`LLM`, not a
        # server): then a batch with no request waiting drains, and the controller probes
        # losing speculation more rarely (`SpeculationController.nodes_per_sequence`).
        self.waits_for_all = False
        self.groups: dict[str, SequenceGroup] = {}
        torch.manual_seed(config.seed)
        self.num_prompt_tokens_total = 0
        _freeze_startup_heap()

    @property
    def num_generation_tokens_total(self) -> int:
        return self.outputs.num_generation_tokens

    # --------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        arrival_time: Optional[float] = None,
    ) -> None:
        """`prompt`: a string, or a dict with "prompt_token_ids" (and optionally "prompt")."""
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        group = self.inputs.new_group(request_id, prompt, params, arrival_time)
        for seq in group.seqs:
            self.scheduler.add(seq)
        self.groups[request_id] = group
        self.num_prompt_tokens_total += len(group.prompt_token_ids)

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)

    def collective_rpc(self, method: Union[str, Callable[..., Any]], timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict] = None) -> list:
        """vLLM's `collective_rpc`: ``method`` run on every tensor-parallel rank, their results in
        rank order (one on one GPU). A callable gets the rank's `ModelRunner` (its ``model``, a
        rank's shard of the target, ``kv_pool`` and ``device``) before ``args`` and ``kwargs``;
        a string names a `ModelRunner` method. It runs after the steps already launched. Ranks
        1..N-1 run it in their worker processes, so a callable must pickle (be defined at a
        module's top level), and so must its results; a rank's exception comes back as a
        RuntimeError with its traceback, ``timeout`` seconds without every result as a
        TimeoutError, and the engine serves on after either."""
        return self.runner.collective_rpc(method, timeout, tuple(args), kwargs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> propose -> run -> verify -> output.

        Under async scheduling the step verified here was launched by the previous call, and
        the next one is launched before this one's outputs are built. Every decision the
        next step depends on (stops, finished sequences, the proposer's verdicts, KV moves)
        is taken before it is scheduled, so the outputs are those of synchronous steps. A
        request added between two calls joins a step later; one aborted meanwhile has its
        part of the step in flight dropped.
        """
        started = self.clock()
        launched_before = self._in_flight is not None
        plan = self._in_flight if launched_before else self._launch(wait_for_restores=True)
        self._in_flight = None
        if plan is None:
            self._last_step_end = None  # idle: the wait before the next step is not work
            return []
        touched = self._verify(plan)
        if self.async_scheduling:
            self._in_flight = self._launch()
        self._observe(plan)
        self._register_filled(plan)
        self.spec_stats.record_batch(*plan.verified)
        outputs = self._outputs(touched)
        # The draft wait is the step's whose trees it waited for: under async scheduling that
        # step was launched by the last call, and this call's time holds the next one's wait.
        next_wait = self._in_flight.draft_wait_s if self._in_flight is not None else 0.0
        self._record_step(plan, started, (plan.draft_wait_s if launched_before else 0.0) - next_wait)
        return outputs

    def _launch(self, wait_for_restores: bool = False) -> Optional[_StepPlan]:
        """Schedule -> propose -> run: a step whose device work is queued (None: nothing to run).

        Only what the device's work needs comes before the runner call; the step's own
        bookkeeping (the sequences' length rooms, for the controller) follows it. With
        `wait_for_restores`, a step that would be empty because every admitted request
        waits for its prefix's copies from the CPU waits for the first of them instead.
        """
        scheduled = self.scheduler.schedule()
        while not scheduled and wait_for_restores and self.scheduler.restoring:
            self.scheduler.wait_for_restore()
            scheduled = self.scheduler.schedule()
        if not scheduled:
            return None
        plan = self._propose(scheduled)
        chunks, plan.layout = build_chunks(scheduled)
        if plan.num_steps > 1:
            plan.layout, plan.result = None, self._decode_ahead(chunks, scheduled, plan.num_steps)
        else:
            plan.result = self.runner.forward(chunks)
        if plan.decode_only and self.proposer is not None:
            plan.rooms = [self._length_room(item.seq) for item in scheduled]
        return plan

    def _propose(self, scheduled: list[ScheduledSeq]) -> _StepPlan:
        """Stamp first scheduling times, then ask for trees, or else reserve a run-ahead window."""
        now = time.time()
        for item in scheduled:
            metrics = item.seq.group.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.time_in_queue = now - metrics.arrival_time
        decoding = [item for item in scheduled if item.samples and item.num_new_tokens == 1]
        plan = _StepPlan(scheduled, decode_only=len(decoding) == len(scheduled))
        waited = self.draft_wait_seconds
        plan.nodes_per_seq, plan.trees = self._attach_trees(decoding, measured=plan.decode_only) if decoding else (0, None)
        plan.draft_wait_s = self.draft_wait_seconds - waited
        plan.unready = bool(plan.nodes_per_seq) and self._proposer_pending and all(item.tree is None for item in decoding)
        plan.tokens_before = self.num_generation_tokens_total
        if plan.unready:
            self.num_unready_steps += 1
        if plan.decode_only and plan.unready:
            # No tree anywhere, the proposer still preparing them. Once: a single step (a draft
            # worker catching up after a plain window needs about one). Twice in a row (it is
            # prefilling prompts): a plain window, which beats single steps and leaves it
            # uninterrupted, and no proposal until it expects to be ready (`KnowsWhenReady`).
            if self._unready_steps:
                plan.nodes_per_seq, plan.trees = 0, None
                held = self.readiness.ready_in() if self.readiness is not None else 0.0
                if held:
                    self._proposals_held_until = self.clock() + held
                    logger.debug("no proposal for %.0f ms: the proposer expects its pending trees ready then", 1e3 * held)
            self._unready_steps = 0 if self._unready_steps else 1
            self.spec_control.probe_not_judged(len(decoding))
        elif plan.decode_only:
            self._unready_steps = 0
        if decoding:
            # A proposer that drafts ahead catches up on the tokens of steps without trees first.
            plan.switch = (self.observer is not None and plan.decode_only and bool(plan.nodes_per_seq) and not plan.unready
                           and self._decoded_plainly)
            self._decoded_plainly = not plan.nodes_per_seq
        if plan.switch:
            # Told now, not when recorded: under async scheduling the next step is decided before
            # this one is recorded, and it must probe again (`SpeculationController.record_switch`).
            self.spec_control.record_switch(len(decoding), plan.draft_wait_s)
        if plan.decode_only and not plan.nodes_per_seq:
            plan.num_steps = self.scheduler.reserve_run_ahead(scheduled, self.num_scheduler_steps, self.max_model_len)
        return plan

    def _verify(self, plan: _StepPlan) -> list[SequenceGroup]:
        """Turn a launched step's results into tokens (the host waits for the device here) and append them.

        Under async scheduling the device idles from here to the next launch: only what
        that launch depends on is done here (the tokens, stops and finished sequences, the
        proposer's verdicts, KV moves, the controller's acceptance); telling a drafting-ahead
        proposer of a step without trees (a proposal carries the tokens it has not been told),
        the prefix cache's new blocks, the engine's totals, the outputs and the step's timing
        come after it (`step`).
        """
        if plan.layout is None:
            return self._append_window(plan, plan.result.tolist())
        return self._verify_logits(plan)

    def _verify_logits(self, plan: _StepPlan) -> list[SequenceGroup]:
        """Score prompt tokens, sample and verify, tell the proposer, append the tokens, compact the KV.

        Sequences finished since the step was launched (aborted under async scheduling) are skipped.
        """
        scheduled, layout, logits = plan.scheduled, plan.layout, plan.result
        if not plan.decode_only:  # prompt rows to score, prefill chunks that sample nothing
            self._consume_prompt_rows(scheduled, layout, logits)
        result = self.verifier.sample_and_verify(scheduled, layout, logits, plan.trees)
        if result.verdicts:
            # One call for the step, before the tokens are appended: a stop among them
            # releases its sequence, and the proposer should still learn this last step.
            self.proposer.commit(result.verdicts)
        touched = self._append(plan, result.appends, result.sample_logits)
        self.runner.copy_kv_slots(result.kv_moves)
        self.spec_control.record_acceptance(result.tree_sizes, result.accepted_counts)
        plan.verified = (result.tree_sizes, result.accepted_counts)
        return touched

    def _consume_prompt_rows(self, scheduled: list[ScheduledSeq], layout: list[ChunkRows], logits: torch.Tensor) -> None:
        """Score the prompt tokens asked for, and count the computed KV of prefill chunks that sample nothing."""
        prompt_slices, _, _ = row_offsets(layout)
        for item, rows, (start, stop) in zip(scheduled, layout, prompt_slices):
            if item.seq.is_finished:
                continue
            if rows.num_prompt_rows:
                self.outputs.record_prompt_logprobs(item.seq, logits[start:stop])
            if not rows.num_sample_rows:
                item.seq.num_computed += item.num_new_tokens
                self.scheduler.register_blocks(item.seq)

    def _append(self, plan: _StepPlan, appends, logits: Optional[torch.Tensor]) -> list[SequenceGroup]:
        """Append each sequence's new tokens (finishing those that stop); the groups touched, in order.

        A sequence that goes on and whose prompt is all in registered blocks is kept in
        `plan.filled`: the blocks its output filled enter the prefix cache after the next
        launch (`_register_filled`). Prompt blocks are registered at once: a request admitted
        by that launch may share them (a common system prompt).
        """
        now = time.time()
        touched: dict[str, SequenceGroup] = {}
        block_size = self.scheduler.block_size
        for seq, new_tokens, token_rows in appends:
            if self.outputs.append_tokens(seq, new_tokens, logits, token_rows, now):
                self._finish(seq)
            elif seq.num_registered_blocks * block_size < seq.num_prompt_tokens:
                self.scheduler.register_blocks(seq)
            else:
                plan.filled.append(seq)
            touched[seq.group.request_id] = seq.group
        return list(touched.values())

    def _register_filled(self, plan: _StepPlan) -> None:
        """Put the blocks the step filled in the prefix cache.

        Under async scheduling this follows the next launch, so that launch's admissions can
        match output blocks only up to the step before (prompt blocks are registered at once,
        `_append`); a sequence preempted by that launch registered its blocks before freeing
        them (`Scheduler._preempt`).
        """
        for seq in plan.filled:
            if not seq.is_finished:
                self.scheduler.register_blocks(seq)

    def _observe(self, plan: _StepPlan) -> None:
        """Tell a drafting-ahead proposer the tokens of a step without trees."""
        if plan.nodes_per_seq or self.observer is None:
            return
        self.observer.observe([ProposalRequest(item.seq.seq_key, item.seq.token_ids, item.seq.num_prompt_tokens, 0)
                               for item in plan.scheduled if item.seq.num_output_tokens and not item.seq.is_finished])

    def _outputs(self, touched: list[SequenceGroup]) -> list[RequestOutput]:
        outputs = self.outputs.request_outputs(touched)
        for output in outputs:
            if output.finished:
                self.groups.pop(output.request_id, None)
        return outputs

    def _record_step(self, plan: _StepPlan, started: float, moved_wait_s: float) -> None:
        """Show the controller the step's cost and tokens; ``moved_wait_s``: draft wait that
        belongs to this step but was timed in another call (less the next step's wait timed here).

        The controller compares whole steps: scheduling, building outputs and the caller's
        work between steps cost once per step, which a multi-step window spreads over many
        tokens and a speculative step not. Steps that the requests' lengths cut short (the
        last window or trees of sequences about to finish) say nothing about either
        option's steady pace, and are left out; nor does a speculative step without a tree
        because the proposer was not ready yet (``plan.unready``); nor the first speculative
        step after plain steps, whose wait was the proposer's catch-up (``plan.switch``, told at its launch).
        """
        finished = self.clock()
        tokens_per_seq = plan.nodes_per_seq + 1 if plan.nodes_per_seq else self.num_scheduler_steps
        emitted = self.num_generation_tokens_total - plan.tokens_before
        if (self.proposer is not None and plan.decode_only and not plan.unready and not plan.switch
                and not cut_short(plan.rooms, tokens_per_seq)):
            seconds = self._step_seconds(started, finished) + moved_wait_s
            self.spec_control.record_step(len(plan.scheduled), plan.nodes_per_seq > 0, emitted, seconds, plan.draft_wait_s)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step of %d sequences: %d trees, %d tokens, %.2f ms (%.2f ms waiting for drafts in all)",
                         len(plan.scheduled), sum(item.tree is not None for item in plan.scheduled), emitted,
                         1e3 * (finished - started), 1e3 * self.draft_wait_seconds)
        self._last_step_end = finished

    def _step_seconds(self, started: float, finished: float) -> float:
        """A step's cost: from the previous step's end while the engine is busy, else its own time.

        The gap since the previous step is the caller's handling of its outputs (streaming,
        bookkeeping), which the engine causes once per step. A gap longer than the step
        itself is taken for idle time (waiting for requests), and left out.
        """
        own = finished - started
        if self._last_step_end is None:
            return own
        gap = started - self._last_step_end
        return own + gap if 0 <= gap <= own else own

    def _length_room(self, seq: Sequence) -> int:
        """Tokens the sequence may still emit under its max_tokens and max_model_len."""
        return min(seq.group.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids))

    def _attach_trees(self, decoding: list[ScheduledSeq], measured: bool) -> tuple[int, Optional[StepTrees]]:
        """Ask the proposer for a tree per decoding sequence; the nodes granted each (0: no speculation), and the trees flat.

        A step that also prefills (``measured=False``: admitting a request) verifies trees
        too when speculation is the current verdict, without counting as a probe: in a
        server whose requests finish at different steps, admissions come one at a time and
        would otherwise make every other step a plain one.

        A sequence whose drafts keep missing is granted no nodes for a while (its
        `DraftBackoff`; not under `always_speculate`, which tests and cost benchmarks set to
        verify trees whatever they hold); the proposer still sees it, with a budget of 0, to
        keep up with its tokens. When no sequence is granted a node, the step is a plain one
        (run-ahead windows included) and the proposer is not asked. A step counts as
        speculative even when every tree comes back empty: proposing is part of what
        speculation costs; but one that got no tree while some were `TokenTree.pending` (the
        proposer not ready yet, ``_proposer_pending``, then `_StepPlan.unready`) says nothing
        about speculation's pace, and the controller does not judge it. Once it has answered
        only pending trees twice in a row, a proposer that says how long they stay pending
        (`KnowsWhenReady`: a draft worker prefilling a batch's prompts) is not asked before
        then (`_propose`): each proposal it could only answer pending would cost a wait and a
        single step in place of a multi-step window.
        """
        self._proposer_pending = False
        if self.proposer is None:
            return 0, None
        per_seq = self.spec_control.nodes_per_sequence(len(decoding), explore=measured, draining=self._draining_batch(decoding))
        if per_seq == 0 or self.clock() < self._proposals_held_until:
            return 0, None
        gated = not self.spec_control.always_speculate
        requests = []
        granted = withheld = 0
        max_model_len = self.max_model_len
        for item in decoding:
            seq = item.seq
            length = len(seq.token_ids)
            room = min(max_model_len - length, seq.group.max_tokens - (length - seq.num_prompt_tokens) - 1)
            budget = max(0, min(per_seq, room))
            if budget and gated and not seq.draft_backoff.grants_tree():
                budget = 0
                withheld += 1
            granted += budget > 0
            requests.append(ProposalRequest(seq.seq_key, seq.token_ids, seq.num_prompt_tokens, budget))
        self.num_trees_withheld += withheld
        if not granted:
            return 0, None
        asked = self.clock()
        trees = self.proposer.propose(requests)
        self.draft_wait_seconds += self.clock() - asked
        self._proposer_pending = any(not tree.ready for tree in trees)
        vocab = self.model_config.vocab_size
        # One range check over every node of the step; per tree only when something is out.
        flat = StepTrees([tree for tree in trees if tree.token_list])
        all_in_vocab = flat.in_vocab(vocab)
        for item, request, tree in zip(decoding, requests, trees):
            num_nodes = len(tree.token_list)
            if num_nodes == 0 or num_nodes > request.max_nodes:
                continue
            if not all_in_vocab and (tree.tokens.min() < 0 or tree.tokens.max() >= vocab):
                logger.warning("dropping a proposed tree with token ids outside the vocabulary [0, %d)", vocab)
                continue
            seq = item.seq
            if self.scheduler.try_extend(seq, seq.num_computed + 1 + num_nodes):
                item.tree = tree
            else:
                self.scheduler.trim_blocks(seq, seq.num_computed + 1)
        return per_seq, flat

    def _draining_batch(self, decoding: list[ScheduledSeq]) -> Optional[DrainingBatch]:
        """The decoding sequences' progress when the caller waits for all of them and no
        request waits to take a finished one's place (the batch's run ends with its slowest
        sequence); None otherwise."""
        if not self.waits_for_all or self.scheduler.waiting or self.scheduler.restoring:
            return None
        seqs = [item.seq for item in decoding]
        return DrainingBatch(
            remaining=[self._length_room(seq) for seq in seqs],
            trees=[seq.spec.num_steps for seq in seqs],
            accepted=[seq.spec.num_accepted_tokens for seq in seqs],
            squared=[seq.spec.sum_squared_accepted for seq in seqs],
        )

    def _decode_ahead(self, chunks, decoding: list[ScheduledSeq], num_steps: int) -> torch.Tensor:
        """Queue `num_steps` decode steps on the device; their tokens, [B, num_steps], stay there."""
        if all(item.seq.group.plain_greedy for item in decoding):
            return self.runner.decode_steps(chunks, num_steps, lambda logits: logits.argmax(dim=-1))
        rows = [self.verifier.row_context(SampleRow(item.seq, [])) for item in decoding]
        return self.runner.decode_steps(chunks, num_steps, lambda logits: sample(target_probs(logits, rows), rows))

    def _append_window(self, plan: _StepPlan, tokens: list[list[int]]) -> list[SequenceGroup]:
        """Append each sequence's tokens of a run-ahead window up to its stop (aborted ones skipped)."""
        live = [(item.seq, seq_tokens) for item, seq_tokens in zip(plan.scheduled, tokens) if not item.seq.is_finished]
        for seq, _ in live:
            seq.num_computed += plan.num_steps
        return self._append(plan, [(seq, seq_tokens, []) for seq, seq_tokens in live], None)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        seq.group.metrics.finished_time = time.time() if seq.group.is_finished else None
        if self.proposer is not None:
            self.proposer.release(seq.seq_key)
