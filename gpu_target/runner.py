"""The target model runner: one batched forward over the model and its paged KV cache per step.

A rank's model, KV cache, attention and CUDA graphs are built by `gpu_target.target`
(`num_kv_blocks` here sizes the cache). Each step the engine hands over, per sequence, the new tokens of this step (a prefill
chunk, one decode token, or a root plus token-tree nodes) with their rotary positions and
block table; the runner flattens them, builds the attention metadata, runs the model and
returns the logits of the rows that were asked for.
"""
from __future__ import annotations

import functools
import gc
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from gpu_target.attention import AttentionMetadata, reference_attention
from gpu_target.kv_cache import KVCachePool
from gpu_target.model_config import ModelConfig
from gpu_target.model import AttentionFn, CausalLM
from hetero.core.config import EngineConfig

logger = logging.getLogger("hetero")

CPU_DEFAULT_KV_GIB = 4.0  # the KV cache's size on the CPU when kv_cache_space is not given
GPU_ACTIVATION_RESERVE_GIB = 4.0  # GPU memory kept back from the KV cache for activations and CUDA-graph pools


@functools.lru_cache(maxsize=None)
def every_index(n: int) -> list[int]:
    """[0, 1, ..., n - 1]: the logits indices of a chunk that asks for every row (shared: not to be modified)."""
    return list(range(n))


@dataclass
class SequenceChunk:
    token_ids: Sequence[int]  # the step's new tokens
    positions: Sequence[int]  # their rotary positions
    block_table: Sequence[int]
    num_cached: int  # storage index of the first new token
    logits_indices: Sequence[int]  # new-token indices whose logits are wanted
    tree_mask: Optional[Sequence[int]] = None  # per new token ancestor bits; None = causal
    table_row: Optional[int] = None  # where `block_table` is mirrored in the scheduler's `BlockTableRows`, if it is
    # Positions num_cached, num_cached + 1, ... and causal attention (no tree mask, or a chain's,
    # which is the causal one): staging may compute both from the token's index in the chunk.
    sequential: bool = False


