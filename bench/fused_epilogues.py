"""The fused epilogues of the streaming kernels against their kernels apart (GPU).

On Llama-3-8B's shapes, for each format (bf16, fp8, int4) and row count M (1: the GEMV, 2-64:
the skinny GEMM), times gpu_target/gemv.py's
  qkv      `gemv_rotary_and_store_kv` / `skinny_gemm_rotary_and_store_kv` (6144 x 4096, 32
           query and 8 KV heads of 128) against the projection followed by
           `fused_ops.rotary_and_store_kv` (what the model runs where `rotary_fits` says no);
  gate_up  `gemv_silu_and_mul` / `skinny_gemm_silu_and_mul` (28672 x 4096) against the
           projection followed by `fused_ops.silu_and_mul`;
each at the table's tile and with K whole (split_k 1), every call reading another copy of
the weights (bench.gemv's method: copies past L2, in one CUDA graph).

    python -m bench.fused_epilogues --out bench/results [--rows 1,16,64] [--formats fp8,int4,bf16] [--epilogues qkv,gate_up]
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

K, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336
SHAPES = {"qkv": (HEADS + 2 * KV_HEADS) * HEAD_DIM, "gate_up": 2 * INTER}


def projection(x: torch.Tensor, weight, **tile) -> torch.Tensor:
    """The unfused kernel the model streams this weight with at x's rows."""
    return gemv.gemv(x, weight, **tile) if x.shape[0] == 1 else gemv.skinny_gemm(x, weight, **tile)


def calls(epilogue: str, m: int, x: torch.Tensor) -> tuple:
    """(apart, fused): each a function of (weight, tile)."""
    if epilogue == "gate_up":
        fused_kernel = gemv.gemv_silu_and_mul if m == 1 else gemv.skinny_gemm_silu_and_mul
        return (lambda w, tile: fused_ops.silu_and_mul(projection(x, w, **tile)),
                lambda w, tile: fused_kernel(x, w, **tile))
    cos, sin = (torch.randn(4096, HEAD_DIM // 2, device="cuda") for _ in range(2))
    caches = [torch.zeros(512, 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    positions, slots = torch.arange(m, device="cuda") + 100, torch.arange(m, device="cuda")
    fused_kernel = gemv.gemv_rotary_and_store_kv if m == 1 else gemv.skinny_gemm_rotary_and_store_kv

    def apart(w, tile: dict) -> torch.Tensor:
        q, k, v = projection(x, w, **tile).view(m, -1, HEAD_DIM).split([HEADS, KV_HEADS, KV_HEADS], 1)
        return fused_ops.rotary_and_store_kv(q, k, v, cos, sin, positions, *caches, slots)

    return apart, lambda w, tile: fused_kernel(x, w, None, cos, sin, positions, *caches, slots, HEADS, **tile)


def time_shape(epilogue: str, fmt: str, m: int, rows: list[dict]) -> None:
    source = torch.randn(SHAPES[epilogue], K, device="cuda", dtype=torch.bfloat16) * 0.02
    one = source if fmt == "bf16" else quantize(source, fmt)
    weights = [one] + [one.clone() if fmt == "bf16" else quantize(source, fmt) for _ in range(max(1, int(2e9 // one.nbytes)))]
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    apart, fused = calls(epilogue, m, x)
    table = gemv.streaming_tile(weights[0], m)
    tiles = [("table", table)] + ([("split_k 1", dict(table, split_k=1))] if table.get("split_k", 1) > 1 else [])
    for label, tile in tiles:
        apart_us = time_per_call_us(lambda i: apart(weights[i], tile), len(weights), 5)
        fused_us = time_per_call_us(lambda i: fused(weights[i], tile), len(weights), 5)
        rows.append(dict(epilogue=epilogue, format=fmt, m=m, tile=label, split_k=tile.get("split_k", 1),
                         apart_us=round(apart_us, 2), fused_us=round(fused_us, 2),
                         fused_over_apart=round(fused_us / apart_us, 2),
                         rotary_fits=gemv.rotary_fits(m, weights[0], HEAD_DIM) if epilogue == "qkv" else ""))
        print(rows[-1], flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--formats", default="fp8,int4,bf16")
    parser.add_argument("--epilogues", default="qkv,gate_up")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows: list[dict] = []
    for epilogue in args.epilogues.split(","):
        for fmt in args.formats.split(","):
            for m in (int(v) for v in args.rows.split(",")):
                time_shape(epilogue, fmt, m, rows)
    command = "python -m bench.fused_epilogues " + " ".join(argv if argv is not None else sys.argv[1:])
    body = ["## Llama-3-8B qkv + rotary + KV store and gate_up + SiLU-and-mul: fused against the kernels apart", "",
            *markdown_table(rows), ""]
    print(write_markdown_and_json(f"{args.out}/fused_epilogues-{time.strftime('%Y%m%d-%H%M%S')}",
                                  "the streaming kernels' fused epilogues against the kernels apart", command,
                                  dict(describe_machine(), gpu=torch.cuda.get_device_name()), rows, body))


if __name__ == "__main__":
    main()
