"""The one-shot all-reduce over NVLink peer-to-peer memory (vLLM's custom all-reduce), NCCL the fallback.

A decode step's all-reduces are small (a [batch, hidden] partial sum), and NCCL spends more of
their time on its protocol than on moving bytes. vLLM's custom all-reduce (and its
SymmMemCommunicator) gives every rank a buffer the other GPUs can read over NVLink: each rank
copies its partial sum into its own buffer, then one kernel per rank reads every rank's buffer
and sums them (one shot: no ring, no reduce-scatter and all-gather phases), between two barriers
on signal pads. Here the kernel is PyTorch's own, ``torch.ops.symm_mem.one_shot_all_reduce_out``
over torch.distributed._symmetric_memory (its CUDA backend; docs.pytorch.org "PyTorch Symmetric
Memory"). It needs no NVLink multicast (the ``multimem_*`` operators do; they stay unused), and it
is graph-capturable: the buffer and the peers' addresses are fixed once at start-up.

Which path a message takes depends only on its dtype, size and layout, the same on every rank,
so the ranks always pair the same collectives. NCCL takes what the kernel cannot: dtypes other
than bfloat16 and float32, more bytes than the buffer, sizes not a multiple of 16 bytes; and
everything where the one-shot path could not be set up on every rank (the CPU and gloo, no
peer-to-peer access, a PyTorch without the operator), which the ranks agree on by a vote.

The kernel waits for its peers at its barriers (a compare-and-swap loop on the signal pads,
with no timeout or abort flag, unlike NCCL's kernels), so a rank that dies mid-step leaves the
others' kernels spinning until their processes end. Releasing them by writing the dead rank's
signals from another stream is not sound: nothing guarantees such a kernel a place beside the
spinning ones, each later all-reduce of the step would need the same, and the step's outputs
are garbage anyway. So the tensor-parallel watchdog ends the engine's process when rank 0's
device stays stuck after a death (gpu_target/tp_worker.Watchdog).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("hetero")

ONE_SHOT_MAX_BYTES = 1 << 20  # decode-sized messages; a prefill's larger ones go to NCCL
_ALIGNMENT = 16  # the kernel's vector width; smaller multiples fall back rather than run narrower
_DTYPES = (torch.bfloat16, torch.float32)


def unavailable_reason(device: torch.device, dtype: torch.dtype, world_size: int) -> Optional[str]:
    """Why this rank cannot use the one-shot all-reduce; None when it can."""
    if device.type != "cuda":
        return "the ranks are not on CUDA"
    if dtype not in _DTYPES:
        return f"dtype {dtype} (the kernel sums bfloat16 and float32)"
    if not _has_one_shot_operator():
        return f"PyTorch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce_out"
    for peer in range(world_size):
        if peer != device.index and not torch.cuda.can_device_access_peer(device.index, peer):
            return f"GPU {device.index} cannot access GPU {peer} peer-to-peer"
    return None


def _has_one_shot_operator() -> bool:
    return hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out")


class OneShotAllReduce:
    """One rank's symmetric buffer and the one-shot kernel over it."""

    def __init__(self, buffer: torch.Tensor, group_name: str, store: Optional[dist.Store] = None):
        self.buffer = buffer
        self.group_name = group_name
        self.store = store  # the rendezvous's store: a Python object that the group's C++ side does not keep alive

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through the one-shot kernel (else NCCL); the same answer on every rank."""
        nbytes = x.numel() * x.element_size()
        return (x.dtype == self.buffer.dtype and x.is_contiguous() and nbytes % _ALIGNMENT == 0
                and 0 < nbytes <= self.buffer.numel() * self.buffer.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        staged = self.buffer[: x.numel()].view_as(x)
        staged.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x)

    def close(self) -> None:
        """Drop the group registered for the kernel under `group_name` (it holds the rank's NCCL
        backend); the engine's teardown then releases that backend."""
        from torch._C._distributed_c10d import _unregister_process_group

        _unregister_process_group(self.group_name)


