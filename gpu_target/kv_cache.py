"""Paged KV cache: the block pool on the device and the host-side block allocator.

Blocks are reference counted so that prefix caching can share full blocks between
sequences: a full block is registered under the hash of every token up to its end, and a
new sequence whose prompt starts with the same tokens takes the cached blocks instead of
recomputing them. Blocks whose count drops to zero stay cached (and findable) until they
are reused, oldest first; free blocks that cache nothing are reused before any of them.
"""
from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from gpu_target.model_config import ModelConfig

if TYPE_CHECKING:
    from gpu_target.kv_offload import HitCountLog, PrefixCacheOffload


class KVCachePool:
    """Per-layer K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer[0], layer[1]) for layer in self.storage]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.kv_size * itemsize

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move the K/V of flat slots `src` to slots `dst` in every layer (tree compaction)."""
        flat = self.storage.view(self.storage.shape[0], 2, -1, *self.storage.shape[4:])
        flat[:, :, dst] = flat[:, :, src]


NULL_BLOCK = 0  # never handed out on the GPU: padding tokens write into it, and it ends every block-table row


class BlockTableRows:
    """Every running sequence's block table, kept across steps as a row of one array.

    vLLM V1 keeps its batch's block tables in per-slot arrays updated in place as blocks
    are allocated and freed (``vllm/v1/worker/block_table.py``), so that a step's inputs
    take every sequence's table in one gather instead of one write per sequence. Here the
    scheduler, which owns the tables, mirrors each change into the sequence's row: a row
    holds the table, then `NULL_BLOCK` to its end, exactly what staging lays out. Rows
    are handed out per sequence while it holds blocks; the array widens when a table
    outgrows it.
    """

    def __init__(self, num_rows: int, width: int = 64):
        self.array = np.full((num_rows, width), NULL_BLOCK, dtype=np.int32)
        self._free = list(range(num_rows - 1, -1, -1))

    def assign(self, table: Sequence[int]) -> int:
        """A free row for a sequence that takes `table` (maybe empty); its index."""
        if not self._free:  # more sequences hold blocks than the batch has slots: a row more
            self.array = np.concatenate([self.array, np.full((1, self.array.shape[1]), NULL_BLOCK, np.int32)])
            self._free.append(len(self.array) - 1)
        row = self._free.pop()
        self._widen(len(table))
        self.array[row, : len(table)] = table
        return row

    def release(self, row: int, length: int) -> None:
        """Give back a row whose table (of `length` blocks) was freed."""
        self.array[row, :length] = NULL_BLOCK
        self._free.append(row)

    def append(self, row: int, index: int, block: int) -> None:
        """Block `block` became entry `index` of the row's table."""
        if index >= self.array.shape[1]:
            self._widen(index + 1)
        self.array[row, index] = block

    def drop(self, row: int, index: int) -> None:
        """Entry `index`, the table's last, was freed."""
        self.array[row, index] = NULL_BLOCK

    def _widen(self, width: int) -> None:
        if width > self.array.shape[1]:
            extra = max(width, 2 * self.array.shape[1]) - self.array.shape[1]
            self.array = np.pad(self.array, ((0, 0), (0, extra)), constant_values=NULL_BLOCK)


class OutOfBlocks(Exception):
    """Raised by the allocator when the pool has no free block; the scheduler preempts."""


