"""TACO-LLM's prefix cache offload: a CPU block pool under the device's prefix cache.

A cached block is copied to the CPU pool, under its content hash, when its last user frees
it (write-through at free time, as vLLM V1's CPU offloading connector and LMCache store
blocks once computed), so that evicting it later for a new allocation only drops the
device copy: no copy sits between the scheduler and the prefill that needs the block. A
later prompt whose prefix hashes to a block no longer on the device gets the copy written
back into a fresh device block instead of recomputing it, its blocks in one batch
(TACO-LLM: `--enable-prefix-cache-offload`).

Copies run asynchronously (gpu_target/kv_host_pool.py). A device block whose copy out may
still be in flight is reused only after it: the compute stream waits for it when the block
is allocated again. That one wait orders everything else, as every copy starts after the
compute stream's queued work and the compute stream waits for every restore: a slot is
read back only once its block was reused (a hash leaves the device only so), hence after
its copy in, and a slot is refilled only after the restores queued before. The pool holds copies of blocks also still on the
device (an inclusive tier), so it pays off when larger than the device cache; it replaces
its least recently freed or restored entries.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Sequence

from gpu_target.kv_cache import KVCachePool
from gpu_target.kv_host_pool import Handle, HostKVPool

logger = logging.getLogger("hetero")

HIT_COUNT_INTERVAL = 100  # prompt blocks between two `[HIT CNT]` lines (TACO-LLM's)


class PrefixCacheOffload:
    """Copies of device KV blocks in `host`'s slots, each filed under its chained content hash.

    A block is taken in only once it has been used `min_access_threshold` times (computed
    once, then found by later prompts), TACO-LLM's `--apc-offload-min-access-threshold`.
    """

    def __init__(self, host: HostKVPool, min_access_threshold: int = 1):
        self.host = host
        self.num_blocks = host.num_blocks
        self.min_access_threshold = min_access_threshold
        self._entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # hash -> (slot, uses), oldest first
        self._free_slots = list(range(host.num_blocks - 1, -1, -1))
        self._copy_out_of_block: dict[int, Handle] = {}  # device block -> its copy out, maybe in flight
        self.num_offloaded = 0  # blocks copied to the CPU
        self.num_restored = 0  # blocks copied back to the device

    @classmethod
    def sized(cls, kv_pool: KVCachePool, gib: float, min_access_threshold: int = 1) -> "PrefixCacheOffload":
        """A pool of as many blocks as `gib` GiB of host memory holds (`--cpu-offload-gib`)."""
        return cls(HostKVPool(kv_pool, int(gib * 2**30 // HostKVPool.block_bytes(kv_pool))), min_access_threshold)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def offload(self, freed: Sequence[tuple[bytes, int, int]]) -> int:
        """Copy out blocks just freed, in prefix order, as (hash, device block, uses so far); how many
        copies were queued.

        A hash already held only becomes more recently used: equal hashes mean equal KV.
        Entries enter tail first, so that a prefix's tail is replaced before its head (as the
        device evicts), in ascending slots, so that a prefix comes back in few transfers. The
        blocks stay cached on the device; their copies run while it goes on computing.
        """
        fresh = []
        for block_hash, block, uses in reversed(freed):
            if block_hash in self._entries:
                slot, held_uses = self._entries.pop(block_hash)
                self._entries[block_hash] = (slot, max(uses, held_uses))
            elif uses >= self.min_access_threshold:
                fresh.append((block_hash, block, uses))
        fresh = fresh[::-1][: self.num_blocks]  # prefix order; a prefix's head is worth more than its tail
        if not fresh:
            return 0
        slots = sorted(self._take_slot() for _ in fresh)
        for (block_hash, _, uses), slot in reversed(list(zip(fresh, slots))):
            self._entries[block_hash] = (slot, uses)
        blocks = [block for _, block, _ in fresh]
        handle = self.host.to_host(blocks, slots)
        for block in blocks:
            self._copy_out_of_block[block] = handle
        self.num_offloaded += len(blocks)
        return len(blocks)

    def _take_slot(self) -> int:
        """A free slot, or the least recently used entry's."""
        return self._free_slots.pop() if self._free_slots else self._entries.popitem(last=False)[1][0]

    def before_reuse(self, block: int) -> None:
        """Device `block` is about to hold other KV: the compute stream first waits for its copy out."""
        handle = self._copy_out_of_block.pop(block, None)
        if handle is not None:
            self.host.compute_waits(handle)

    def restore(self, hashes: Sequence[bytes], blocks: Sequence[int]) -> list[int]:
        """Copy the blocks held under `hashes` into device `blocks` (just allocated), one batch;
        each one's uses so far.

        Every hash must be held. The entries stay in the pool (freeing the blocks again needs
        no copy) as the most recently used.
        """
        slots, uses = [], []
        for block_hash in hashes:
            slot, held_uses = self._entries.pop(block_hash)
            self._entries[block_hash] = (slot, held_uses)
            slots.append(slot)
            uses.append(held_uses)
        self.host.to_device(slots, blocks)
        self.num_restored += len(blocks)
        return uses


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
