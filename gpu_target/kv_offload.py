"""TACO-LLM's prefix cache offload: a CPU block pool under the device's prefix cache.

A cached block is copied to the CPU pool, under its content hash, when its last user frees
it (write-through at free time, as vLLM V1's CPU offloading connector and LMCache store
blocks once computed), so that evicting it later for a new allocation only drops the
device copy: no copy sits between the scheduler and the prefill that needs the block. A
later prompt whose prefix hashes to a block no longer on the device gets the copy written
back into a fresh device block instead of recomputing it, its blocks in one batch
(TACO-LLM: `--enable-prefix-cache-offload`).

Copies run asynchronously (gpu_target/kv_host_pool.py) and this class orders them by what
they touch, so that no one waits for a copy that is not theirs: a restore starts after any
copy out still reading its device block and any copy out still filling its slot; a copy
out after any restore still filling its block or reading its slot. Nothing else waits for
a restore: a prefix restored is in its blocks once `ready` says so, and the scheduler runs
its request only then (vLLM V1's WAITING_FOR_REMOTE_KVS), the rest of the batch meanwhile.
A device block whose copies may still be in flight is reused for new KV only after them
(`before_reuse`: the compute stream waits), and the allocator takes such a block only when
every free block is (`busy`). The pool holds copies of blocks also still on the device (an
inclusive tier), so it pays off when larger than the device cache; it replaces its least
recently freed or restored entries.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Iterable, Sequence

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
        # Copies that may still be in flight, by what they touch (None, the CPU's, are never kept):
        self._reading_block: dict[int, Handle] = {}  # device block -> its copy out
        self._writing_block: dict[int, Handle] = {}  # device block -> the restore filling it
        self._reading_slot: dict[int, Handle] = {}  # host slot -> the restore reading it
        self._writing_slot: dict[int, Handle] = {}  # host slot -> the copy out filling it
        self.num_offloaded = 0  # blocks copied to the CPU
        self.num_restored = 0  # blocks copied back to the device
        self.num_reuse_waits = 0  # device blocks reused while a copy of theirs was in flight (the compute stream waited)

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
        after = self._in_flight(self._writing_block, blocks) + self._in_flight(self._reading_slot, slots)
        handle = self.host.to_host(blocks, slots, after)
        _track(self._reading_block, blocks, handle)
        _track(self._writing_slot, slots, handle)
        self.num_offloaded += len(blocks)
        return len(blocks)

    def _take_slot(self) -> int:
        """A free slot, or the least recently used entry's."""
        return self._free_slots.pop() if self._free_slots else self._entries.popitem(last=False)[1][0]

    def busy(self, block: int) -> bool:
        """Whether a copy out of, or a restore into, device `block` may still be in flight."""
        return bool(self._in_flight(self._reading_block, [block]) or self._in_flight(self._writing_block, [block]))

    @property
    def num_tracked_blocks(self) -> int:
        """At least the number of device blocks `busy` (entries found done are dropped lazily)."""
        return len(self._reading_block.keys() | self._writing_block.keys())

    def before_reuse(self, block: int) -> None:
        """Device `block` is about to hold new KV: the compute stream first waits for its copies in flight."""
        pending = self._in_flight(self._reading_block, [block]) + self._in_flight(self._writing_block, [block])
        self.num_reuse_waits += bool(pending)
        for handle in pending:
            self.host.compute_waits(handle)

    def ready(self, blocks: Iterable[int]) -> bool:
        """Whether every restore into `blocks` has completed (never blocks)."""
        return not self._in_flight(self._writing_block, blocks)

    def wait_ready(self, blocks: Iterable[int]) -> None:
        """Block the host until every restore into `blocks` has completed."""
        for handle in self._in_flight(self._writing_block, blocks):
            self.host.wait(handle)

    def restore(self, hashes: Sequence[bytes], blocks: Sequence[int]) -> list[int]:
        """Queue the copies of the blocks held under `hashes` into device `blocks` (just
        allocated), one batch; each one's uses so far. The blocks hold their KV once `ready`.

        Every hash must be held. The entries stay in the pool (freeing the blocks again needs
        no copy) as the most recently used.
        """
        slots, uses = [], []
        for block_hash in hashes:
            slot, held_uses = self._entries.pop(block_hash)
            self._entries[block_hash] = (slot, held_uses)
            slots.append(slot)
            uses.append(held_uses)
        after = self._in_flight(self._reading_block, blocks) + self._in_flight(self._writing_slot, slots)
        handle = self.host.to_device(slots, blocks, after)
        _track(self._writing_block, blocks, handle)
        _track(self._reading_slot, slots, handle)
        self.num_restored += len(blocks)
        return uses

    def _in_flight(self, copies: dict[int, Handle], keys: Iterable[int]) -> list[Handle]:
        """The distinct copies in `copies` under `keys` not completed yet; completed ones are dropped."""
        pending: list[Handle] = []
        done: list[Handle] = []
        for key in keys:
            handle = copies.get(key)
            if handle is None or any(handle is seen for seen in pending):
                continue
            if any(handle is seen for seen in done) or self.host.is_done(handle):
                done.append(handle)
                del copies[key]
            else:
                pending.append(handle)
        return pending


def _track(copies: dict[int, Handle], keys: Sequence[int], handle: Handle) -> None:
    """File a queued copy under the blocks or slots it touches (the CPU's, done at once, under none)."""
    if handle is not None:
        for key in keys:
            copies[key] = handle


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
