"""The engine: requests in, one batched target forward per step, RequestOutputs out.

`LLMEngine.step()` schedules a batch, asks the proposer (if any) for a token tree per
decoding sequence, runs the target once over everything, samples or verifies, and turns
the new tokens into text with stop handling. `LLM` (offline) and the server both drive it.
"""
from __future__ import annotations

import atexit
import functools
import gc
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from cpu_draft.affinity import tp_worker_cpus
from gpu_target.kv_cache import BlockAllocator, KVCachePool, extend_block_hashes
from gpu_target.kv_offload import HitCountLog, PrefixCacheOffload
from gpu_target.loader import load_config, load_tokenizer, resolve_model_path
from gpu_target.model_config import ModelConfig
from gpu_target.runner import SequenceChunk
from gpu_target.target import CacheShape, TargetSpec, build_runner, load_model, make_kv_pool
from gpu_target.tensor_parallel import SINGLE, check_divisible, local_config
from gpu_target.tp_worker import DrivingRunner, RankGroup
from gpu_target.sampler import (
    RowContext,
    greedy_accept,
    raw_logprobs,
    sample,
    target_probs,
    verify_tree,
)
from hetero.core.config import EngineConfig
from hetero.detokenizer import decode_new_text, find_stop_string
from hetero.outputs import CompletionOutput, Logprob, RequestOutput
from hetero.proposers import build_proposer
from hetero.core.protocols import MAX_TREE_NODES, DraftsAhead, ProposalRequest, Proposer, SpecStats, TokenTree, Verdict, tree_row_layout
from hetero.core.sampling_params import RequestOutputKind, SamplingParams
from hetero.scheduler import ScheduledSeq, Scheduler, Sequence, SequenceGroup
from hetero.spec.controller import SpeculationController
from hetero.spec.draining import DrainingBatch

logger = logging.getLogger("hetero")

_CPU_DEFAULT_KV_GIB = 4.0
_GPU_ACTIVATION_RESERVE_GIB = 4.0  # activations and CUDA-graph pools
_DEFAULT_TREE_NODES = 16
_DEFAULT_TARGET_PARALLELISM = 64


@dataclass
class _SampleRow:
    """One logits row that feeds sampling or verification, and whose sequence it is."""

    seq: Sequence
    path: list[int]  # draft tokens between the sequence's output and this row's position

    def context(self) -> list[int]:
        """Output tokens before this row's position (built only when a processor needs them)."""
        return self.seq.output_token_ids + self.path


@dataclass
class _ChunkRows:
    """The logits rows one scheduled sequence asked for: prompt-logprob rows, then sampling
    rows (none, the last new token's, or a tree's root and each of its nodes)."""

    seq: Sequence
    num_prompt_rows: int
    num_sample_rows: int
    tree: Optional[TokenTree] = None

    def sample_rows(self) -> list[_SampleRow]:
        """The sampling rows with the draft path before each one's position.

        Built only when a logits processor needs the rows' contexts: a greedy speculative
        step at batch 64 would otherwise build a few hundred paths it never reads.
        """
        if not self.num_sample_rows:
            return []
        rows = [_SampleRow(self.seq, [])]
        if self.tree is not None:
            tokens = self.tree.token_list
            for node, parent in enumerate(self.tree.parent_list):
                rows.append(_SampleRow(self.seq, rows[parent + 1].path + [tokens[node]]))
        return rows


def _as_int64(masks: list[int]) -> list[int]:
    """Masks as int64 values: node 62's bit lands on bit 63, the sign bit, as the kernels expect."""
    return [m - (1 << 64) if m >> 63 else m for m in masks]