@dataclass
class DecodeInputs:
    """The device inputs of B single-token decode rows that change from one step to the next."""

    input_ids: torch.Tensor  # int64 [B]
    positions: torch.Tensor  # int64 [B]; a decode token's position is its storage index
    seq_lens: torch.Tensor  # int32 [B]
    slot_mapping: torch.Tensor  # int64 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks], with blocks reserved for the steps ahead

    def advance(self, next_tokens: torch.Tensor, block_size: int) -> None:
        """Feed `next_tokens` one position further on, in place on the device (no host sync)."""
        self.input_ids.copy_(next_tokens)
        self.positions += 1
        self.seq_lens += 1
        blocks = self.block_tables.gather(1, (self.positions // block_size).unsqueeze(1)).squeeze(1)
        self.slot_mapping.copy_(blocks.to(torch.int64) * block_size + self.positions % block_size)


PickTokens = Callable[[torch.Tensor], torch.Tensor]  # logits [B, vocab] -> next tokens int64 [B], on the device


def run_rpc(runner, method, args: tuple = (), kwargs: Optional[dict] = None):
    """One rank's part of `LLMEngine.collective_rpc`: ``method(runner, *args, **kwargs)`` for a
    callable, ``runner.method(*args, **kwargs)`` for a name (vLLM's two forms, the rank's runner
    standing in for vLLM's worker)."""
    function = getattr(runner, method) if isinstance(method, str) else functools.partial(method, runner)
    return function(*args, **(kwargs or {}))


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVCachePool,
        device: torch.device,
        attention_fn: AttentionFn = reference_attention,
        graph_runner=None,
    ):
        self.model = model
        self.kv_pool = kv_pool
        self.device = torch.device(device)
        self.attention_fn = attention_fn
        self.block_size = kv_pool.block_size
        self.graph_runner = graph_runner  # CudaGraphRunner, or None (CPU, enforce_eager)

    @property
    def query_buckets(self) -> Optional[list[int]]:
        """The query lengths the CUDA graphs cover (None: no graphs)."""
        return self.graph_runner.query_buckets if self.graph_runner is not None else None

    def collective_rpc(self, method, timeout: Optional[float] = None, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """`run_rpc` on this, the only rank (`timeout`: the tensor-parallel runner's, unused here)."""
        return [run_rpc(self, method, args, kwargs)]

    def build_inputs(self, chunks: Sequence[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the chunks into (input_ids, positions, metadata, logits row indices)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tree_bits: list[int] = []
        logits_rows: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        max_blocks = max(len(c.block_table) for c in chunks)
        tables = torch.full((len(chunks), max_blocks), 0, dtype=torch.int32)
        any_tree = False
        for b, chunk in enumerate(chunks):
            n = len(chunk.token_ids)
            offset = query_start[-1]
            input_ids.extend(chunk.token_ids)
            positions.extend(chunk.positions)
            for i in range(chunk.num_cached, chunk.num_cached + n):
                slots.append(chunk.block_table[i // bs] * bs + i % bs)
            if chunk.tree_mask is not None:
                any_tree = True
                tree_bits.extend(chunk.tree_mask)
            else:
                tree_bits.extend([0] * n)
            logits_rows.extend(offset + i for i in chunk.logits_indices)
            query_start.append(offset + n)
            seq_lens.append(chunk.num_cached + n)
            tables[b, : len(chunk.block_table)] = torch.tensor(chunk.block_table, dtype=torch.int32)
        dev = self.device
        query_lens = [len(c.token_ids) for c in chunks]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            tree_mask=torch.tensor(tree_bits, dtype=torch.int64, device=dev) if any_tree else None,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            torch.tensor(logits_rows, dtype=torch.int64, device=dev),
        )

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """Logits (float32) of the requested rows, in chunk order: [num_rows, vocab]."""
        if self.graph_runner is not None:
            bucket = self.graph_runner.bucket_for(chunks)
            if bucket is not None:
                return self.graph_runner.run(chunks, bucket)
        input_ids, positions, meta, rows = self.build_inputs(chunks)
        hidden = self.model(input_ids, positions, self.kv_pool.layers, meta, self.attention_fn)
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def decode_steps(self, chunks: Sequence[SequenceChunk], num_steps: int, pick: PickTokens) -> torch.Tensor:
        """Queue `num_steps` decode steps per sequence, without a host sync.

        Each step feeds the tokens `pick` chose from the previous step's logits, so the
        device runs the steps back to back while the host only queues them. The chunks
        must be single-token decodes whose block tables already cover `num_steps` KV
        entries from `num_cached` on. Returns the picked tokens on the device, [B, num_steps];
        reading them is the host's one wait.
        """
        bucket = self.graph_runner.bucket_for(chunks) if self.graph_runner is not None else None
        if isinstance(bucket, tuple) and bucket[1] == 1:
            inputs, forward = self.graph_runner.decode_inputs(chunks, bucket)
        else:
            inputs, forward = self._eager_decode_inputs(chunks)
        picks: list[torch.Tensor] = []
        for step in range(num_steps):
            if step:
                inputs.advance(picks[-1], self.block_size)
            picks.append(pick(self.model.compute_logits(forward(step))))
        return torch.stack(picks, dim=1)

    def _eager_decode_inputs(self, chunks: Sequence[SequenceChunk]) -> tuple[DecodeInputs, Callable[[int], torch.Tensor]]:
        input_ids, positions, meta, _ = self.build_inputs(chunks)
        inputs = DecodeInputs(input_ids, positions, meta.seq_lens, meta.slot_mapping, meta.block_tables)
        first_lens, first_max = list(meta.seq_lens_host), meta.max_seq_len

        def forward(step: int) -> torch.Tensor:
            meta.seq_lens_host = [n + step for n in first_lens]  # the host copies the reference path reads
            meta.max_seq_len = first_max + step
            return self.model(inputs.input_ids, inputs.positions, self.kv_pool.layers, meta, self.attention_fn)

        return inputs, forward

    def copy_kv_slots(self, moves: Sequence[tuple[Sequence[int], int, int]]) -> None:
        """Compact accepted tree paths: for each (block_table, src_index, dst_index) in storage order."""
        if not moves:
            return
        bs = self.block_size
        src = [table[s // bs] * bs + s % bs for table, s, _ in moves]
        dst = [table[d // bs] * bs + d % bs for table, _, d in moves]
        self.kv_pool.copy_slots(
            torch.tensor(src, dtype=torch.int64, device=self.device),
            torch.tensor(dst, dtype=torch.int64, device=self.device),
        )


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, max_model_len: int, dtype: torch.dtype,
                  device: torch.device) -> int:
    """KV blocks that fit gpu_memory_utilization (CUDA) or kv_cache_space (CPU); or that fit
    kv_cache_memory_bytes, on any device and uncapped (vLLM: "if specified, it ignores
    gpu_memory_utilization", https://docs.vllm.ai/en/latest/configuration/engine_args.html; here
    kv_cache_space too, so that one argument sizes the cache wherever the target runs); or exactly
    num_gpu_blocks_override (vLLM's knob, for runs that must compare equal cache sizes; it wins over
    the others, as in vLLM). At least one sequence's worth."""
    per_block = KVCachePool.bytes_per_block(model_config, config.block_size, dtype)
    blocks_per_seq = -(-max_model_len // config.block_size)
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
        knob = "num_gpu_blocks_override"
    elif config.kv_cache_memory_bytes is not None:
        num_blocks = config.kv_cache_memory_bytes // per_block
        knob = f"kv_cache_memory_bytes ({per_block} bytes a block)"
    elif device.type == "cuda":
        gc.collect()  # an engine dropped but still in a reference cycle holds its KV cache until collected (vLLM collects here too)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        ours = torch.cuda.memory_allocated(device)
        others = total - free - torch.cuda.memory_reserved(device)
        budget = total * config.gpu_memory_utilization - others - ours - GPU_ACTIVATION_RESERVE_GIB * 2**30
        num_blocks = int(budget // per_block)
        knob = (
            f"gpu_memory_utilization (GPU {total / 2**30:.1f} GiB, this process's tensors {ours / 2**30:.1f} GiB, "
            f"other processes {others / 2**30:.1f} GiB)"
        )
    else:
        space = config.kv_cache_space or CPU_DEFAULT_KV_GIB
        num_blocks = min(int(space * 2**30 // per_block), config.max_num_seqs * blocks_per_seq + 1)
        knob = "kv_cache_space"
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"the KV cache holds {max(num_blocks, 0) * config.block_size} tokens, fewer than max_model_len "
            f"({max_model_len}); raise {knob} or lower max_model_len"
        )
    return num_blocks
