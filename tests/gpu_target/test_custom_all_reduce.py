"""The one-shot all-reduce: which messages and which hosts it takes, NCCL/gloo for the rest;
on two GPUs, the same sums as NCCL, eagerly and replayed in a CUDA graph."""
from __future__ import annotations

import datetime
import multiprocessing
import threading

import pytest
import torch
import torch.distributed as dist

from gpu_target import custom_all_reduce
from gpu_target.custom_all_reduce import (ONE_SHOT_MAX_BYTES, ExchangeKeyStore, OneShotAllReduce, set_up_one_shot,
                                         unavailable_reason)
from gpu_target.tensor_parallel import TensorParallel
from hetero.core.config import EngineConfig

CUDA0 = torch.device("cuda", 0)


def test_unavailable_reasons_name_the_device_dtype_and_peer_access(monkeypatch):
    assert "not on CUDA" in unavailable_reason(torch.device("cpu"), torch.float32, 2)
    assert "float16" in unavailable_reason(CUDA0, torch.float16, 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda device, peer: (device, peer) != (0, 1))
    monkeypatch.setattr(custom_all_reduce, "_has_one_shot_operator", lambda: True)
    assert unavailable_reason(CUDA0, torch.bfloat16, 2) == "GPU 0 cannot access GPU 1 peer-to-peer"
    assert unavailable_reason(torch.device("cuda", 1), torch.bfloat16, 2) is None
    monkeypatch.setattr(custom_all_reduce, "_has_one_shot_operator", lambda: False)
    assert "one_shot_all_reduce_out" in unavailable_reason(torch.device("cuda", 1), torch.bfloat16, 2)