def set_up_one_shot(wanted: bool, backend, store, group_name: str, rank: int, world_size: int,
                    device: torch.device, dtype: torch.dtype,
                    max_bytes: int = ONE_SHOT_MAX_BYTES) -> Optional[OneShotAllReduce]:
    """The rank's one-shot all-reduce, or None for NCCL everywhere. A collective on CUDA: every
    rank calls it at the same point with the same arguments but `rank`. `backend`: the ranks'
    ProcessGroupNCCL; `store`: the store it was made from."""
    if not wanted or world_size == 1 or device.type != "cuda":
        return None
    reason = unavailable_reason(device, dtype, world_size)
    one_shot = None
    # Vote before the rendezvous too: a rank that skipped it would leave the others waiting in it.
    # Every rank sees the same vote, so all take the same branch.
    if _all_ranks_agree(backend, device, reason is None):
        try:
            one_shot = _rendezvous(backend, store, group_name, rank, world_size, device, dtype, max_bytes)
        except (RuntimeError, AttributeError, TypeError) as error:  # also an API this PyTorch spells otherwise
            reason = f"setting up symmetric memory failed: {error!r}"
        if _all_ranks_agree(backend, device, one_shot is not None):
            return one_shot
    if rank == 0 or reason is not None:
        logger.warning("one-shot all-reduce unavailable on rank %d (%s); all-reduces use NCCL", rank,
                       reason or "another rank could not set it up")
    return None


def _all_ranks_agree(backend, device: torch.device, ok: bool) -> bool:
    """Whether `ok` holds on every rank (a MIN all-reduce over NCCL)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    backend.allreduce([flag], options).wait()
    return bool(flag.item())


def _rendezvous(backend, store, group_name: str, rank: int, world_size: int, device: torch.device,
                dtype: torch.dtype, max_bytes: int) -> OneShotAllReduce:
    """Allocate the symmetric buffer and map the peers' buffers (exchanged through `store`).

    The ranks' group lives outside torch.distributed's global state, so it is registered under
    `group_name` both ways PyTorch's releases look a group up for symmetric memory: as a process
    group (`resolve_process_group`) and as group info (`set_group_info`, older releases)."""
    from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory
    from torch.distributed import _symmetric_memory as symm_mem

    # The one-shot kernel reads peers' buffers directly: no multicast object is needed, so none is
    # made (a host's administrator may have turned multicast off already; this keeps it so).
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    prefixed = ExchangeKeyStore(dist.PrefixStore(f"symm_mem/{group_name}/", store))
    group = dist.ProcessGroup(prefixed, rank, world_size)
    group._register_backend(device, dist.ProcessGroup.BackendType.NCCL, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    group._set_group_name(group_name)
    _register_process_group(group_name, group)
    set_group_info = getattr(_SymmetricMemory, "set_group_info", None)
    if set_group_info is not None:
        set_group_info(group_name, rank, world_size, prefixed)
    buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
    symm_mem.rendezvous(buffer, group_name)
    return OneShotAllReduce(buffer, group_name, prefixed)


_EXCHANGE_KEY = re.compile(r"(?P<prefix>.*)/(?P<seq>\d+)/(?P<rank>\d+)")


class ExchangeKeyStore(dist.Store):
    """A group's store for PyTorch's symmetric-memory rendezvous, with each exchange numbered from
    the group's first.

    The rendezvous exchanges through keys `<prefix>/<seq>/<rank>`, where `seq` counts the exchanges
    this process has made so far, in any group (PyTorch's CUDA backend keeps one counter per
    process). An engine's rank 0 lives in the engine's process, its other ranks in fresh ones: for
    a second engine in that process, rank 0's count runs ahead of its new peers', and each side
    would wait forever for keys the other never writes. Counting from the first exchange this
    group sees gives every rank the same keys. Other keys pass through unchanged."""

    def __init__(self, store: dist.Store):
        super().__init__()
        self._store = store
        self._first_seq: dict[str, int] = {}

    def key(self, key: str) -> str:
        """The key `key` is stored under."""
        match = _EXCHANGE_KEY.fullmatch(key)
        if match is None:
            return key
        seq = int(match["seq"])
        first = self._first_seq.setdefault(match["prefix"], seq)
        return f"{match['prefix']}/{seq - first}/{match['rank']}"

    def set(self, key, value):
        self._store.set(self.key(key), value)

    def get(self, key):
        return self._store.get(self.key(key))

    def add(self, key, value):
        return self._store.add(self.key(key), value)

    def append(self, key, value):
        self._store.append(self.key(key), value)

    def compare_set(self, key, expected, desired):
        return self._store.compare_set(self.key(key), expected, desired)

    def delete_key(self, key):
        return self._store.delete_key(self.key(key))

    def check(self, keys):
        return self._store.check([self.key(key) for key in keys])

    def multi_get(self, keys):
        return self._store.multi_get([self.key(key) for key in keys])

    def multi_set(self, keys, values):
        self._store.multi_set([self.key(key) for key in keys], values)

    def wait(self, keys, timeout=None):
        keys = [self.key(key) for key in keys]
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def num_keys(self):
        return self._store.num_keys()

    def has_extended_api(self):
        return True
