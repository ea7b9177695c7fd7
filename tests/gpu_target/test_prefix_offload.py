"""Automatic prefix caching (on by default) and TACO-LLM's CPU offload tier under it.

Lossless: outputs are the same with prefix caching on or off and the offload tier on or
off, also when a tiny KV cache evicts all the time; a block restored from the CPU holds
bit for bit the KV it was offloaded with, never another sequence's. The engines run on the
CPU in float32 (exact equality) with caches sized in blocks, also on a GPU host.
"""
from __future__ import annotations

import logging
import random
from typing import Callable, Optional

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from gpu_target import kv_host_pool, kv_offload
from gpu_target.kv_cache import BlockAllocator, KVCachePool, OutOfBlocks, extend_block_hashes
from gpu_target.kv_host_pool import HostKVPool
from gpu_target.kv_offload import HitCountLog, PrefixCacheOffload
from gpu_target.loader import load_config
from gpu_target.model_config import ModelConfig
from hetero import LLM, SamplingParams
from hetero.cli import engine_config_from_args, parse_serve_args
from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine
from hetero.metrics import ServerMetrics, snapshot_engine

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
TINY_CONFIG = ModelConfig(
    architecture="llama", vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
    intermediate_size=32,
)


def _pool(num_blocks: int) -> KVCachePool:
    return KVCachePool(TINY_CONFIG, num_blocks, BLOCK, torch.float32, "cpu")


def _content(block_hash: bytes, pool: KVCachePool) -> torch.Tensor:
    """The KV a block with this hash holds: a function of the hash alone, as real KV is of its prefix."""
    generator = torch.Generator().manual_seed(int.from_bytes(block_hash[:7], "little"))
    return torch.randn(pool.storage[:, :, 0].shape, generator=generator)


def _compute(pool: KVCachePool, block: int, block_hash: bytes) -> None:
    pool.storage[:, :, block] = _content(block_hash, pool)


def _hashes(tokens: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BLOCK, len(tokens))
    return hashes


# --------------------------------------------------------------- the CPU pool
class LateCopies(HostKVPool):
    """A device's latest timing, on the CPU: a copy runs `ticks_out` (copies out) or
    `ticks_in` (restores) ticks after it was queued (None: only once something waits for
    it), never before its stream's earlier copies and the copies it was queued `after`,
    and reads its source as it is by then. Until it has run its handle is not done; a
    slot holds nothing to rely on before its copy lands."""

    def __init__(self, kv_pool: KVCachePool, num_blocks: int, ticks_out: Optional[int] = None, ticks_in: Optional[int] = 0):
        super().__init__(kv_pool, num_blocks)
        for chunk in self._chunks:
            chunk.fill_(float("nan"))
        self.ticks = {"out": ticks_out, "in": ticks_in}
        self.now = 0
        self.queued: list[dict] = []  # copies not run yet, in queue order
        self.num_compute_waits = 0  # copies run because the compute stream waited for them
        self.num_host_waits = 0  # copies run because the host waited for them

    def to_host(self, blocks, slots, after=()):
        blocks, slots = list(blocks), list(slots)
        return self._queue("out", lambda: HostKVPool.to_host(self, blocks, slots), after)

    def to_device(self, slots, blocks, after=()):
        slots, blocks = list(slots), list(blocks)
        return self._queue("in", lambda: HostKVPool.to_device(self, slots, blocks), after)

    def _queue(self, stream: str, run: Callable[[], None], after) -> dict:
        ticks = self.ticks[stream]
        copy = dict(stream=stream, run=run, after=list(after), due=None if ticks is None else self.now + ticks)
        self.queued.append(copy)
        if ticks == 0:
            self._run(copy)
        return copy

    def _run(self, copy: dict) -> None:
        if not any(queued is copy for queued in self.queued):
            return
        for earlier in [queued for queued in self.queued[: self.queued.index(copy)] if queued["stream"] == copy["stream"]]:
            self._run(earlier)
        for dependency in copy["after"]:
            self._run(dependency)
        self.queued.remove(copy)
        copy["run"]()

    def is_done(self, handle) -> bool:
        return not any(queued is handle for queued in self.queued)

    def compute_waits(self, handle) -> None:
        if not self.is_done(handle):
            self.num_compute_waits += 1
            self._run(handle)

    def wait(self, handle) -> None:
        if not self.is_done(handle):
            self.num_host_waits += 1
            self._run(handle)

    def tick(self) -> None:
        self.now += 1
        for copy in [queued for queued in self.queued if queued["due"] is not None and queued["due"] <= self.now]:
            self._run(copy)

    def drain(self) -> None:
        while self.queued:
            self._run(self.queued[0])