class BlockAllocator:
    """Hands out blocks ``first_block .. first_block + num_blocks - 1`` of the pool.

    Blocks below ``first_block`` are never handed out: the CUDA-graph runner points its
    padding tokens at block 0. With an `offload` tier (gpu_target/kv_offload.py), a cached
    block is copied there when its last user frees it (evicting it later copies nothing),
    and a prefix's blocks found there are copied back instead of recomputed; a block
    matched holds its KV once `blocks_ready` says so, and a block whose copy may still be
    in flight is reused only when no other free block is left.
    `hit_count_log` counts where prompts' blocks were found.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        first_block: int = 0,
        offload: Optional["PrefixCacheOffload"] = None,
        hit_count_log: Optional["HitCountLog"] = None,
    ):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.offload = offload
        self.hit_count_log = hit_count_log
        self.ref_counts = [0] * (first_block + num_blocks)
        self._uses = [0] * (first_block + num_blocks)  # sequences that took a cached block, its computing one included
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(first_block, first_block + num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self) -> int:
        """A block for new KV; the compute stream first waits for any copy still touching it."""
        block = self._claim()
        if self.offload is not None:
            self.offload.before_reuse(block)
        return block

    def _claim(self) -> int:
        """Take a free block, dropping what it cached: the least recently freed, or with an
        offload tier the least recently freed whose copies have completed (if any has), so
        that reusing it stalls nothing."""
        if not self._free:
            raise OutOfBlocks
        block = next(iter(self._free))
        offload = self.offload
        if offload is not None and offload.busy(block):
            # Only blocks with a copy tracked can be busy: among one more than those, one is not.
            candidates = itertools.islice(self._free, offload.num_tracked_blocks + 1)
            block = next((candidate for candidate in candidates if not offload.busy(candidate)), block)
        del self._free[block]
        old_hash = self._block_to_hash.pop(block, None)
        if old_hash is not None:
            del self._hash_to_block[old_hash]
        self.ref_counts[block] = 1
        self._uses[block] = 1
        return block

    def blocks_ready(self, blocks: Sequence[int]) -> bool:
        """Whether `blocks` (a prefix matched) hold their KV: no restore into them still in flight."""
        return self.offload is None or self.offload.ready(blocks)

    def wait_for_blocks(self, blocks: Sequence[int]) -> None:
        """Block the host until every restore into `blocks` has completed."""
        if self.offload is not None:
            self.offload.wait_ready(blocks)

    def free(self, block: int) -> None:
        self._copy_out([block] if self._release(block) else [])

    def free_all(self, blocks: Sequence[int]) -> None:
        freed = [block for block in reversed(blocks) if self._release(block)]  # the tail first: evicted first
        self._copy_out(freed[::-1])

    def _release(self, block: int) -> bool:
        """Drop one reference; whether the block became free while caching a prefix block."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] < 0:
            raise RuntimeError(f"block {block} freed more often than allocated")
        if self.ref_counts[block] > 0:
            return False
        self._free[block] = None
        if block not in self._block_to_hash:
            # Nothing to keep (a partial block, a dropped tree's): reused before any cached one.
            self._free.move_to_end(block, last=False)
            return False
        return True

    def _copy_out(self, blocks: list[int]) -> None:
        """Hand cached blocks just freed, in prefix order, to the offload tier: one batch."""
        if self.offload is not None and blocks:
            self.offload.offload([(self._block_to_hash[block], block, self._uses[block]) for block in blocks])

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1
        self._uses[block] += 1

    def match_prefix(self, block_hashes: Sequence[bytes], num_tokens: int) -> list[int]:
        """Cached blocks covering the longest run of a sequence's full blocks, referenced.

        `block_hashes` are the sequence's chained block hashes (`extend_block_hashes`). Each
        block is looked up in device memory, then in the offload tier (copied back into a
        new block; all of a prompt's in one batch, queued: see `blocks_ready`). Never
        covers the last token: its logits must be computed, so at least one token is left
        to prefill. Counts the lookup in `stats`, in tokens as vLLM does.
        """
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        restored_hashes: list[bytes] = []
        restored_blocks: list[int] = []
        for hash_value in block_hashes[: (num_tokens - 1) // self.block_size]:
            block = self._hash_to_block.get(hash_value)
            if block is not None:
                self._take(block)
            elif self.offload is not None and hash_value in self.offload:
                try:
                    block = self._claim()  # the restore itself waits for its earlier copies, not the compute stream
                except OutOfBlocks:
                    break
                self._hash_to_block[hash_value] = block
                self._block_to_hash[block] = hash_value
                restored_hashes.append(hash_value)
                restored_blocks.append(block)
            else:
                break
            blocks.append(block)
        if restored_blocks:
            for block, uses in zip(restored_blocks, self.offload.restore(restored_hashes, restored_blocks)):
                self._uses[block] = uses + 1
        self._count(num_tokens, len(blocks) - len(restored_blocks), len(restored_blocks))
        return blocks

    def _count(self, num_tokens: int, gpu_blocks: int, cpu_blocks: int) -> None:
        bs = self.block_size
        self.stats.queries += num_tokens
        self.stats.hits += gpu_blocks * bs
        if self.offload is not None:
            self.stats.external_queries += num_tokens
            self.stats.external_hits += cpu_blocks * bs
        if self.hit_count_log is not None:
            prompt_blocks = -(-num_tokens // bs)
            self.hit_count_log.record(gpu_blocks, cpu_blocks, prompt_blocks - gpu_blocks - cpu_blocks)

    def register_blocks(self, block_hashes: Sequence[bytes], blocks: Sequence[int]) -> None:
        """Make full, computed blocks findable by later prompts under their content hashes."""
        for hash_value, block in zip(block_hashes, blocks):
            if hash_value in self._hash_to_block or block in self._block_to_hash:
                continue
            self._hash_to_block[hash_value] = block
            self._block_to_hash[block] = hash_value


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups in tokens, as vLLM counts them.

    `queries`: prompt tokens looked up; `hits`: those whose KV was found in device memory.
    `external_*`: the same for the offload tier (vLLM's name for a tier outside the
    device's KV memory), counted only when there is one.
    """

    queries: int = 0
    hits: int = 0
    external_queries: int = 0
    external_hits: int = 0


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, num_tokens: int) -> None:
    """Append the hashes of the full blocks of `token_ids[:num_tokens]` not hashed yet.

    SHA-256, chained so equal hashes mean equal prefixes. A cryptographic hash, because a
    server shares cached blocks between users: with Python's `hash` a crafted prompt
    could collide with another's and read its KV. Incremental, so a sequence's blocks are
    hashed once however many steps it runs.
    """
    previous = hashes[-1] if hashes else b""
    for block in range(len(hashes), num_tokens // block_size):
        chunk = np.asarray(token_ids[block * block_size : (block + 1) * block_size], dtype=np.int64)
        previous = hashlib.sha256(previous + chunk.tobytes()).digest()
        hashes.append(previous)
