"""Megatron-style tensor parallelism: which slice of each weight a rank holds, and the collectives.

Shoeybi et al., "Megatron-LM" (arXiv:1909.08053), section 3: q/k/v and gate/up are split by
output rows (column-parallel: each rank computes its own heads and its own slice of the MLP),
o_proj and down_proj by input columns (row-parallel: each rank's product is a partial sum,
all-reduced into the residual stream). Embedding and LM head are split by vocabulary rows:
a rank looks up only its own tokens (the others' rows are zeros, summed by an all-reduce) and
computes only its own logits (gathered along the vocabulary). KV heads are split like the
query heads; with fewer KV heads than ranks, each rank keeps the one KV head its query heads
read (vLLM's replication rule).

A rank's decoder layers are built from `local_config`: the same `ModelConfig` with its own
head and MLP counts, so attention, the paged KV cache, and CUDA graphs need no change.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from gpu_target.model_config import ModelConfig

SUPPORTED_SIZES = (1, 2, 4, 8)


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """Raise ValueError naming the model dimension that `world_size` ranks cannot split evenly."""
    if config.num_heads % world_size:
        raise ValueError(
            f"tensor_parallel_size={world_size} does not divide the model's {config.num_heads} attention heads"
        )
    kv = config.num_kv_heads
    if kv % world_size and world_size % kv:
        raise ValueError(
            f"tensor_parallel_size={world_size} and the model's {kv} KV heads: one must divide the other"
        )
    if config.intermediate_size % world_size:
        raise ValueError(
            f"tensor_parallel_size={world_size} does not divide the model's MLP size {config.intermediate_size}"
        )


def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config one rank's decoder layers are built from: its heads, KV heads and MLP slice."""
    if world_size == 1:
        return config
    check_divisible(config, world_size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=max(1, config.num_kv_heads // world_size),
        intermediate_size=config.intermediate_size // world_size,
    )


def local_vocab_size(vocab_size: int, world_size: int) -> int:
    """Rows of embedding and LM head per rank; the last rank's tail past the vocabulary is padding."""
    return -(-vocab_size // world_size)


@dataclass(frozen=True)
class Shard:
    """Which rank of how many; `slice_of` says what part of an HF-named weight it holds."""

    rank: int = 0
    world_size: int = 1

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        rows = local_vocab_size(vocab_size, self.world_size)
        return min(self.rank * rows, vocab_size), min((self.rank + 1) * rows, vocab_size)

    def kv_head_range(self, config: ModelConfig) -> tuple[int, int]:
        """The KV heads this rank's query heads read (one, shared with other ranks, when fewer KV heads than ranks)."""
        kv, world = config.num_kv_heads, self.world_size
        if kv >= world:
            per_rank = kv // world
            return self.rank * per_rank, (self.rank + 1) * per_rank
        head = self.rank // (world // kv)
        return head, head + 1

    def slice_of(self, name: str, config: ModelConfig) -> Optional[tuple[int, int, int]]:
        """(dim, start, stop) of the HF weight `name` this rank holds; None: the whole tensor (norms)."""
        if self.world_size == 1 or name.endswith("norm.weight") or name.startswith("model.rope"):
            return None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (0, *self.vocab_range(config.vocab_size))
        hd = config.head_dim
        q_rows = config.q_size // self.world_size
        i_rows = config.intermediate_size // self.world_size
        if ".q_proj." in name:
            return 0, self.rank * q_rows, (self.rank + 1) * q_rows
        if ".k_proj." in name or ".v_proj." in name:
            first, last = self.kv_head_range(config)
            return 0, first * hd, last * hd
        if name.endswith("o_proj.weight"):
            return 1, self.rank * q_rows, (self.rank + 1) * q_rows
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return 0, self.rank * i_rows, (self.rank + 1) * i_rows
        if name.endswith("down_proj.weight"):
            return 1, self.rank * i_rows, (self.rank + 1) * i_rows
        raise ValueError(f"no tensor-parallel split is defined for weight {name!r}")

    def shape_of(self, name: str, shape: tuple[int, ...], config: ModelConfig) -> tuple[int, ...]:
        part = self.slice_of(name, config)
        if part is None:
            return shape
        dim, start, stop = part
        return shape[:dim] + (stop - start,) + shape[dim + 1:]

    def take(self, name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """This rank's part of a whole tensor (a copy, so the whole one can be freed)."""
        part = self.slice_of(name, config)
        if part is None:
            return tensor
        dim, start, stop = part
        return tensor.narrow(dim, start, stop - start).clone()


@dataclass(frozen=True)
class TensorParallel(Shard):
    """A `Shard` with the process group its collectives run over (torch.distributed's
    ProcessGroupNCCL on CUDA, ProcessGroupGloo on the CPU) and, where set up, the one-shot
    all-reduce that takes the messages it fits (gpu_target/custom_all_reduce.py). World size 1
    makes every collective the identity, so the one-GPU model pays nothing."""

    group: Any = field(default=None, compare=False, repr=False)
    one_shot: Any = field(default=None, compare=False, repr=False)  # a custom_all_reduce.OneShotAllReduce

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (the row-parallel projections' partial sums)."""
        if self.world_size > 1:
            if self.one_shot is not None and self.one_shot.fits(x):
                return self.one_shot(x)
            self.group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n] on every rank -> [rows, world * n], rank by rank along the last dimension."""
        if self.world_size == 1:
            return x
        rows, n = x.shape
        gathered = torch.empty((self.world_size * rows, n), dtype=x.dtype, device=x.device)
        self.group._allgather_base(gathered, x.contiguous()).wait()
        return gathered.view(self.world_size, rows, n).transpose(0, 1).reshape(rows, self.world_size * n)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (tokens picked by the coordinator between decode steps)."""
        if self.world_size > 1:
            self.group.broadcast(x, 0).wait()
        return x


SINGLE = TensorParallel()