def _late(ticks_out: Optional[int], ticks_in: Optional[int]) -> type[LateCopies]:
    """`LateCopies` with these delays, built as `HostKVPool` is (the engine's `PrefixCacheOffload.sized`)."""
    def __init__(self, kv_pool: KVCachePool, num_blocks: int) -> None:
        LateCopies.__init__(self, kv_pool, num_blocks, ticks_out, ticks_in)

    return type(f"LateCopies{ticks_out}_{ticks_in}", (LateCopies,), {"__init__": __init__})


def _offload(pool: KVCachePool, num_blocks: int, min_access_threshold: int = 1, host=HostKVPool) -> PrefixCacheOffload:
    return PrefixCacheOffload(host(pool, num_blocks), min_access_threshold)


def test_host_pool_round_trip_is_bit_identical_across_chunks_and_staging_pieces(monkeypatch):
    pool = _pool(10)
    block_bytes = HostKVPool.block_bytes(pool)
    monkeypatch.setattr(kv_host_pool, "_CHUNK_BYTES", 3 * block_bytes)
    monkeypatch.setattr(kv_host_pool, "_STAGING_BYTES", 2 * block_bytes)
    host = HostKVPool(pool, 7)
    assert [len(chunk) for chunk in host._chunks] == [3, 3, 1]
    pool.storage.normal_()
    original = pool.storage.clone()
    blocks, slots = [9, 2, 5, 0, 7, 3, 1], [2, 3, 4, 6, 0, 5, 1]  # runs of slots across chunk edges
    assert host.to_host(blocks, slots) is None  # the CPU's copies are done when queued
    for block, slot in zip(blocks, slots):
        assert torch.equal(host.host_block(slot), original[:, :, block])
    pool.storage.zero_()
    targets = [4, 5, 6, 7, 8, 9, 0]
    host.to_device(slots, targets)
    for block, target in zip(blocks, targets):
        assert torch.equal(pool.storage[:, :, target], original[:, :, block])


def test_offload_keeps_blocks_used_often_enough_and_replaces_the_least_recent():
    pool = _pool(4)
    pool.storage.normal_()
    offload = _offload(pool, 2, min_access_threshold=2)
    assert offload.offload([(b"once", 0, 1)]) == 0
    assert offload.offload([(b"a", 1, 2), (b"b", 2, 3)]) == 2
    assert offload.offload([(b"a", 1, 2)]) == 0  # a again: now the most recently used, not copied twice
    assert offload.offload([(b"c", 3, 2)]) == 1
    assert [h in offload for h in (b"a", b"b", b"c", b"once")] == [True, False, True, False]
    assert offload.num_offloaded == 3
    original = pool.storage.clone()
    pool.storage.zero_()
    assert offload.restore([b"a", b"c"], [0, 2]) == [2, 2]
    assert torch.equal(pool.storage[:, :, 0], original[:, :, 1]) and torch.equal(pool.storage[:, :, 2], original[:, :, 3])
    assert b"a" in offload and offload.num_restored == 2  # still held: freeing the block again needs no copy


def test_a_freed_prefix_takes_adjacent_slots_and_its_tail_is_replaced_first():
    pool = _pool(6)
    offload = _offload(pool, 4)
    offload.offload([(b"h0", 0, 1), (b"h1", 1, 1), (b"h2", 2, 1)])  # a prefix, head first
    assert [offload._entries[h][0] for h in (b"h0", b"h1", b"h2")] == [0, 1, 2]
    offload.offload([(b"x", 3, 1), (b"y", 4, 1)])  # full: the prefix's tail goes first
    assert [h in offload for h in (b"h0", b"h1", b"h2")] == [True, True, False]


def test_pool_size_comes_from_cpu_offload_gib():
    pool = _pool(4)
    block_bytes = HostKVPool.block_bytes(pool)
    assert block_bytes == KVCachePool.bytes_per_block(TINY_CONFIG, BLOCK, torch.float32)
    assert PrefixCacheOffload.sized(pool, 5.5 * block_bytes / 2**30).num_blocks == 5
    with pytest.raises(ValueError, match="cpu_offload_gib"):
        PrefixCacheOffload.sized(pool, 0.5 * block_bytes / 2**30)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the asynchronous copies are CUDA's")
