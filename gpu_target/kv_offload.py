"""TACO-LLM's prefix cache offload: a CPU block pool under the device's prefix cache.

When the block allocator evicts a cached block (its slot is about to hold other KV), the
block's K and V of every layer are copied into a CPU pool under the block's content hash;
a later prompt whose prefix hashes to it gets the copy written back into a fresh device
block instead of recomputing it (TACO-LLM: `--enable-prefix-cache-offload`; vLLM V1 does
the same through its CPU offloading connector).

On CUDA the pool is pinned host memory and every copy runs on a side stream, after the
work already queued on the compute stream and before any work queued after it: the host
never waits, and the block's slot is overwritten, or a restored block read, only once its
copy is done. On the CPU the copies are plain synchronous copies. The pool replaces its
least recently used entries; an entry being restored is held out of that choice.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import Callable, Iterator, Optional

import torch

from gpu_target.kv_cache import KVCachePool

logger = logging.getLogger("hetero")

HIT_COUNT_INTERVAL = 100  # prompt blocks between two `[HIT CNT]` lines (TACO-LLM's)
# The pool is allocated in chunks of at most this many bytes: PyTorch's pinned-memory
# allocator rounds every allocation up to a power of two, which would waste up to half of
# one big pool; only the last chunk's rounding is lost this way.
_CHUNK_BYTES = 2**28


class PrefixCacheOffload:
    """`num_blocks` CPU copies of device KV blocks, each filed under its chained content hash.

    A block is taken in only once it has been used `min_access_threshold` times (computed
    once, then found by later prompts), TACO-LLM's `--apc-offload-min-access-threshold`.
    """

    def __init__(self, kv_pool: KVCachePool, num_blocks: int, min_access_threshold: int = 1):
        if num_blocks < 1:
            raise ValueError(f"cpu_offload_gib holds no KV block (one block takes {self.block_bytes(kv_pool)} bytes)")
        self.kv_pool = kv_pool
        self.num_blocks = num_blocks
        self.min_access_threshold = min_access_threshold
        layers, kv, _, block_size, heads, head_dim = kv_pool.storage.shape
        device = kv_pool.storage.device
        cuda = device.type == "cuda"
        self._blocks_per_chunk = max(1, _CHUNK_BYTES // self.block_bytes(kv_pool))
        self._chunks = [
            torch.empty(
                (min(self._blocks_per_chunk, num_blocks - first), layers, kv, block_size, heads, head_dim),
                dtype=kv_pool.storage.dtype, pin_memory=cuda,
            )
            for first in range(0, num_blocks, self._blocks_per_chunk)
        ]
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # hash -> (slot, uses), oldest first
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        self.num_offloaded = 0  # blocks copied to the CPU
        self.num_restored = 0  # blocks copied back to the device

    @staticmethod
    def block_bytes(kv_pool: KVCachePool) -> int:
        storage = kv_pool.storage
        return storage[:, :, 0].numel() * storage.element_size()

    @classmethod
    def sized(cls, kv_pool: KVCachePool, gib: float, min_access_threshold: int = 1) -> "PrefixCacheOffload":
        """A pool of as many blocks as `gib` GiB of host memory holds (`--cpu-offload-gib`)."""
        return cls(kv_pool, int(gib * 2**30 // cls.block_bytes(kv_pool)), min_access_threshold)

    def host_block(self, slot: int) -> torch.Tensor:
        """The CPU copy in `slot`: [layers, 2, block_size, num_kv_heads, head_dim]."""
        return self._chunks[slot // self._blocks_per_chunk][slot % self._blocks_per_chunk]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def offload(self, block_hash: bytes, block: int, uses: int) -> bool:
        """Keep a copy of device block `block` (about to be reused) under `block_hash`; whether one is kept.

        A hash already held only becomes the most recently used: equal hashes mean equal KV.
        """
        if block_hash in self._entries:
            slot, held_uses = self._entries.pop(block_hash)
            self._entries[block_hash] = (slot, max(uses, held_uses))
            return True
        if uses < self.min_access_threshold:
            return False
        if self._free_slots:
            slot = self._free_slots.pop()
        elif self._entries:
            _, (slot, _) = self._entries.popitem(last=False)
        else:
            return False  # every slot is held by restores in progress
        self._copy(self.host_block(slot), self.kv_pool.storage[:, :, block])
        self._entries[block_hash] = (slot, uses)
        self.num_offloaded += 1
        return True

    def restore(self, block_hash: bytes, allocate_block: Callable[[], int]) -> Optional[tuple[int, int]]:
        """Copy the block held under `block_hash` into a device block from `allocate_block()`.

        Returns (device block, uses so far), or None when the hash is not held. The entry
        stays in the pool (a later eviction of the block needs no copy) and is held out of
        replacement while `allocate_block` evicts, so the copy it reads is still its own.
        Whatever `allocate_block` raises propagates.
        """
        with self._held(block_hash) as entry:
            if entry is None:
                return None
            slot, uses = entry
            block = allocate_block()
            self._copy(self.kv_pool.storage[:, :, block], self.host_block(slot))
        self.num_restored += 1
        return block, uses

    @contextlib.contextmanager
    def _held(self, block_hash: bytes) -> Iterator[Optional[tuple[int, int]]]:
        entry = self._entries.pop(block_hash, None)
        try:
            yield entry
        finally:
            if entry is not None:
                self._entries[block_hash] = entry  # back as the most recently used

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src in the compute stream's order, without the host waiting on CUDA."""
        if self._stream is None:
            dst.copy_(src)
            return
        compute = torch.cuda.current_stream(self.kv_pool.storage.device)
        self._stream.wait_stream(compute)  # after the kernels that wrote the block
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        compute.wait_stream(self._stream)  # before the kernels that overwrite or read it


class HitCountLog:
    """TACO-LLM's `--apc-offload-enable-hit-cnt`: where prompts' blocks were found, logged every 100.

    Every block of an admitted prompt counts once: found in device memory, restored from the
    CPU pool, or not found (computed). The counts are cumulative since start-up.
    """

    def __init__(self, interval: int = HIT_COUNT_INTERVAL):
        self.interval = interval
        self.gpu = self.cpu = self.missed = 0

    @property
    def total(self) -> int:
        return self.gpu + self.cpu + self.missed

    def record(self, gpu: int, cpu: int, missed: int) -> None:
        before = self.total // self.interval
        self.gpu += gpu
        self.cpu += cpu
        self.missed += missed
        if self.total // self.interval > before:
            logger.info(self.line())

    def line(self) -> str:
        total = self.total

        def share(count: int) -> str:
            return f"{100.0 * count / total:.2f}%" if total else "0.00%"

        return (
            f"[HIT CNT] total: {total}, gpu: {self.gpu} ({share(self.gpu)}) cpu: {self.cpu} ({share(self.cpu)}) "
            f"not hit: {self.missed} ({share(self.missed)})"
        )
