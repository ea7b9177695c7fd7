"""Host memory for KV blocks, and the batched copies between it and the device's KV pool.

The offload tier (gpu_target/kv_offload.py) keeps its copies here. On CUDA the slots are
pinned host memory and copies run on two side streams, one per direction, so that copies
out never queue in front of the restores a prefill waits for (PCIe moves both directions
at once). Every copy starts after the work already queued on the compute stream (which
wrote or read the blocks) and after the copies its caller names (`after`: earlier copies
of the same blocks or slots on the other stream). Nothing waits for a copy on its own:
the caller asks whether it is done (`is_done`), or orders the compute stream after it
(`compute_waits`) or, with nothing else to run, the host (`wait`). Each batch is staged
through one device buffer: a block is [layers, 2, block_size, heads, head_dim] spread
across the pool, so the strided part is one device-side copy per block and the PCIe part
one copy per run of adjacent host slots, instead of one small transfer per layer (the
pattern of vLLM V1's CPU offloading connector and LMCache: few large transfers on their
own streams).

On the CPU the same copies run synchronously and a handle is None.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

import torch

from gpu_target.kv_cache import KVCachePool

# The pool is allocated in chunks of at most this many bytes: PyTorch's pinned-memory
# allocator rounds every allocation up to a power of two, which would waste up to half of
# one big pool; only the last chunk's rounding is lost this way.
_CHUNK_BYTES = 2**28
# A batch is staged through device memory in pieces of at most this many bytes, so that a
# long prompt's restore does not need its whole KV twice on the device at once.
_STAGING_BYTES = 2**25

Handle = Optional[torch.cuda.Event]  # a queued copy; None once done (the CPU's copies)


class HostKVPool:
    """`num_blocks` host slots, each holding one device block's K and V of every layer."""

    def __init__(self, kv_pool: KVCachePool, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"cpu_offload_gib holds no KV block (one block takes {self.block_bytes(kv_pool)} bytes)")
        self.storage = kv_pool.storage
        self.num_blocks = num_blocks
        layers, kv, _, block_size, heads, head_dim = self.storage.shape
        self._block_shape = (layers, kv, block_size, heads, head_dim)
        device = self.storage.device
        cuda = device.type == "cuda"
        block_bytes = self.block_bytes(kv_pool)
        self._blocks_per_chunk = max(1, _CHUNK_BYTES // block_bytes)
        self._staging_blocks = max(1, _STAGING_BYTES // block_bytes)
        self._chunks = [
            torch.empty((min(self._blocks_per_chunk, num_blocks - first), *self._block_shape),
                        dtype=self.storage.dtype, pin_memory=cuda)
            for first in range(0, num_blocks, self._blocks_per_chunk)
        ]
        self._to_host_stream = torch.cuda.Stream(device) if cuda else None
        self._to_device_stream = torch.cuda.Stream(device) if cuda else None

    @staticmethod
    def block_bytes(kv_pool: KVCachePool) -> int:
        storage = kv_pool.storage
        return storage[:, :, 0].numel() * storage.element_size()

    def host_block(self, slot: int) -> torch.Tensor:
        """The copy in `slot`: [layers, 2, block_size, num_kv_heads, head_dim]."""
        return self._chunks[slot // self._blocks_per_chunk][slot % self._blocks_per_chunk]

    def to_host(self, blocks: Sequence[int], slots: Sequence[int], after: Iterable[Handle] = ()) -> Handle:
        """Queue device `blocks[i]` -> host `slots[i]` after the compute stream's queued work and `after`."""
        def copy() -> None:
            for start, staging in self._staged(len(blocks)):
                for i in range(len(staging)):
                    staging[i].copy_(self.storage[:, :, blocks[start + i]])
                for first, host in self._host_runs(slots[start : start + len(staging)]):
                    host.copy_(staging[first : first + len(host)], non_blocking=True)

        return self._on_side_stream(self._to_host_stream, copy, after)

    def to_device(self, slots: Sequence[int], blocks: Sequence[int], after: Iterable[Handle] = ()) -> Handle:
        """Queue host `slots[i]` -> device `blocks[i]` after the compute stream's queued work and `after`;
        nothing waits for it until asked to."""
        def copy() -> None:
            for start, staging in self._staged(len(blocks)):
                for first, host in self._host_runs(slots[start : start + len(staging)]):
                    staging[first : first + len(host)].copy_(host, non_blocking=True)
                for i in range(len(staging)):
                    self.storage[:, :, blocks[start + i]].copy_(staging[i])

        return self._on_side_stream(self._to_device_stream, copy, after)

    def is_done(self, handle: Handle) -> bool:
        """Whether the copy `handle` has completed (asks the device; never blocks)."""
        return handle is None or handle.query()

    def compute_waits(self, handle: Handle) -> None:
        """Order the compute stream's later work after the copy `handle`."""
        if handle is not None:
            torch.cuda.current_stream(self.storage.device).wait_event(handle)

    def wait(self, handle: Handle) -> None:
        """Block the host until the copy `handle` has completed."""
        if handle is not None:
            handle.synchronize()

    def _on_side_stream(self, stream: Optional[torch.cuda.Stream], copy, after: Iterable[Handle]) -> Handle:
        if stream is None:
            copy()
            return None
        stream.wait_stream(torch.cuda.current_stream(self.storage.device))
        for handle in after:
            if handle is not None:
                stream.wait_event(handle)
        with torch.cuda.stream(stream):  # staging buffers belong to this stream: reused only in its order
            copy()
        done = torch.cuda.Event()
        done.record(stream)
        return done

    def _staged(self, count: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(first index, device staging buffer) for each piece of a batch of `count` blocks."""
        for start in range(0, count, self._staging_blocks):
            size = min(self._staging_blocks, count - start)
            yield start, torch.empty((size, *self._block_shape), dtype=self.storage.dtype, device=self.storage.device)

    def _host_runs(self, slots: Sequence[int]) -> Iterator[tuple[int, torch.Tensor]]:
        """(first index into `slots`, host view) for each run of adjacent slots within one chunk."""
        per_chunk = self._blocks_per_chunk
        first = 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[i - 1] + 1 or slots[i] % per_chunk == 0:
                chunk, offset = divmod(slots[first], per_chunk)
                yield first, self._chunks[chunk][offset : offset + i - first]
                first = i