@functools.lru_cache(maxsize=4096)
def _tree_layout(parents: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`tree_row_layout` with the masks as the kernels' int64 values, also once per shape."""
    depths, masks = tree_row_layout(parents)
    return depths, tuple(_as_int64(list(masks)))


def _cut_short(rooms: list[int], tokens_per_seq: int, tolerance: float = 0.1) -> bool:
    """Whether the sequences' remaining lengths (``rooms``) take more than ``tolerance`` of the
    ``tokens_per_seq`` each could emit this step: a step that mostly measures requests ending.

    A share, not any one sequence: in a server some request is always about to finish.
    """
    lost = sum(max(0, tokens_per_seq - room) for room in rooms)
    return lost > tolerance * tokens_per_seq * len(rooms)


def _can_run_ahead(seq: Sequence) -> bool:
    """Whether a sequence's next few tokens depend on their logits alone (see `_reserve_run_ahead`)."""
    params = seq.params
    return (
        params.logprobs is None
        and (params.best_of or params.n) == params.n
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.no_repeat_ngram_size
        and params.structured_outputs is None
        and seq.num_output_tokens >= params.min_tokens
    )


@functools.lru_cache(maxsize=None)
def _freeze_startup_heap() -> None:
    """Take the objects alive once the first engine is built (torch, transformers, the rest of
    the imports and the engine itself) out of the cyclic garbage collector's scans.

    A full collection walks every tracked object; with the imports in the heap (about 200
    thousand objects) one took 150 ms on the development vm, and the steps that allocate
    most (speculative ones, at large batches) set them off in the middle of a step, with the
    GPU waiting: 2.2 ms per batch-64 step on average there (bench.host_step, before the
    engine allocated less). The engine's own construction adds about 120 thousand more
    (modules imported on first use among them): frozen before it, the first collection
    after start-up still took 60 ms. vLLM freezes its heap after start-up the same way.
    An engine dropped later is still freed, by reference counting: it holds no reference
    cycles (`test_an_engine_is_freed_without_the_cyclic_collector`). Once per process;
    the objects are handed back at exit, for extension modules that check for leaks then.
    """
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


class LLMEngine:
    def __init__(self, config: EngineConfig, proposer: Optional[Proposer] = None):
        self.config = config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        real_weights = config.load_format != "dummy"
        model_path = resolve_model_path(config.model, require_weights=real_weights)
        self.model_config = load_config(model_path, require_weights=real_weights)
        self.tokenizer = (
            None if config.skip_tokenizer_init else load_tokenizer(model_path, config.tokenizer, config.trust_remote_code)
        )
        self.eos_token_ids = self._eos_token_ids()
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's "
                f"max_position_embeddings ({self.model_config.max_position_embeddings})"
            )
        spec = TargetSpec(str(model_path), self.model_config, self.dtype, self.device.type, real_weights, config.seed,
                          config.quantization, config.batch_invariant, config.block_size, config.enforce_eager)
        # Tensor parallelism: ranks 1..N-1 in worker processes, rank 0 here (gpu_target/tp_worker.py).
        self._ranks = self._start_ranks(spec)
        tp = self._ranks.tp if self._ranks is not None else SINGLE
        self.model = load_model(spec, tp, self.device)
        if self._ranks is not None:
            self._ranks.wait_for("loaded")
        num_blocks = self._num_kv_blocks(local_config(self.model_config, config.tensor_parallel_size))
        reserved = 1 if self.device.type == "cuda" else 0  # the CUDA-graph padding's null block
        self.kv_pool = make_kv_pool(spec, tp, num_blocks + reserved, self.device)
        offload = (
            PrefixCacheOffload.sized(self.kv_pool, config.cpu_offload_gib, config.apc_offload_min_access_threshold)
            if config.enable_prefix_cache_offload else None
        )
        allocator = BlockAllocator(
            num_blocks, config.block_size, config.enable_prefix_caching, first_block=reserved, offload=offload,
            hit_count_log=HitCountLog() if config.apc_offload_enable_hit_cnt else None,
        )
        max_batched = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
        self.scheduler = Scheduler(allocator, config.max_num_seqs, max_batched)
        self.proposer = proposer if proposer is not None else build_proposer(config, self.model_config, self.tokenizer)
        # Told of the tokens of steps without trees, so that it drafts the next tree meanwhile.
        self._observer = self.proposer if isinstance(self.proposer, DraftsAhead) else None
        max_tree_nodes = min(config.num_speculative_tokens or _DEFAULT_TREE_NODES, MAX_TREE_NODES)
        self.num_scheduler_steps = config.resolve_scheduler_steps(self.device)
        target_parallelism = getattr(self.proposer, "target_parallelism", _DEFAULT_TARGET_PARALLELISM)
        # A step's tokens: the scheduler's budget, plus the tree nodes verified beside it.
        step_tokens = self.scheduler.max_num_batched_tokens + (target_parallelism if self.proposer is not None else 0)
        shape = CacheShape(num_blocks + reserved, config.max_num_seqs, 1 + max_tree_nodes if self.proposer is not None else 1,
                           self.max_model_len, step_tokens)
        if self._ranks is not None:
            self._ranks.build(shape)  # the workers capture their graphs alongside rank 0: the collectives pair up
        self.runner = build_runner(spec, self.model, self.kv_pool, tp, shape)
        graph_runner = self.runner.graph_runner
        self.cuda_graph_capture_seconds = graph_runner.capture_seconds if graph_runner is not None else 0.0
        if self._ranks is not None:
            self._ranks.wait_for("built")
            self.runner = DrivingRunner(self.runner, self._ranks)
        self.spec_control = SpeculationController(
            max_tree_nodes, target_parallelism, query_buckets=graph_runner.query_buckets if graph_runner is not None else None
        )
        self.spec_stats = SpecStats()
        self.num_trees_withheld = 0  # sequence-steps whose tree DraftBackoff withheld (drafts that kept missing)
        self.draft_wait_seconds = 0.0  # time the engine waited for the proposer's trees
        self._clock = time.perf_counter  # step timing for the controller (tests replace it)
        self._last_step_end: Optional[float] = None  # None: idle since, or nothing ran yet
        # Whether the caller takes its outputs only once every request is done (`LLM`, not a
        # server): then a batch with no request waiting drains, and the controller probes
        # losing speculation more rarely (`SpeculationController.nodes_per_sequence`).
        self.waits_for_all = False
        self.groups: dict[str, SequenceGroup] = {}
        torch.manual_seed(config.seed)
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self._grammar_compiler = None  # built at the first request with structured_outputs
        _freeze_startup_heap()

    # ----------------------------------------------------------------- set-up
    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def _num_kv_blocks(self, layer_config: ModelConfig) -> int:
        """KV blocks that fit this rank's memory (with tensor parallelism, each rank holds its own KV heads of every block)."""
        c = self.config
        per_block = KVCachePool.bytes_per_block(layer_config, c.block_size, self.dtype)
        blocks_per_seq = -(-self.max_model_len // c.block_size)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            ours = torch.cuda.memory_allocated(self.device)
            others = total - free - torch.cuda.memory_reserved(self.device)
            budget = total * c.gpu_memory_utilization - others - ours - _GPU_ACTIVATION_RESERVE_GIB * 2**30
            num_blocks = int(budget // per_block)
            knob = (
                f"gpu_memory_utilization (GPU {total / 2**30:.1f} GiB, this process's tensors {ours / 2**30:.1f} GiB, "
                f"other processes {others / 2**30:.1f} GiB)"
            )
        else:
            space = c.kv_cache_space or _CPU_DEFAULT_KV_GIB
            num_blocks = min(int(space * 2**30 // per_block), c.max_num_seqs * blocks_per_seq + 1)
            knob = "kv_cache_space"
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV cache holds {max(num_blocks, 0) * c.block_size} tokens, fewer than max_model_len "
                f"({self.max_model_len}); raise {knob} or lower max_model_len"
            )
        return num_blocks

    def _start_ranks(self, spec: TargetSpec) -> Optional[RankGroup]:
        """The worker processes of tensor-parallel ranks 1..N-1 (None at tensor_parallel_size 1);
        on CUDA each pinned to a core of its own (cpu_draft/affinity.py: tp_worker_cpus), on
        the CPU each with its share of the cores as threads."""
        world_size = self.config.tensor_parallel_size
        if world_size == 1:
            return None
        check_divisible(self.model_config, world_size)
        if self.device.type == "cuda" and world_size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={world_size} exceeds the {torch.cuda.device_count()} visible GPUs"
            )
        if self.device.type == "cuda":
            return RankGroup(spec, world_size, tp_worker_cpus(world_size - 1))
        # On the CPU every rank computes: the cores are shared out, or the ranks' OpenMP
        # threads would spin on each other's cores while they wait in a collective.
        threads = max(1, len(os.sched_getaffinity(0)) // world_size)
        torch.set_num_threads(threads)
        return RankGroup(spec, world_size, num_threads=threads)

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
        if self.tokenizer is None and (params.detokenize or params.stop):
            raise ValueError("detokenize and stop strings need a tokenizer; skip_tokenizer_init=True is set")
        text, token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt ({len(token_ids)} tokens) is longer than max_model_len ({self.max_model_len}) "
                "minus the one token it must leave room to generate"
            )
        self._validate_logit_bias(params)
        num_seqs = max(params.n, params.best_of or params.n)
        grammars = self._grammar_states(params, num_seqs)
        group = SequenceGroup(request_id, text, token_ids, params, max_tokens, arrival_time or time.time())
        for index in range(num_seqs):
            seq = Sequence(group, index, self._generator(params.seed, index))
            seq.grammar = grammars[index] if grammars else None
            group.seqs.append(seq)
            self.scheduler.add(seq)
        self.groups[request_id] = group
        self.num_prompt_tokens_total += len(token_ids)

    def _validate_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is out of the vocabulary range [0, {vocab})")

    def _grammar_states(self, params: SamplingParams, count: int) -> list:
        """A fresh grammar state for each of the request's sequences ([] without structured_outputs).

        The grammar is compiled here, so a bad one is a ValueError before anything is scheduled.
        """
        spec = params.structured_outputs
        if spec is None:
            return []
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; skip_tokenizer_init=True is set")
        if self._grammar_compiler is None:
            from hetero.structured_output import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self._grammar_compiler.new_states(spec, count)

    def _tokenize(self, prompt: Any) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; with skip_tokenizer_init=True pass {'prompt_token_ids': [...]}")
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of the vocabulary range [0, {vocab})")

    def _generator(self, seed: Optional[int], index: int) -> Optional[torch.Generator]:
        """A seeded request's own generator, so it samples the same whatever the batch.

        Unseeded requests share the default generator (seeded from the engine's `seed`),
        which lets their rows be sampled in one batched call.
        """
        if seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if index == 0 else hash((seed, index)) & (2**63 - 1))
        return generator

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        started = self._clock()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            self._last_step_end = None  # idle: the wait before the next step is not work
            return []
        now = time.time()
        for item in scheduled:
            metrics = item.seq.group.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.time_in_queue = now - metrics.arrival_time
        decoding = [item for item in scheduled if item.samples and item.num_new_tokens == 1]
        decode_only = len(decoding) == len(scheduled)
        nodes_per_seq = self._attach_trees(decoding, measured=decode_only) if decoding else 0
        speculated = nodes_per_seq > 0
        tokens_before = self.num_generation_tokens_total
        rooms = [self._length_room(item.seq) for item in scheduled] if decode_only and self.proposer is not None else []
        num_steps = self._reserve_run_ahead(scheduled) if decode_only and not speculated else 1
        if num_steps > 1:
            touched = self._decode_ahead(scheduled, num_steps)
        else:
            chunks, layout = self._build_chunks(scheduled)
            logits = self.runner.forward(chunks)
            touched = self._consume_logits(scheduled, layout, logits)
        if not speculated and self._observer is not None:
            self._observer.observe([ProposalRequest(item.seq.seq_key, item.seq.token_ids, item.seq.num_prompt_tokens, 0)
                                    for item in scheduled if item.seq.num_output_tokens and not item.seq.is_finished])
        outputs = [
            self._request_output(group)
            for group in touched
            if group.is_finished or group.params.output_kind is not RequestOutputKind.FINAL_ONLY
        ]
        finished = self._clock()
        # The controller compares whole steps: scheduling, building outputs and the caller's
        # work between steps cost once per step, which a multi-step window spreads over many
        # tokens and a speculative step not. Steps that the requests' lengths cut short (the
        # last window or trees of sequences about to finish) say nothing about either
        # option's steady pace, and are left out.
        if self.proposer is not None and decode_only and not _cut_short(rooms, nodes_per_seq + 1 if speculated else self.num_scheduler_steps):
            emitted = self.num_generation_tokens_total - tokens_before
            self.spec_control.record_step(len(scheduled), speculated, emitted, self._step_seconds(started, finished))
        self._last_step_end = finished
        return outputs

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

    def _attach_trees(self, decoding: list[ScheduledSeq], measured: bool) -> int:
        """Ask the proposer for a tree per decoding sequence; the nodes granted each (0: no speculation).

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
        speculation costs.
        """
        if self.proposer is None:
            return 0
        per_seq = self.spec_control.nodes_per_sequence(len(decoding), explore=measured, draining=self._draining_batch(decoding))
        if per_seq == 0:
            return 0
        gated = not self.spec_control.always_speculate
        requests = []
        granted = withheld = 0
        for item in decoding:
            seq = item.seq
            room = min(self.max_model_len - len(seq.token_ids), seq.group.max_tokens - seq.num_output_tokens - 1)
            budget = max(0, min(per_seq, room))
            if budget and gated and not seq.draft_backoff.grants_tree():
                budget = 0
                withheld += 1
            granted += budget > 0
            requests.append(ProposalRequest(seq.seq_key, seq.token_ids, seq.num_prompt_tokens, budget))
        self.num_trees_withheld += withheld
        if not granted:
            return 0
        asked = time.perf_counter()
        trees = self.proposer.propose(requests)
        self.draft_wait_seconds += time.perf_counter() - asked
        vocab = self.model_config.vocab_size
        # One range check over every node of the step; per tree only when something is out.
        nonempty = [tree.tokens for tree in trees if len(tree)]
        every = np.concatenate(nonempty) if nonempty else None
        all_in_vocab = every is None or (every.min() >= 0 and every.max() < vocab)
        for item, request, tree in zip(decoding, requests, trees):
            if len(tree) == 0 or len(tree) > request.max_nodes:
                continue
            if not all_in_vocab and (tree.tokens.min() < 0 or tree.tokens.max() >= vocab):
                logger.warning("dropping a proposed tree with token ids outside the vocabulary [0, %d)", vocab)
                continue
            if self.scheduler.try_extend(item.seq, item.seq.num_computed + 1 + len(tree)):
                item.tree = tree
            else:
                self.scheduler.trim_blocks(item.seq, item.seq.num_computed + 1)
        return per_seq

    def _draining_batch(self, decoding: list[ScheduledSeq]) -> Optional[DrainingBatch]:
        """The decoding sequences' progress when the caller waits for all of them and no
        request waits to take a finished one's place (the batch's run ends with its slowest
        sequence); None otherwise."""
        if not self.waits_for_all or self.scheduler.waiting:
            return None
        seqs = [item.seq for item in decoding]
        return DrainingBatch(
            remaining=[self._length_room(seq) for seq in seqs],
            trees=[seq.spec.num_steps for seq in seqs],
            accepted=[seq.spec.num_accepted_tokens for seq in seqs],
            squared=[seq.spec.sum_squared_accepted for seq in seqs],
        )

    def _reserve_run_ahead(self, decoding: list[ScheduledSeq]) -> int:
        """How many decode steps to run before the host looks at the tokens (1: a plain step).

        Running ahead keeps the device busy while the host would otherwise be scheduling and
        detokenising (vLLM's multi-step scheduling). It needs every row's next token to be a
        function of its logits alone, so rows with penalties, n-gram bans, pending
        min_tokens, logprobs or best_of ranking decode one step at a time, as does a batch
        with room for a waiting request (so it is admitted at the next step, not a window
        later). Steps past a sequence's stop are discarded,
        like rejected draft tokens. Reserves the KV blocks the extra steps write.
        """
        scheduler = self.scheduler
        if self.num_scheduler_steps <= 1 or (scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs):
            return 1
        if not all(_can_run_ahead(item.seq) for item in decoding):
            return 1
        num_steps = min(
            self.num_scheduler_steps,
            min(self.max_model_len - item.seq.num_computed for item in decoding),
            max(item.seq.group.max_tokens - item.seq.num_output_tokens for item in decoding),
        )
        if num_steps <= 1:
            return 1
        for item in decoding:
            if not self.scheduler.try_extend(item.seq, item.seq.num_computed + num_steps):
                for undo in decoding:
                    self.scheduler.trim_blocks(undo.seq, undo.seq.num_computed + 1)
                return 1
        return num_steps

    def _decode_ahead(self, decoding: list[ScheduledSeq], num_steps: int) -> list[SequenceGroup]:
        """Run `num_steps` decode steps on the device, then append each sequence's tokens up to its stop."""
        chunks, _ = self._build_chunks(decoding)
        if all(item.seq.group.plain_greedy for item in decoding):
            tokens = self.runner.decode_steps(chunks, num_steps, lambda logits: logits.argmax(dim=-1))
        else:
            rows = [self._row_context(_SampleRow(item.seq, [])) for item in decoding]
            tokens = self.runner.decode_steps(chunks, num_steps, lambda logits: sample(target_probs(logits, rows), rows))
        touched: dict[str, SequenceGroup] = {}
        now = time.time()
        for item, seq_tokens in zip(decoding, tokens):
            seq = item.seq
            seq.num_computed += num_steps
            self._append_tokens(seq, seq_tokens, None, [], now)
            touched[seq.group.request_id] = seq.group
        return list(touched.values())

    def _build_chunks(self, scheduled: list[ScheduledSeq]) -> tuple[list[SequenceChunk], list[_ChunkRows]]:
        chunks, layout = [], []
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed
            if item.tree is None:
                tokens = seq.token_ids[start : start + item.num_new_tokens]
                positions = list(range(start, start + item.num_new_tokens))
                logits_indices = self._prompt_logprob_indices(item)
                num_prompt_rows = len(logits_indices)
                if item.samples:
                    logits_indices.append(item.num_new_tokens - 1)
                chunks.append(SequenceChunk(tokens, positions, seq.block_table, start, logits_indices))
                layout.append(_ChunkRows(seq, num_prompt_rows, int(item.samples)))
            else:
                # Row 0 is the root (the last known token), row i + 1 is node i.
                depths, masks = _tree_layout(tuple(item.tree.parent_list))
                tokens = [seq.token_ids[-1]] + item.tree.token_list
                positions = [start + depth for depth in depths]
                chunks.append(SequenceChunk(tokens, positions, seq.block_table, start, list(range(len(tokens))), masks))
                layout.append(_ChunkRows(seq, 0, len(tokens), item.tree))
        return chunks, layout

    def _prompt_logprob_indices(self, item: ScheduledSeq) -> list[int]:
        """Chunk rows whose logits score prompt tokens not scored yet, when prompt_logprobs is asked.

        Row i of the chunk scores the prompt token at position num_computed + i + 1. Counting
        from what is already recorded keeps a recomputed prefill (after a preemption) from
        scoring positions twice.
        """
        seq = item.seq
        group = seq.group
        if seq.params.prompt_logprobs is None or seq.index != 0:
            return []
        scored = len(group.prompt_logprobs) - 1 if group.prompt_logprobs else 0
        first = max(0, scored - seq.num_computed)
        last = min(seq.num_computed + item.num_new_tokens, seq.num_prompt_tokens - 1) - seq.num_computed
        return list(range(first, max(first, last)))

    def _consume_logits(self, scheduled: list[ScheduledSeq], layout: list[_ChunkRows], logits: torch.Tensor) -> list[SequenceGroup]:
        prompt_slices, sample_starts, sample_index = [], [], []
        offset = 0
        for rows in layout:
            prompt_slices.append((offset, offset + rows.num_prompt_rows))
            offset += rows.num_prompt_rows
            sample_starts.append(len(sample_index))
            sample_index.extend(range(offset, offset + rows.num_sample_rows))
            offset += rows.num_sample_rows
        # Decode and verification steps sample every row: no gather (a copy of all the logits).
        sample_logits = logits if len(sample_index) == logits.shape[0] else logits[sample_index]
        plain = [b for b, item in enumerate(scheduled) if item.samples and item.tree is None]
        # Plain greedy needs only the argmax of each row: one reduction and one host copy.
        all_greedy = all(item.seq.group.plain_greedy for item, rows in zip(scheduled, layout) if rows.num_sample_rows)
        argmax = sample_logits.argmax(dim=-1).tolist() if all_greedy else None
        contexts = [c for rows in layout for c in self._row_contexts(rows, logits.device)] if argmax is None else []
        probs = target_probs(sample_logits, contexts) if contexts else None
        if argmax is not None:
            plain_tokens = {b: argmax[sample_starts[b]] for b in plain}
        elif plain:
            picks = [sample_starts[b] for b in plain]
            plain_tokens = dict(zip(plain, sample(probs[picks], [contexts[i] for i in picks]).tolist()))
        else:
            plain_tokens = {}
        kv_moves: list[tuple[list[int], int, int]] = []  # compacting accepted paths, one copy for the batch
        tree_sizes, accepted_counts, verdicts = [], [], []
        appends: list[tuple[Sequence, list[int], list[int]]] = []  # (sequence, its new tokens, their logits rows)
        for b, (item, rows) in enumerate(zip(scheduled, layout)):
            seq = item.seq
            if rows.num_prompt_rows:
                start, stop = prompt_slices[b]
                self._record_prompt_logprobs(seq, logits[start:stop])
            if not item.samples:
                seq.num_computed += item.num_new_tokens
                self._register_blocks(seq)
                continue
            first = sample_starts[b]
            if item.tree is None:
                seq.num_computed += item.num_new_tokens
                appends.append((seq, [plain_tokens[b]], [first]))
                continue
            end = first + rows.num_sample_rows
            if argmax is not None:
                accepted, bonus = greedy_accept(argmax[first:end], item.tree)
            else:
                accepted, bonus = verify_tree(probs[first:end], item.tree, seq.params.is_greedy, seq.generator)
            tree_tokens = item.tree.token_list
            accepted_tokens = [tree_tokens[i] for i in accepted]
            self._keep_accepted_kv(item, accepted, kv_moves)
            seq.spec.record(len(tree_tokens), len(accepted))
            tree_sizes.append(len(tree_tokens))
            accepted_counts.append(len(accepted))
            seq.draft_backoff.record(len(accepted))
            verdicts.append(Verdict(seq.seq_key, accepted_tokens, bonus, len(tree_tokens)))
            appends.append((seq, accepted_tokens + [bonus], [first] + [first + i + 1 for i in accepted]))
        if verdicts:
            # One call for the step, before the tokens are appended: a stop among them
            # releases its sequence, and the proposer should still learn this last step.
            self.proposer.commit(verdicts)
        now = time.time()
        touched: dict[str, SequenceGroup] = {}
        for seq, new_tokens, token_rows in appends:
            self._append_tokens(seq, new_tokens, sample_logits, token_rows, now)
            touched[seq.group.request_id] = seq.group
        self.runner.copy_kv_slots(kv_moves)
        self.spec_stats.record_batch(tree_sizes, accepted_counts)
        self.spec_control.record_acceptance(tree_sizes, accepted_counts)
        return list(touched.values())

    def _row_contexts(self, rows: _ChunkRows, device: torch.device) -> list[RowContext]:
        """The contexts of one sequence's sampling rows, with its grammar's mask at each."""
        contexts = [self._row_context(r) for r in rows.sample_rows()]
        grammar = rows.seq.grammar
        if grammar is not None and contexts:
            for context, allowed in zip(contexts, grammar.row_masks(rows.tree, device)):
                context.allowed_tokens = allowed
        return contexts

    def _row_context(self, row: _SampleRow) -> RowContext:
        seq = row.seq
        return RowContext(seq.params, seq.group.prompt_token_ids, row.context(), self.eos_token_ids, seq.generator)

    def _keep_accepted_kv(self, item: ScheduledSeq, accepted: list[int], moves: list) -> None:
        """Queue the moves of the accepted nodes' KV right behind the root and drop the rest of the tree.

        The caller copies every sequence's moves at once; each move keeps its own copy of the
        block table, whose tail is freed here.
        """
        seq = item.seq
        root = seq.num_computed
        # A path's node indices increase (parents precede children), so it is already in
        # place, nodes 0..m-1, exactly when its last node is m - 1.
        if accepted and accepted[-1] != len(accepted) - 1:
            table = list(seq.block_table)
            moves.extend((table, root + 1 + node, root + 1 + m) for m, node in enumerate(accepted) if node != m)
        seq.num_computed = root + 1 + len(accepted)
        self.scheduler.trim_blocks(seq, seq.num_computed)

    def _register_blocks(self, seq: Sequence) -> None:
        """Put the sequence's newly filled blocks in the prefix cache (hashing only those).

        A block is full when its KV is computed and its tokens are known: KV computed past
        the last appended token (steps after a stop) is never registered.
        """
        allocator = self.scheduler.allocator
        full = min(seq.num_computed, len(seq.token_ids)) // allocator.block_size
        if not allocator.enable_prefix_caching or full <= seq.num_registered_blocks:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, allocator.block_size, full * allocator.block_size)
        first = seq.num_registered_blocks
        allocator.register_blocks(seq.block_hashes[first:full], seq.block_table[first:full])
        seq.num_registered_blocks = full

    def _append_tokens(
        self, seq: Sequence, new_tokens: list[int], logits: Optional[torch.Tensor], token_rows: list[int], now: float
    ) -> None:
        """Append tokens up to the first stop, then register the filled blocks (and finish on a stop).

        `logits` rows `token_rows` score the tokens; they are read only for logprobs. `now`
        is the step's time, for the request's token timestamps.
        """
        params = seq.params
        want = params.logprobs
        ranks_samples = (params.best_of or params.n) > params.n  # best_of picks by cumulative logprob
        if want is not None or ranks_samples:
            chosen = torch.tensor(new_tokens, device=logits.device)
            token_logprobs = raw_logprobs(logits[token_rows], chosen, [want or 0] * len(new_tokens))
        metrics = seq.group.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        for i, token in enumerate(new_tokens):
            seq.token_ids.append(token)
            if seq.grammar is not None:
                seq.grammar.accept(token)
            self.num_generation_tokens_total += 1
            if want is not None or ranks_samples:
                seq.cumulative_logprob += token_logprobs[i][token][0]
            if want is not None:
                seq.logprobs.append(self._logprob_entry(token_logprobs[i]))
            if self._check_stop(seq, token):
                self._register_blocks(seq)
                self._finish(seq)
                return
        self._register_blocks(seq)

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        num_output = seq.num_output_tokens
        if params.detokenize:
            new_text = decode_new_text(
                self.tokenizer, seq.token_ids, seq.detok, params.skip_special_tokens, params.spaces_between_special_tokens
            )
        else:
            new_text = ""
        if num_output >= params.min_tokens:
            if token in (params.stop_token_ids or ()):
                seq.finish_reason, seq.stop_reason = "stop", token
                return True
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return True
            if new_text and params.stop:
                hit = find_stop_string(seq.detok.text, len(new_text), params.stop, params.include_stop_str_in_output)
                if hit is not None:
                    seq.detok.text = seq.detok.text[: hit[1]]
                    seq.finish_reason, seq.stop_reason = "stop", hit[0]
                    return True
        if num_output >= seq.group.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        seq.group.metrics.finished_time = time.time() if seq.group.is_finished else None
        if self.proposer is not None:
            self.proposer.release(seq.seq_key)

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        group = seq.group
        if group.prompt_logprobs is None:
            group.prompt_logprobs = [None]
        start = len(group.prompt_logprobs)  # the first prompt position not scored yet
        targets = torch.tensor(seq.token_ids[start : start + logits.shape[0]], device=logits.device)
        top = seq.params.prompt_logprobs
        for entry in raw_logprobs(logits, targets, [top] * logits.shape[0]):
            group.prompt_logprobs.append(self._logprob_entry(entry))

    def _logprob_entry(self, entry: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        decode = (lambda t: None) if self.tokenizer is None else (lambda t: self.tokenizer.decode([t]))
        return {t: Logprob(lp, rank, decode(t)) for t, (lp, rank) in entry.items()}

    # ----------------------------------------------------------------- output
    def _request_output(self, group: SequenceGroup) -> RequestOutput:
        params = group.params
        finished = group.is_finished
        seqs = group.seqs
        if (params.best_of or params.n) > params.n:
            if not finished:
                seqs = []
            else:
                seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        outputs = [
            CompletionOutput(
                index=i if (params.best_of or params.n) > params.n else seq.index,
                text=seq.detok.text,
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
                logprobs=list(seq.logprobs) if params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(seqs)
        ]
        metrics = group.metrics
        metrics.num_draft_tokens = sum(s.spec.num_draft_tokens for s in group.seqs)
        metrics.num_accepted_tokens = sum(s.spec.num_accepted_tokens for s in group.seqs)
        metrics.num_spec_steps = sum(s.spec.num_steps for s in group.seqs)
        if finished:
            self.groups.pop(group.request_id, None)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=group.prompt_logprobs,
            outputs=outputs,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=group.num_cached_tokens,
        )