def test_cuda_copies_are_ordered_with_the_compute_stream_without_waiting_on_the_host():
    """Blocks freed (copied out), evicted and overwritten at once, then restored and read as
    soon as they are ready, with no synchronisation in between: the copies still see, and
    deliver, the KV of their own moment."""
    config = ModelConfig(architecture="llama", vocab_size=32, hidden_size=1024, num_layers=32, num_heads=8,
                         num_kv_heads=8, head_dim=128, intermediate_size=32)
    pool = KVCachePool(config, 33, BLOCK, torch.bfloat16, "cuda")  # Llama-3-8B-sized 2 MiB blocks: copies that take a while
    allocator = BlockAllocator(32, BLOCK, True, first_block=1, offload=_offload(pool, 64))
    tokens = list(range(16 * BLOCK + 1))
    hashes = _hashes(tokens)
    table = [allocator.allocate() for _ in range(16)]
    pool.storage.normal_()
    expected = pool.storage[:, :, table].clone()
    allocator.register_blocks(hashes, table)
    allocator.free_all(table)  # copies out queued
    others = [allocator.allocate() for _ in range(32)]  # every block, the prefix's evicted
    pool.storage.normal_()  # queued at once on the compute stream: must wait for the copies out
    allocator.free_all(others)
    restored = allocator.match_prefix(hashes, len(tokens))
    assert allocator.stats.external_hits == 16 * BLOCK
    while not allocator.blocks_ready(restored):  # as the scheduler waits for them
        pass
    kv = pool.storage[:, :, restored].clone()
    torch.cuda.synchronize()
    assert torch.equal(kv, expected)


# ------------------------------------------------------- the allocator's hook
def test_blocks_are_copied_out_when_freed_and_evicting_them_copies_nothing(monkeypatch):
    pool = _pool(4)
    offload = _offload(pool, 8)
    allocator = BlockAllocator(4, BLOCK, True, offload=offload)
    copies_out, copies_in = [], []
    to_host, to_device = offload.host.to_host, offload.host.to_device
    monkeypatch.setattr(offload.host, "to_host",
                        lambda blocks, slots, after=(): copies_out.append(list(blocks)) or to_host(blocks, slots, after))
    monkeypatch.setattr(offload.host, "to_device",
                        lambda slots, blocks, after=(): copies_in.append(list(slots)) or to_device(slots, blocks, after))
    tokens = list(range(3 * BLOCK + 5))
    hashes = _hashes(tokens)
    table = [allocator.allocate() for _ in range(4)]
    for block, block_hash in zip(table, hashes):
        _compute(pool, block, block_hash)
    allocator.register_blocks(hashes, table)
    assert copies_out == []
    allocator.free_all(table)
    assert copies_out == [table[:3]]  # one batch at free time, the partial block not copied
    fill = [allocator.allocate() for _ in range(4)]  # evicts the three cached blocks
    assert not any(h in allocator._hash_to_block for h in hashes)
    assert copies_out == [table[:3]] and offload.num_offloaded == 3  # eviction copied nothing
    pool.storage[:, :, fill] = 0.0
    allocator.free_all(fill)
    restored = allocator.match_prefix(hashes, len(tokens))
    assert copies_in == [[0, 1, 2]]  # one batch from adjacent slots
    for block, block_hash in zip(restored, hashes):
        assert torch.equal(pool.storage[:, :, block], _content(block_hash, pool))
    allocator.free_all(restored)
    assert copies_out == [table[:3]]  # held already: not copied again


def test_blocks_that_cache_nothing_are_reused_before_cached_ones():
    """Speculative steps and run-ahead windows take blocks and hand them back every step:
    they must not wear the prefix cache (or, with offload, copy a block out every step)."""
    pool = _pool(3)
    allocator = BlockAllocator(3, BLOCK, True, offload=_offload(pool, 2))
    hashes = _hashes(list(range(17)))
    cached = allocator.allocate()
    allocator.register_blocks(hashes, [cached])
    allocator.free(cached)
    assert allocator.offload.num_offloaded == 1
    for _ in range(5):  # a tree's block, taken and dropped again
        allocator.free(allocator.allocate())
    assert allocator.offload.num_offloaded == 1
    assert allocator.match_prefix(hashes, 17) == [cached] and allocator.stats.hits == BLOCK


def test_access_threshold_counts_the_computing_sequence_and_every_hit():
    pool = _pool(2)
    allocator = BlockAllocator(1, BLOCK, True, offload=_offload(pool, 2, min_access_threshold=2))
    once, twice = _hashes(list(range(17))), _hashes(list(range(50, 67)))
    for hashes in (once, twice):
        block = allocator.allocate()
        allocator.register_blocks(hashes, [block])
        allocator.free(block)
        assert hashes[0] not in allocator.offload  # used once
        if hashes is twice:
            allocator.free_all(allocator.match_prefix(hashes, 17))  # a second use, from the device cache
    assert twice[0] in allocator.offload and once[0] not in allocator.offload


