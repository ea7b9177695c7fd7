"""Building one rank's target: its shard of the weights, its KV cache, attention, CUDA graphs.

The engine builds rank 0 in its own process and each tensor-parallel worker builds its rank
(gpu_target/tp_worker.py) from the same `TargetSpec`, through these same functions, so every
rank's runner takes the same steps (graph buckets, kernels) and so issues the same collectives
in the same order. With one rank this is simply how the engine builds its target.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from gpu_target.kv_cache import KVCachePool
from gpu_target.loader import load_state_dict, random_state_dict
from gpu_target.model import CausalLM, build_model
from gpu_target.model_config import ModelConfig
from gpu_target.runner import ModelRunner
from gpu_target.tensor_parallel import TensorParallel, local_config

logger = logging.getLogger("hetero")


@dataclass(frozen=True)
class TargetSpec:
    """What every rank needs to build its part of the target (picklable: sent to the workers)."""

    model_path: str
    model_config: ModelConfig
    dtype: torch.dtype
    device_type: str  # "cpu" or "cuda"; rank r of a tensor-parallel group takes cuda:r
    real_weights: bool
    seed: int
    quantization: Optional[str]
    batch_invariant: bool
    block_size: int
    enforce_eager: bool
    custom_all_reduce: bool = False  # the one-shot all-reduce where it fits (gpu_target/custom_all_reduce.py)


@dataclass(frozen=True)
class CacheShape:
    """The KV cache and CUDA-graph sizes the coordinator settles once rank 0's weights are in."""

    num_blocks: int  # including the CUDA-graph padding's null block
    max_num_seqs: int
    max_query_len: int
    max_model_len: int
    max_step_tokens: int


def rank_device(spec: TargetSpec, tp: TensorParallel) -> torch.device:
    return torch.device("cuda", tp.rank) if spec.device_type == "cuda" else torch.device("cpu")


def load_model(spec: TargetSpec, tp: TensorParallel, device: torch.device) -> CausalLM:
    """This rank's shard of the model, read from the checkpoint (or random, load_format="dummy")."""
    config = spec.model_config
    if spec.real_weights:
        state = load_state_dict(spec.model_path, config, spec.dtype, device, spec.quantization, shard=tp)
    else:
        state = random_state_dict(config, spec.dtype, device, spec.seed, spec.quantization, shard=tp)
    model = build_model(config, state, spec.dtype, device, tp)
    if spec.batch_invariant and device.type == "cuda":
        from gpu_target.batch_invariant_gpu import make_batch_invariant_gpu

        make_batch_invariant_gpu(model)
    elif spec.batch_invariant:
        from gpu_target.batch_invariant import make_batch_invariant

        make_batch_invariant(model)
    return model


def make_kv_pool(spec: TargetSpec, tp: TensorParallel, num_blocks: int, device: torch.device) -> KVCachePool:
    """The rank's paged KV cache: `num_blocks` blocks (the same on every rank) of its own KV heads."""
    return KVCachePool(local_config(spec.model_config, tp.world_size), num_blocks, spec.block_size, spec.dtype, device)


def build_runner(spec: TargetSpec, model: CausalLM, kv_pool: KVCachePool, tp: TensorParallel, shape: CacheShape,
                 report: Callable[[str], None] = lambda phase: None) -> ModelRunner:
    """The rank's runner: attention function and (on CUDA, unless enforce_eager) captured graphs around `model`;
    `report` is told each phase as it starts (the tensor-parallel watchdog's progress)."""
    device = kv_pool.storage.device
    report("compiling attention kernels")
    attention_fn = _attention_fn(spec, local_config(spec.model_config, tp.world_size), kv_pool)
    graph_runner = None
    if device.type == "cuda" and not spec.enforce_eager:
        from gpu_target.cuda_graphs import CudaGraphRunner

        graph_runner = CudaGraphRunner(model, kv_pool, shape.max_num_seqs, shape.max_query_len, shape.max_model_len,
                                       max_step_tokens=shape.max_step_tokens, attention_fn=attention_fn)
        seconds = graph_runner.capture_all(report)
        logger.info("CUDA graph capture took %.1f s for %d buckets (rank %d)", seconds, len(graph_runner.graphs), tp.rank)
    return ModelRunner(model, kv_pool, device, attention_fn, graph_runner)


def _attention_fn(spec: TargetSpec, layer_config: ModelConfig, kv_pool: KVCachePool):
    """The attention the model runs with; on CUDA, its kernel variants are compiled here, at start-up."""
    if spec.batch_invariant and kv_pool.storage.device.type == "cuda":
        from gpu_target.invariant_attention import invariant_paged_attention

        return invariant_paged_attention
    if spec.batch_invariant:
        from gpu_target.batch_invariant import batch_invariant_attention

        return batch_invariant_attention
    if kv_pool.storage.device.type == "cuda":
        from gpu_target.triton_attention import compile_variants, paged_attention

        k_cache, v_cache = kv_pool.layers[0]
        compile_variants(spec.dtype, layer_config.num_heads, k_cache, v_cache)
        return paged_attention
    from gpu_target.attention import reference_attention

    return reference_attention
