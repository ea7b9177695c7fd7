"""What `hetero serve` tells its operator at start-up: the memory it took, and an open door.

The KV cache is sized by `num_gpu_blocks_override` or `kv_cache_memory_bytes` when given, else by
`gpu_memory_utilization` on CUDA and by `kv_cache_space` (vLLM's VLLM_CPU_KVCACHE_SPACE, default
4 GiB) on the CPU, where it is also capped at what `max_num_seqs` sequences of `max_model_len`
tokens can use; the log line names which one decided, so an operator knows which flag to turn.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Optional

from gpu_target.kv_cache import KVCachePool
from gpu_target.runner import CPU_DEFAULT_KV_GIB
from hetero.engine import LLMEngine

logger = logging.getLogger("hetero.server")


def kv_cache_source(engine: LLMEngine) -> str:
    """Which setting decided the KV cache's size (in `num_kv_blocks`' order)."""
    config = engine.config
    if config.num_gpu_blocks_override is not None:
        return f"--num-gpu-blocks-override {config.num_gpu_blocks_override}"
    if config.kv_cache_memory_bytes is not None:
        return f"--kv-cache-memory-bytes {config.kv_cache_memory_bytes}"
    if engine.device.type == "cuda":
        return f"--gpu-memory-utilization {config.gpu_memory_utilization}"
    blocks_per_seq = -(-engine.max_model_len // config.block_size)
    space = f"--kv-cache-space {config.kv_cache_space:g} GiB" if config.kv_cache_space else (
        f"--kv-cache-space's default {CPU_DEFAULT_KV_GIB:g} GiB")
    if engine.scheduler.allocator.num_blocks == config.max_num_seqs * blocks_per_seq + 1:
        return f"--max-num-seqs {config.max_num_seqs} x --max-model-len {engine.max_model_len} (less than {space})"
    return space


def engine_summary(engine: LLMEngine) -> str:
    allocator = engine.scheduler.allocator
    block_bytes = KVCachePool.bytes_per_block(engine.model_config, engine.config.block_size, engine.dtype)
    kv_bytes = allocator.num_blocks * block_bytes
    size = f"{kv_bytes / 2**30:.2f} GiB" if kv_bytes >= 2**30 else f"{kv_bytes / 2**20:.1f} MiB"
    tokens = allocator.num_blocks * allocator.block_size
    return (
        f"serving on {engine.device} in {str(engine.dtype).removeprefix('torch.')}; KV cache {size} "
        f"({tokens} tokens), sized by {kv_cache_source(engine)}; max_model_len {engine.max_model_len}, "
        f"max_num_seqs {engine.config.max_num_seqs}"
    )


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) only listens on the loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def log_startup(engine: LLMEngine, host: str, api_key: Optional[str]) -> None:
    logger.info("%s", engine_summary(engine))
    if not api_key and not is_loopback(host):
        logger.warning(
            "serving on %s without --api-key: anyone who can reach this port can run requests; "
            "set --api-key (or $HETERO_API_KEY), or --host 127.0.0.1", host,
        )