@pytest.mark.parametrize("waits", [True, False])
def test_a_block_reused_while_its_copy_out_is_pending_is_copied_first(monkeypatch, waits):
    """The block is evicted and overwritten by its next owner before its copy out ran: the
    allocator makes the compute stream wait for that copy. Without the wait (`waits`
    False, the check that this test can fail) the copy would read the new owner's KV, or
    the restore a slot the copy has not filled yet."""
    pool = _pool(2)
    host = LateCopies(pool, 4)
    allocator = BlockAllocator(2, BLOCK, True, offload=PrefixCacheOffload(host))
    if not waits:
        monkeypatch.setattr(allocator.offload, "before_reuse", lambda block: None)
    hashes = _hashes(list(range(17)))
    block = allocator.allocate()
    _compute(pool, block, hashes[0])
    allocator.register_blocks(hashes, [block])
    allocator.free(block)
    assert len(host.queued) == 1  # queued, not run
    others = [allocator.allocate(), allocator.allocate()]
    assert block in others and hashes[0] not in allocator._hash_to_block
    for other in others:
        pool.storage[:, :, other].normal_()  # the new owners' KV
    allocator.free_all(others)
    (restored,) = allocator.match_prefix(hashes, 17)
    host.drain()
    assert torch.equal(pool.storage[:, :, restored], _content(hashes[0], pool)) == waits


def test_the_allocator_reuses_blocks_whose_copies_are_done_before_those_still_copying():
    """The least recently freed block's copy out is still in flight: a block freed later,
    whose copy is done, is reused instead, and nothing waits; only when every free block
    is still copying does the compute stream wait."""
    pool = _pool(2)
    host = LateCopies(pool, 4)  # copies out run only when waited for
    allocator = BlockAllocator(2, BLOCK, True, offload=PrefixCacheOffload(host))
    early, late = _hashes(list(range(17))), _hashes(list(range(100, 117)))
    block = allocator.allocate()
    allocator.register_blocks(early, [block])
    allocator.free(block)
    host.drain()  # early's copy is done, and held: freeing its block again copies nothing
    (early_block,) = allocator.match_prefix(early, 17)
    late_block = allocator.allocate()
    allocator.register_blocks(late, [late_block])
    allocator.free(late_block)  # the least recently freed: its copy out is in flight
    allocator.free(early_block)
    assert len(host.queued) == 1 and allocator.offload.busy(late_block) and not allocator.offload.busy(early_block)
    assert allocator.allocate() == early_block and host.num_compute_waits == allocator.offload.num_reuse_waits == 0
    assert late[0] in allocator._hash_to_block  # still cached on the device
    assert allocator.allocate() == late_block and host.num_compute_waits == allocator.offload.num_reuse_waits == 1
    assert not host.queued