def test_fits_takes_decode_sized_messages_of_the_buffers_dtype_only():
    one_shot = OneShotAllReduce(torch.empty(ONE_SHOT_MAX_BYTES // 2, dtype=torch.bfloat16), "g")
    assert one_shot.fits(torch.empty(64, 4096, dtype=torch.bfloat16))  # 512 KiB
    assert one_shot.fits(torch.empty(128, 4096, dtype=torch.bfloat16))  # exactly the buffer
    assert not one_shot.fits(torch.empty(129, 4096, dtype=torch.bfloat16))  # a prefill's: NCCL
    assert not one_shot.fits(torch.empty(8, 4096, dtype=torch.float32))  # another dtype than the buffer's
    assert not one_shot.fits(torch.empty(1, 5, dtype=torch.bfloat16))  # 10 bytes: below the kernel's vector width
    assert not one_shot.fits(torch.empty(4096, 8, dtype=torch.bfloat16).t())  # not contiguous
    assert not one_shot.fits(torch.empty(0, 4096, dtype=torch.bfloat16))


class _Recorder:
    """A stand-in for the one-shot all-reduce (fits up to `limit` elements) or for a process group."""

    def __init__(self, limit: int = 0):
        self.limit = limit
        self.calls: list[int] = []

    def fits(self, x):
        return x.numel() <= self.limit

    def __call__(self, x):
        self.calls.append(x.numel())
        return x

    def allreduce(self, tensors):
        self.calls.append(tensors[0].numel())
        return self

    def wait(self):
        return True


def test_all_reduce_sends_what_fits_to_the_one_shot_and_the_rest_to_the_group():
    one_shot, group = _Recorder(limit=100), _Recorder()
    tp = TensorParallel(0, 2, group, one_shot)
    small, large = torch.ones(10), torch.ones(1000)
    assert tp.all_reduce(small) is small and tp.all_reduce(large) is large
    assert one_shot.calls == [10] and group.calls == [1000]
    nccl_only = TensorParallel(0, 2, group)
    nccl_only.all_reduce(small)
    assert group.calls == [1000, 10]


def test_set_up_needs_no_collective_where_it_is_not_wanted_or_not_on_cuda():
    """backend=None: any collective would fail; the CPU (gloo) and an unwanted one-shot take none."""
    assert set_up_one_shot(True, None, None, "g", 0, 2, torch.device("cpu"), torch.float32) is None
    assert set_up_one_shot(False, None, None, "g", 0, 2, CUDA0, torch.bfloat16) is None


@pytest.mark.parametrize("votes, rendezvous_fails, expect_one_shot", [
    ([True, True], False, True),
    ([False, False], False, False),  # another rank cannot: no rendezvous here either
    ([True, False], True, False),  # the rendezvous failed here
    ([True, False], False, False),  # ... or on another rank
])
def test_set_up_falls_back_to_nccl_unless_every_rank_has_the_one_shot(monkeypatch, votes, rendezvous_fails,
                                                                      expect_one_shot):
    cast, rendezvous_calls = [], []

    def agree(backend, device, ok):
        cast.append(ok)
        return votes[len(cast) - 1] and ok

    def rendezvous(*args):
        rendezvous_calls.append(args)
        if rendezvous_fails:
            raise RuntimeError("cuMemExportToShareableHandle failed")
        return OneShotAllReduce(torch.empty(8), "g")

    monkeypatch.setattr(custom_all_reduce, "unavailable_reason", lambda device, dtype, world_size: None)
    monkeypatch.setattr(custom_all_reduce, "_all_ranks_agree", agree)
    monkeypatch.setattr(custom_all_reduce, "_rendezvous", rendezvous)
    got = set_up_one_shot(True, object(), object(), "g", 0, 2, CUDA0, torch.bfloat16)
    assert (got is not None) == expect_one_shot
    assert len(cast) == (2 if votes[0] else 1)  # two votes, or none past a failed first
    assert len(rendezvous_calls) == (1 if votes[0] else 0)


def _all_gather(store, seq: int, rank: int, value: bytes) -> list[bytes]:
    """One exchange of two ranks as PyTorch's symmetric-memory rendezvous makes it: each rank
    writes `<prefix>/<seq>/<rank>` and reads every rank's key, with `seq` its process's count."""
    store.set(f"CUDASymmetricMemory/{seq}/{rank}", value)
    keys = [f"CUDASymmetricMemory/{seq}/{peer}" for peer in range(2)]
    store.wait(keys)
    return store.multi_get(keys)


@pytest.mark.parametrize("wrap", [True, False], ids=["renumbered", "as-is"])
def test_ranks_whose_processes_made_different_numbers_of_exchanges_still_meet(wrap):
    """Rank 0 in a process that already made 7 exchanges (an earlier engine's), rank 1 in a fresh
    one: their two exchanges meet only when each group counts from its own first. Unwrapped, the
    ranks wait on different keys until the store times out."""
    base = dist.HashStore()
    base.set_timeout(datetime.timedelta(seconds=2))
    first_seq = {0: 7, 1: 0}
    results, errors = {}, []

    def rank(r):
        store = dist.PrefixStore("symm_mem/g/", base)
        store = ExchangeKeyStore(store) if wrap else store
        try:
            results[r] = [_all_gather(store, first_seq[r] + i, r, f"{r}:{i}".encode()) for i in range(2)]
        except RuntimeError as error:  # the store's timeout
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if not wrap:
        assert errors
        return
    assert not errors
    expected = [[b"0:0", b"1:0"], [b"0:1", b"1:1"]]
    assert results == {0: expected, 1: expected}
    assert ExchangeKeyStore(base).key("phase/rank0") == "phase/rank0"  # other keys pass through


def test_disable_custom_all_reduce_is_a_checked_bool():
    assert EngineConfig(model="m").disable_custom_all_reduce is False  # vLLM's default: the one-shot where it can
    assert EngineConfig(model="m", disable_custom_all_reduce=True).disable_custom_all_reduce is True
    with pytest.raises(ValueError, match="disable_custom_all_reduce"):
        EngineConfig(model="m", disable_custom_all_reduce="no")


def _sum_on_rank(rank: int, port: int, group_name: str, results) -> None:
    """One rank: the one-shot against NCCL on the same tensors, eagerly and in a CUDA graph."""
    from gpu_target.tp_worker import make_group, make_store

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = make_store(rank, 2, port)
    group = make_group("nccl", store, rank, 2)
    checks = {}
    for dtype in (torch.bfloat16, torch.float32):
        one_shot = set_up_one_shot(True, group, store, f"{group_name}-{dtype}", rank, 2, device, dtype)
        checks[f"{dtype} set up"] = one_shot is not None
        if one_shot is None:
            continue
        generator = torch.Generator(device=device).manual_seed(rank)
        for rows in (1, 8, 64):
            x = torch.randn(rows, 4096, generator=generator, device=device).to(dtype)
            expected = x.clone()
            group.allreduce([expected]).wait()
            checks[f"{dtype} {rows} eager"] = torch.equal(one_shot(x.clone()), expected)
            staged = torch.zeros_like(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                one_shot(staged)
            staged.copy_(x)
            graph.replay()
            checks[f"{dtype} {rows} graph"] = torch.equal(staged, expected)
    torch.cuda.synchronize()
    results.put((rank, checks))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_one_shot_sums_as_nccl_on_two_gpus():
    """Two ranks: a + b in either order is the same float, so the sums must be bit-identical."""
    from gpu_target.tp_worker import free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_sum_on_rank, args=(rank, port, f"test-one-shot-{port}", results), daemon=True)
                 for rank in range(2)]
    for process in processes:
        process.start()
    try:
        reports = dict(results.get(timeout=240) for _ in processes)
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    for rank, checks in sorted(reports.items()):
        assert checks and all(checks.values()), (rank, checks)
