"""Continuous batching over a paged KV cache.

Every step the scheduler first keeps the running sequences going (one decode token each,
or the rest of a chunked prefill), then admits waiting sequences while the token budget
(`max_num_batched_tokens`), the sequence budget (`max_num_seqs`) and free KV blocks allow.
Admission is fair between requests: the next sequence admitted is the first waiting one of
the request with the fewest running sequences, so a request with a large `n` takes turns
with later requests instead of holding every slot until all its sequences have run (FCFS
among requests alike; vLLM schedules sequence groups first-come-first-served).
When a running sequence needs a block and none is free, the most recently admitted
sequence is preempted by recomputation: its blocks are freed and it goes back to the
front of the queue to be prefilled again later, prompt and output together, so nothing
it generated is lost.
A sequence admitted with prefix blocks still being copied back from the CPU offload tier
waits in its own state (vLLM V1's WAITING_FOR_REMOTE_KVS) while the rest of the batch
runs, holding its blocks and a slot of `max_num_seqs`, and is scheduled at the first step
after its copies have completed: no step waits for another request's restore.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from gpu_target.kv_cache import BlockAllocator, BlockTableRows, OutOfBlocks, extend_block_hashes
from gpu_target.sampler import is_plain_greedy
from hetero.detokenizer import DetokenizerState, init_state
from hetero.outputs import Logprob, RequestMetrics
from hetero.core.protocols import SpecStats, TokenTree
from hetero.core.sampling_params import SamplingParams
from hetero.spec.backoff import DraftBackoff


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # admitted; its prefix blocks are being restored from the CPU
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One completion being generated; a request with n > 1 has n of them."""

    def __init__(self, group: "SequenceGroup", index: int, generator: torch.Generator):
        self.group = group
        self.index = index
        self.params: SamplingParams = group.params
        self.seq_key = f"{group.request_id}#{index}"  # what proposers know the sequence by
        self.generator = generator
        self.token_ids: list[int] = list(group.prompt_token_ids)
        self.num_prompt_tokens = len(group.prompt_token_ids)
        self.block_table: list[int] = []
        self.table_row: Optional[int] = None  # its row of the scheduler's `BlockTableRows` while it holds blocks
        self.num_computed = 0  # tokens whose KV is in the cache
        self.block_hashes: list[bytes] = []  # content hashes of full blocks, for the prefix cache
        self.num_registered_blocks = 0  # leading blocks of block_table already in the prefix cache
        self.status = SeqStatus.WAITING
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, Logprob]] = []
        self.detok: DetokenizerState = init_state(group.prompt_token_ids)
        self.finish_reason: Optional[str] = None
        self.stop_reason: int | str | None = None
        self.spec = SpecStats()
        self.draft_backoff = DraftBackoff()  # withholds trees while this sequence's drafts keep missing
        self.grammar = None  # its structured-output state (hetero.structured_output.SequenceGrammar), if any

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