@pytest.mark.parametrize("host", [
    HostKVPool,
    LateCopies,  # copies out run only when waited for; restores at once
    _late(ticks_out=2, ticks_in=3),  # every copy lands a few rounds late
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_blocks_served_under_random_eviction_pressure_are_never_stale(seed, host):
    """The engine's use, modelled: prompts of shared prefixes come and go through a small
    device cache over a smaller CPU pool; every block the prefix cache hands out holds the
    KV of its own hash by the time its prompt runs (once `blocks_ready`, as the scheduler
    waits), whether it stayed on the device or came back from the CPU, also when copies
    run as late as the device may run them, and when prompts waiting for their restores
    are dropped (aborted) meanwhile."""
    rng = random.Random(seed)
    pool = _pool(9)
    allocator = BlockAllocator(8, BLOCK, True, first_block=1, offload=_offload(pool, 5, host=host))
    stems = [[rng.randrange(1000) for _ in range(BLOCK * 3)] for _ in range(4)]
    live: list[list[int]] = []
    restoring: list[tuple[list[int], list[bytes], list[int]]] = []  # matched, waiting for their copies
    for _ in range(400):
        if isinstance(allocator.offload.host, LateCopies):
            allocator.offload.host.tick()
        tokens = rng.choice(stems)[: BLOCK * rng.randint(1, 3)] + [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
        hashes = _hashes(tokens)
        restoring.append((tokens, hashes, allocator.match_prefix(hashes, len(tokens))))
        if rng.random() < 0.1:
            allocator.free_all(restoring.pop(rng.randrange(len(restoring)))[2])  # aborted while waiting
        if len(restoring) > 2:
            allocator.wait_for_blocks(restoring[0][2])  # nothing else to run
        ready = [entry for entry in restoring if allocator.blocks_ready(entry[2])]
        restoring = [entry for entry in restoring if entry not in ready]
        for tokens, hashes, table in ready:
            for block, block_hash in zip(table, hashes):
                assert torch.equal(pool.storage[:, :, block], _content(block_hash, pool))
            num_cached = len(table)
            try:
                while len(table) < -(-len(tokens) // BLOCK):
                    table.append(allocator.allocate())
            except OutOfBlocks:
                allocator.free_all(table)
                if live:
                    allocator.free_all(live.pop(0))
                continue
            for index in range(num_cached, len(table)):
                pool.storage[:, :, table[index]] = (
                    _content(hashes[index], pool) if index < len(hashes) else torch.randn(pool.storage[:, :, 0].shape)
                )
            allocator.register_blocks(hashes, table[: len(hashes)])
            live.append(table)
        while len(live) > rng.randint(0, 2):
            allocator.free_all(live.pop(0))
    assert allocator.stats.hits > 0 and allocator.stats.external_hits > 0


def test_hit_count_line_every_100_prompt_blocks(caplog):
    log = HitCountLog()
    with caplog.at_level(logging.INFO, logger="hetero"):
        log.record(gpu=30, cpu=20, missed=49)
        assert not caplog.records
        log.record(gpu=0, cpu=1, missed=0)
        log.record(gpu=50, cpu=0, missed=49)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["[HIT CNT] total: 100, gpu: 30 (30.00%) cpu: 21 (21.00%) not hit: 49 (49.00%)"]
    log.record(gpu=1, cpu=0, missed=0)
    assert log.line() == "[HIT CNT] total: 200, gpu: 81 (40.50%) cpu: 21 (10.50%) not hit: 98 (49.00%)"


# ------------------------------------------------------------------ the engine
def _kv_blocks(model_dir, num_blocks: int) -> float:
    """kv_cache_space (GiB) that gives the tiny float32 model exactly `num_blocks` blocks."""
    return num_blocks * KVCachePool.bytes_per_block(load_config(model_dir), BLOCK, torch.float32) / 2**30


def _conversations(num: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """Token prompts of multi-turn chats: a shared system prefix, then each chat's growing history."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 320) for _ in range(40)]
    chats = []
    for _ in range(num):
        history = list(system)
        prompts = []
        for _ in range(turns):
            history = history + [rng.randrange(3, 320) for _ in range(rng.randint(5, 14))]
            prompts.append(list(history))
            history = history + [rng.randrange(3, 320) for _ in range(GREEDY.max_tokens)]  # "the reply"
        chats.append(prompts)
    return chats


def _run_turns(llm: LLM, chats) -> list[list[int]]:
    """Every chat's turns, one `generate` per turn: a later turn finds earlier turns' blocks, or their copies."""
    outputs = []
    for turn in range(len(chats[0])):
        prompts = [{"prompt_token_ids": chat[turn]} for chat in chats]
        outputs += [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return outputs


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_outputs_are_identical_with_caching_and_offload_on_or_off_under_eviction(tiny_llama_dir, batch_invariant):
    chats = _conversations(num=6, turns=3)
    common = dict(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=3,
                  kv_cache_space=_kv_blocks(tiny_llama_dir, 12), batch_invariant=batch_invariant)
    runs = {
        "off": LLM(**common, enable_prefix_caching=False),
        "cache": LLM(**common),
        "offload": LLM(**common, enable_prefix_cache_offload=True, cpu_offload_gib=_kv_blocks(tiny_llama_dir, 40)),
    }
    outputs = {name: _run_turns(llm, chats) for name, llm in runs.items()}
    assert outputs["cache"] == outputs["off"]
    assert outputs["offload"] == outputs["off"]
    stats = {name: llm.llm_engine.scheduler.allocator.stats for name, llm in runs.items()}
    assert stats["off"].queries == 0
    assert 0 < stats["cache"].hits
    assert stats["offload"].external_hits > 0
    assert stats["offload"].hits + stats["offload"].external_hits > stats["cache"].hits  # evicted blocks came back


def _ticking(engine: LLMEngine) -> list[tuple[list[str], list[str]]]:
    """Advance the engine's `LateCopies` one tick before each schedule; per step, the requests
    scheduled and those left waiting for their restores."""
    steps = []
    schedule = engine.scheduler.schedule

    def ticked():
        engine.scheduler.allocator.offload.host.tick()
        scheduled = schedule()
        steps.append(([item.seq.group.request_id for item in scheduled],
                      [seq.group.request_id for seq in engine.scheduler.restoring]))
        return scheduled

    engine.scheduler.schedule = ticked
    return steps


@pytest.mark.parametrize("ticks_out, ticks_in", [(None, 0), (2, 3)])
def test_outputs_are_identical_with_copies_running_as_late_as_the_device_may(tiny_llama_dir, monkeypatch, ticks_out, ticks_in):
    """The engine with copies out deferred until something waits for them, or every copy
    landing steps late: blocks are evicted and rewritten while their copies are pending,
    requests wait for their restores while others run, and outputs still match."""
    chats = _conversations(num=6, turns=3, seed=2)
    common = dict(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=3,
                  kv_cache_space=_kv_blocks(tiny_llama_dir, 12))
    plain = LLM(**common, enable_prefix_caching=False)
    monkeypatch.setattr(kv_offload, "HostKVPool", _late(ticks_out, ticks_in))
    offload = LLM(**common, enable_prefix_cache_offload=True, cpu_offload_gib=_kv_blocks(tiny_llama_dir, 40))
    steps = _ticking(offload.llm_engine)
    assert _run_turns(offload, chats) == _run_turns(plain, chats)
    allocator = offload.llm_engine.scheduler.allocator
    host = allocator.offload.host
    assert allocator.stats.external_hits > 0
    if ticks_in:
        assert any(scheduled and waiting for scheduled, waiting in steps)  # others ran while a restore was in flight
    else:
        assert host.num_compute_waits > 0  # blocks reused before their copies out ran: waited for


def _engine_with_late_restores(tiny_llama_dir, monkeypatch, ticks_in: int) -> LLMEngine:
    monkeypatch.setattr(kv_offload, "HostKVPool", _late(0, ticks_in))
    return LLMEngine(EngineConfig(
        model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=96, batch_invariant=True,
        kv_cache_space=_kv_blocks(tiny_llama_dir, 8), enable_prefix_cache_offload=True,
        cpu_offload_gib=_kv_blocks(tiny_llama_dir, 32),
    ))


def _evicted_prefix(engine: LLMEngine, rng: random.Random) -> list[int]:
    """A 3-block prefix computed, freed (copied out) and then evicted from the device."""
    prefix = [rng.randrange(3, 320) for _ in range(3 * BLOCK)]
    _prefill(engine, "first", prefix + [1])
    for i in range(2):
        _prefill(engine, f"flood{i}", [rng.randrange(3, 320) for _ in range(5 * BLOCK)])
    assert not any(h in engine.scheduler.allocator._hash_to_block for h in _hashes(prefix))
    return prefix


def _fresh(tiny_llama_dir) -> LLMEngine:
    """An engine without prefix caching: it computes every prompt."""
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=96, batch_invariant=True,
                                  enable_prefix_caching=False))


def _run_to_end(engine: LLMEngine, prompt: Optional[list[int]] = None) -> dict[str, list[int]]:
    """Step until every request is done (after adding `prompt` as "fresh", if given); each one's tokens."""
    if prompt is not None:
        engine.add_request("fresh", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    return finished


def _start_busy(engine, rng, max_tokens: int) -> None:
    """A decoding request ("busy") beside the one whose restore is late; its prefill step run."""
    engine.add_request("busy", {"prompt_token_ids": [rng.randrange(3, 320) for _ in range(10)]},
                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    engine.step()


def test_a_request_waits_for_its_restore_while_the_others_run(tiny_llama_dir, monkeypatch):
    """The restore lands 3 steps after it was queued: meanwhile the request is not
    scheduled and a decoding request runs every step without waiting for the copy; then
    the request runs and generates what an engine that computed its prompt generates."""
    rng = random.Random(7)
    engine = _engine_with_late_restores(tiny_llama_dir, monkeypatch, ticks_in=3)
    prefix = _evicted_prefix(engine, rng)
    _start_busy(engine, rng, max_tokens=12)
    steps = _ticking(engine)
    prompt = prefix + [7, 8, 9]
    engine.add_request("again", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finished = _run_to_end(engine)
    assert steps[:3] == [(["busy"], ["again"])] * 3  # the copy in flight: only the other request runs
    assert steps[3][0] == ["busy", "again"] and steps[3][1] == []
    host = engine.scheduler.allocator.offload.host
    assert host.num_compute_waits == host.num_host_waits == engine.scheduler.num_restore_waits == 0  # nobody waited
    assert engine.groups == {} and engine.scheduler.allocator.stats.external_hits == 3 * BLOCK

    assert finished["again"] == _run_to_end(_fresh(tiny_llama_dir), prompt)["fresh"]


def test_with_nothing_else_to_run_the_engine_waits_for_the_restore(tiny_llama_dir, monkeypatch):
    engine = _engine_with_late_restores(tiny_llama_dir, monkeypatch, ticks_in=100)
    prefix = _evicted_prefix(engine, random.Random(8))
    steps = _ticking(engine)
    engine.add_request("again", {"prompt_token_ids": prefix + [7]}, SamplingParams(temperature=0, max_tokens=2))
    engine.step()
    assert steps[:2] == [([], ["again"]), (["again"], [])]  # one wait on the host, then it runs
    assert engine.scheduler.allocator.offload.host.num_host_waits == engine.scheduler.num_restore_waits == 1


def test_aborting_a_request_waiting_for_its_restore_frees_everything(tiny_llama_dir, monkeypatch):
    """Its blocks go back (still cached under their hashes: the copies land all the same), and
    a later request with the same prefix is served the restored KV, not a stale block."""
    rng = random.Random(9)
    engine = _engine_with_late_restores(tiny_llama_dir, monkeypatch, ticks_in=2)
    prefix = _evicted_prefix(engine, rng)
    _start_busy(engine, rng, max_tokens=8)
    _ticking(engine)
    prompt = prefix + [7, 8]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("aborted", {"prompt_token_ids": prompt}, params)
    engine.step()
    scheduler, allocator = engine.scheduler, engine.scheduler.allocator
    (seq,) = scheduler.restoring
    blocks = list(seq.block_table)
    assert not allocator.blocks_ready(blocks)
    engine.abort_request("aborted")
    assert scheduler.restoring == [] and seq.block_table == [] and seq.group.num_running == 0
    assert all(allocator.ref_counts[block] == 0 for block in blocks)
    engine.add_request("again", {"prompt_token_ids": prompt}, params)  # matches the blocks still being filled
    assert _run_to_end(engine)["again"] == _run_to_end(_fresh(tiny_llama_dir), prompt)["fresh"]
    assert allocator.num_free == allocator.num_blocks
    assert allocator.stats.hits >= 3 * BLOCK  # the second request found the restored blocks on the device


def test_offload_with_speculation_and_preemption_stays_lossless(tiny_llama_dir):
    chats = _conversations(num=5, turns=3, seed=1)
    common = dict(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
                  kv_cache_space=_kv_blocks(tiny_llama_dir, 10), speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    plain = LLM(**common, enable_prefix_caching=False)
    offload = LLM(**common, enable_prefix_cache_offload=True, cpu_offload_gib=_kv_blocks(tiny_llama_dir, 30))
    assert _run_turns(offload, chats) == _run_turns(plain, chats)
    assert offload.llm_engine.scheduler.num_preemptions > 0
    assert offload.llm_engine.scheduler.allocator.stats.external_hits > 0


def _prefill(engine: LLMEngine, request_id: str, token_ids: list[int], keep: bool = False):
    """Run a request of one output token to its end, or with `keep` only until its prompt's
    KV is computed (its blocks still its own); its sequence."""
    engine.add_request(request_id, {"prompt_token_ids": token_ids}, SamplingParams(temperature=0, max_tokens=1 + keep))
    seq = engine.groups[request_id].seqs[0]
    while seq.num_computed < len(token_ids) if keep else engine.has_unfinished_requests():
        engine.step()
    return seq


def _kv_of(engine: LLMEngine, seq, num_tokens: int) -> torch.Tensor:
    pool = engine.kv_pool
    slots = torch.tensor([seq.block_table[i // BLOCK] * BLOCK + i % BLOCK for i in range(num_tokens)])
    return pool.storage.view(pool.storage.shape[0], 2, -1, *pool.storage.shape[4:])[:, :, slots]


def test_a_restored_prefix_is_the_kv_a_fresh_run_computes(tiny_llama_dir):
    """A prefix's blocks are evicted, their device slots refilled by other sequences, then
    restored from the CPU: bit for bit the KV of an engine that computes the prompt anew.

    Batch-invariant, so that a prompt computed in one chunk or after a cached prefix gives
    the same bits."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 320) for _ in range(3 * BLOCK)]
    prompt = prefix + [7, 8, 9]
    common = dict(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=96, batch_invariant=True,
                  kv_cache_space=_kv_blocks(tiny_llama_dir, 6))
    # 24 CPU blocks hold every full block computed here (3 + 3 x 5): the tier is inclusive.
    engine = LLMEngine(EngineConfig(**common, enable_prefix_cache_offload=True, cpu_offload_gib=_kv_blocks(tiny_llama_dir, 24)))
    first = _prefill(engine, "first", prefix + [1])
    for i in range(3):  # others take every device block: the prefix's slots now hold their KV
        _prefill(engine, f"other{i}", [rng.randrange(3, 320) for _ in range(5 * BLOCK)])
    allocator = engine.scheduler.allocator
    assert not any(h in allocator._hash_to_block for h in first.block_hashes)
    seq = _prefill(engine, "again", prompt, keep=True)
    assert seq.group.num_cached_tokens == 3 * BLOCK and allocator.stats.external_hits == 3 * BLOCK

    fresh = LLMEngine(EngineConfig(**common, enable_prefix_caching=False))
    expected = _prefill(fresh, "fresh", prompt, keep=True)
    assert torch.equal(_kv_of(engine, seq, len(prompt)), _kv_of(fresh, expected, len(prompt)))


# ------------------------------------------------------- counters and flags
def test_metrics_count_prefix_cache_tokens_by_tier(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(
        model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=96, kv_cache_space=_kv_blocks(tiny_llama_dir, 6),
        enable_prefix_cache_offload=True, cpu_offload_gib=_kv_blocks(tiny_llama_dir, 24),  # every full block computed
    ))
    rng = random.Random(2)
    prefix = [rng.randrange(3, 320) for _ in range(2 * BLOCK)]
    _prefill(engine, "a", prefix + [1, 2])  # 34 tokens, nothing cached
    _prefill(engine, "b", prefix + [3])  # 33 tokens, 32 from the device
    for i in range(3):
        _prefill(engine, f"flood{i}", [rng.randrange(3, 320) for _ in range(5 * BLOCK)])  # 80 tokens each, evicting
    _prefill(engine, "c", prefix + [4, 5, 6])  # 35 tokens, 32 from the CPU
    metrics = ServerMetrics("tiny")
    metrics.on_snapshot(snapshot_engine(engine))
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }
    assert samples["hetero:prefix_cache_queries_total"] == 34 + 33 + 3 * 80 + 35
    assert samples["hetero:prefix_cache_hits_total"] == 32
    assert samples["hetero:external_prefix_cache_queries_total"] == 34 + 33 + 3 * 80 + 35
    assert samples["hetero:external_prefix_cache_hits_total"] == 32
    assert samples["hetero:prefix_cache_offloaded_blocks_total"] == engine.scheduler.allocator.offload.num_offloaded > 0
    assert samples["hetero:prefix_cache_hit_rate"] == pytest.approx(32 / (34 + 33 + 3 * 80 + 35))


def test_engine_logs_hit_counts(tiny_llama_dir, caplog):
    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=128, apc_offload_enable_hit_cnt=True)
    prompt = {"prompt_token_ids": list(range(3, 3 + 5 * BLOCK + 1))}  # 6 blocks, 5 of them full
    with caplog.at_level(logging.INFO, logger="hetero"):
        for _ in range(17):  # 102 prompt blocks
            llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[HIT CNT]")]
    assert lines == ["[HIT CNT] total: 102, gpu: 80 (78.43%) cpu: 0 (0.00%) not hit: 22 (21.57%)"]


def test_prefix_caching_is_on_by_default_and_flags_reach_the_config():
    assert EngineConfig(model="m").enable_prefix_caching
    assert engine_config_from_args(parse_serve_args(["serve", "m"])).enable_prefix_caching
    config = engine_config_from_args(parse_serve_args([
        "serve", "m", "--enable-prefix-cache-offload", "--apc-offload-min-access-threshold", "3",
        "--apc-offload-enable-hit-cnt", "--cpu-offload-gib", "2.5",
    ]))
    assert (config.enable_prefix_cache_offload, config.apc_offload_min_access_threshold,
            config.apc_offload_enable_hit_cnt, config.cpu_offload_gib) == (True, 3, True, 2.5)
    assert not engine_config_from_args(parse_serve_args(["serve", "m", "--no-enable-prefix-caching"])).enable_prefix_caching


@pytest.mark.parametrize("kwargs, field", [
    (dict(enable_prefix_caching=False, enable_prefix_cache_offload=True), "enable_prefix_cache_offload"),
    (dict(enable_prefix_caching=False, apc_offload_enable_hit_cnt=True), "apc_offload_enable_hit_cnt"),
    (dict(apc_offload_min_access_threshold=0), "apc_offload_min_access_threshold"),
    (dict(cpu_offload_gib=0), "cpu_offload_gib"),
    (dict(cpu_offload_gib="4"), "cpu_offload_gib"),
    (dict(enable_prefix_cache_offload="yes"), "enable_prefix_cache_offload"),
])
def test_bad_offload_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="m", **kwargs)
