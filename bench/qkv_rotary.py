"""The qkv projection with its rotary embedding and KV store, fused or apart (GPU).

On Llama-3-8B's qkv shape (6144 x 4096, 32 query and 8 KV heads of 128) for each format
(bf16, int4) and row count M, times gpu_target/gemv.py's fused
`skinny_gemm_rotary_and_store_kv` against `skinny_gemm` followed by
`fused_ops.rotary_and_store_kv` (what the model runs where `rotary_fits` says no), each at
the table's tile and with K whole (split_k 1), every call reading another copy of the
weights (bench.gemv's method: copies past L2, in one CUDA graph).

    python -m bench.qkv_rotary --out bench/results [--rows 16,64] [--formats int4,bf16]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from bench.gemv import time_per_call_us
from gpu_target import fused_ops, gemv
from gpu_target.quantization import quantize

N, K, HEADS, KV_HEADS, HEAD_DIM = 6144, 4096, 32, 8, 128


def time_shape(fmt: str, m: int, rows: list[dict]) -> None:
    source = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    one = source if fmt == "bf16" else quantize(source, fmt)
    weights = [one] + [one.clone() if fmt == "bf16" else quantize(source, fmt) for _ in range(max(1, int(2e9 // one.nbytes)))]
    cos, sin = (torch.randn(4096, HEAD_DIM // 2, device="cuda") for _ in range(2))
    caches = [torch.zeros(512, 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    positions, slots = torch.arange(m, device="cuda") + 100, torch.arange(m, device="cuda")
    table = gemv.streaming_tile(weights[0], m)

    def apart(i: int, tile: dict) -> torch.Tensor:
        q, k, v = gemv.skinny_gemm(x, weights[i], **tile).view(m, -1, HEAD_DIM).split([HEADS, KV_HEADS, KV_HEADS], 1)
        return fused_ops.rotary_and_store_kv(q, k, v, cos, sin, positions, *caches, slots)

    def fused(i: int, tile: dict) -> torch.Tensor:
        return gemv.skinny_gemm_rotary_and_store_kv(x, weights[i], None, cos, sin, positions, *caches, slots, HEADS, **tile)

    for label, tile in (("table", table), ("split_k 1", dict(table, split_k=1))):
        apart_us = time_per_call_us(lambda i: apart(i, tile), len(weights), 5)
        fused_us = time_per_call_us(lambda i: fused(i, tile), len(weights), 5)
        rows.append(dict(format=fmt, m=m, tile=label, split_k=tile.get("split_k", 1), apart_us=round(apart_us, 2),
                         fused_us=round(fused_us, 2), fused_over_apart=round(fused_us / apart_us, 2),
                         rotary_fits=gemv.rotary_fits(m, weights[0], HEAD_DIM) if label == "table" else ""))
        print(rows[-1], flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--rows", default="16,64")
    parser.add_argument("--formats", default="int4,bf16")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows: list[dict] = []
    for fmt in args.formats.split(","):
        for m in (int(v) for v in args.rows.split(",")):
            time_shape(fmt, m, rows)
    command = "python -m bench.qkv_rotary " + " ".join(argv if argv is not None else sys.argv[1:])
    body = ["## Llama-3-8B qkv (6144 x 4096): fused qkv + rotary + KV store vs the skinny GEMM and the rotary kernel apart",
            "", *markdown_table(rows), ""]
    print(write_markdown_and_json(f"{args.out}/qkv_rotary-{time.strftime('%Y%m%d-%H%M%S')}",
                                  "qkv projection and rotary embedding, fused or apart", command,
                                  dict(describe_machine(), gpu=torch.cuda.get_device_name()), rows, body))


if __name__ == "__main__":
    main()