class SequenceGroup:
    """One request: its prompt, parameters, sequences and timing."""

    def __init__(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival_time: float,
    ):
        self.request_id = request_id
        self.max_tokens = max_tokens
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.plain_greedy = is_plain_greedy(params)  # read for every sequence of every step
        self.stop_token_set = frozenset(params.stop_token_ids or ())  # checked against every step's new tokens
        # Tokens that need no work of their own when appended: no logprobs, no best_of ranking, no stop strings.
        self.appends_unwatched = (params.logprobs is None and (params.best_of or params.n) == params.n
                                  and not (params.detokenize and params.stop))
        self.seqs: list[Sequence] = []
        self.num_running = 0  # of its sequences, kept by the scheduler for fair admission
        self.metrics = RequestMetrics(arrival_time=arrival_time, last_token_time=arrival_time)
        # Asked for: [None] (the first token has nothing before it to be scored from, as in vLLM), then a dict a token.
        self.prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None if params.prompt_logprobs is None else [None]
        self.num_cached_tokens = 0

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # prefill chunk length, or 1 for a decode token (tree nodes come on top)
    tree: Optional[TokenTree] = None

    @property
    def samples(self) -> bool:
        """Whether this step ends at the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed + self.num_new_tokens == len(self.seq.token_ids)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int):
        self.allocator = allocator
        self.block_size = allocator.block_size  # read for every sequence of every step
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.restoring: list[Sequence] = []  # admitted, WAITING_FOR_KV, in admission order
        self.table_rows = BlockTableRows(max_num_seqs)  # every block table, mirrored for the runner's staging
        self.num_preemptions = 0
        self.num_restore_waits = 0  # times the host waited for a restore, with nothing else to run

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        scheduled: list[ScheduledSeq] = []
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or budget == 0:
                continue
            num_new = min(seq.num_uncomputed, budget)
            if not self._reserve(seq, seq.num_computed + num_new, preempt=True):
                continue
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        # A step that had to preempt admits nobody: the freed blocks went to the running
        # sequences, and re-admitting the victim at once would only thrash the cache.
        for seq in [seq for seq in self.restoring if self.allocator.blocks_ready(seq.block_table)]:
            if budget == 0 or self.num_preemptions != preemptions_before:
                break
            self.restoring.remove(seq)
            num_new = min(seq.num_uncomputed, budget)
            if not self._reserve(seq, seq.num_computed + num_new, preempt=False):
                seq.group.num_running -= 1
                self._unadmit(seq)
                self.waiting.appendleft(seq)
                break
            self._start(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        while (self.waiting and budget > 0 and len(self.running) + len(self.restoring) < self.max_num_seqs
               and self.num_preemptions == preemptions_before):
            seq = self._next_to_admit()
            # Cached blocks have no logits to score a prompt with, so prompt_logprobs skips them.
            if self.allocator.enable_prefix_caching and seq.params.prompt_logprobs is None:
                extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, len(seq.token_ids))
                self._take_table(seq, self.allocator.match_prefix(seq.block_hashes, len(seq.token_ids)))
                seq.num_registered_blocks = len(seq.block_table)  # cached blocks are registered already
                seq.num_computed = seq.num_registered_blocks * self.block_size
                seq.group.num_cached_tokens = seq.num_computed
                if not self.allocator.blocks_ready(seq.block_table):
                    self.waiting.remove(seq)
                    seq.group.num_running += 1
                    seq.status = SeqStatus.WAITING_FOR_KV
                    self.restoring.append(seq)
                    continue
            num_new = min(seq.num_uncomputed, budget)
            if not self._reserve(seq, seq.num_computed + num_new, preempt=False):
                self._unadmit(seq)
                break
            self.waiting.remove(seq)
            seq.group.num_running += 1
            self._start(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return scheduled

    def _start(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def _unadmit(self, seq: Sequence) -> None:
        """Give back an unscheduled sequence's blocks (they stay cached); it starts afresh."""
        self._free_table(seq)
        seq.num_computed = seq.num_registered_blocks = 0
        seq.status = SeqStatus.WAITING

    def _take_table(self, seq: Sequence, table: list[int]) -> None:
        """Give a sequence without blocks the table `table` (blocks it holds already)."""
        seq.block_table = table
        seq.table_row = self.table_rows.assign(table)

    def _free_table(self, seq: Sequence) -> None:
        """Free all of a sequence's blocks (cached ones stay findable) and its table's row."""
        self.allocator.free_all(seq.block_table)
        if seq.table_row is not None:
            self.table_rows.release(seq.table_row, len(seq.block_table))
            seq.table_row = None
        seq.block_table = []

    def wait_for_restore(self) -> None:
        """Block the host until the first sequence waiting for restored blocks has them (for
        when nothing else can run)."""
        if self.restoring:
            self.num_restore_waits += 1
            self.allocator.wait_for_blocks(self.restoring[0].block_table)

    def _next_to_admit(self) -> Sequence:
        """The first waiting sequence of the request with the fewest running sequences (queue order breaks ties)."""
        best = self.waiting[0]
        for seq in self.waiting:
            if best.group.num_running == 0:
                break
            if seq.group.num_running < best.group.num_running:
                best = seq
        return best

    def try_extend(self, seq: Sequence, num_tokens: int) -> bool:
        """Reserve blocks for `num_tokens` KV entries without preempting anyone (tree nodes)."""
        return self._reserve(seq, num_tokens, preempt=False)

    def _reserve(self, seq: Sequence, num_tokens: int, preempt: bool) -> bool:
        table = seq.block_table
        needed = -(-num_tokens // self.block_size) - len(table)
        while needed > 0:
            try:
                block = self.allocator.allocate()
                if seq.table_row is None:
                    seq.table_row = self.table_rows.assign(())
                self.table_rows.append(seq.table_row, len(table), block)
                table.append(block)
                needed -= 1
            except OutOfBlocks:
                victim = self._preemption_victim(seq) if preempt else None
                if victim is None:
                    if seq.status is SeqStatus.RUNNING and preempt:
                        self._preempt(seq)
                    return False
                self._preempt(victim)
        return True

    def _preemption_victim(self, requester: Sequence) -> Optional[Sequence]:
        """The latest-admitted sequence behind the requester: it has not been scheduled this step."""
        behind = self.running[self.running.index(requester) + 1 :]
        return behind[-1] if behind else None

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's KV and requeue it at the front; its tokens are recomputed later.

        Its filled blocks are registered first (the engine may not have done so yet for the
        last step's tokens), so that the prefix cache can give them back at its re-admission.
        """
        self.register_blocks(seq)
        self._free_table(seq)
        seq.num_computed = seq.num_registered_blocks = 0
        seq.status = SeqStatus.WAITING
        seq.group.num_running -= 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def trim_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` storage slots (a compacted or dropped tree)."""
        keep = -(-num_tokens // self.block_size)
        table = seq.block_table
        while len(table) > keep:
            self.allocator.free(table.pop())
            self.table_rows.drop(seq.table_row, len(table))

    def reserve_run_ahead(self, decoding: list[ScheduledSeq], max_steps: int, max_model_len: int) -> int:
        """How many decode steps to run before the host looks at the tokens (1: a plain step).

        Running ahead keeps the device busy while the host would otherwise be scheduling and
        detokenising (vLLM's multi-step scheduling). It needs every row's next token to be a
        function of its logits alone, so rows with penalties, n-gram bans, pending
        min_tokens, logprobs or best_of ranking decode one step at a time, as does a batch
        with room for a waiting request or a request waiting for its restored blocks (so it
        is admitted at the next step, not a window later). Steps past a sequence's stop are discarded, like rejected draft tokens.
        Reserves the KV blocks the extra steps write.
        """
        if max_steps <= 1 or self.restoring or (self.waiting and len(self.running) < self.max_num_seqs):
            return 1
        if not all(_can_run_ahead(item.seq) for item in decoding):
            return 1
        num_steps = min(
            max_steps,
            min(max_model_len - item.seq.num_computed for item in decoding),
            max(item.seq.group.max_tokens - item.seq.num_output_tokens for item in decoding),
        )
        if num_steps <= 1:
            return 1
        for item in decoding:
            if not self.try_extend(item.seq, item.seq.num_computed + num_steps):
                for undo in decoding:
                    self.trim_blocks(undo.seq, undo.seq.num_computed + 1)
                return 1
        return num_steps

    def register_blocks(self, seq: Sequence) -> None:
        """Put the sequence's newly filled blocks in the prefix cache (hashing only those).

        A block is full when its KV is computed and its tokens are known: KV computed past
        the last appended token (steps after a stop) is never registered.
        """
        allocator = self.allocator
        full = min(seq.num_computed, len(seq.token_ids)) // allocator.block_size
        if not allocator.enable_prefix_caching or full <= seq.num_registered_blocks:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, allocator.block_size, full * allocator.block_size)
        first = seq.num_registered_blocks
        allocator.register_blocks(seq.block_hashes[first:full], seq.block_table[first:full])
        seq.num_registered_blocks = full

    def finish(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            seq.group.num_running -= 1
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING_FOR_KV:  # aborted while its blocks were being restored
            seq.group.num_running -= 1
            self.restoring.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._free_table(seq)
        seq.status = SeqStatus.FINISHED


def _can_run_ahead(seq: Sequence) -> bool:
    """Whether a sequence's next few tokens depend on their logits alone (see `Scheduler.reserve_run_ahead`)."""
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
