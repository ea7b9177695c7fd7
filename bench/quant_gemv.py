"""Quantised weight-only kernels on Llama-3-8B's projections, against bf16's at the same rows.

For each projection, format (fp8, int4) and row count M in ``--rows`` (1: the quantised
GEMV, 2..64: the quantised skinny GEMM, 65+: W8A8 `torch._scaled_mm` for fp8, dequantise +
cuBLAS for int4) times `QuantizedLinear` and hetero's bf16 `gemv.linear`, each call reading
another copy of the weights (bench.gemv's method: copies past L2, in one CUDA graph), and
reports microseconds, TB/s of the bytes streamed (quantised weights + scales) and the
speed-up over bf16. ``--sweep`` also times gpu_target/gemv_tiles.py's candidate tiles per
shape and format at M = 1 (GEMV) and M = 17 (skinny, BLOCK_M 32), lists the three fastest,
and with ``--write-tiles`` writes the fastest into gpu_target/gemv_tiles.json, the table
the kernels then read (BLOCK_M 16 and 64 take the M = 17 winner's tile, with the
heuristic's pipeline depth at 64). ``--shapes 8b,70b`` adds Llama-3-70B's projections.

    python -m bench.quant_gemv --out bench/results [--rows 1,17,64,65] [--sweep [--write-tiles]] [--shapes 8b,70b]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import torch.nn.functional as F

from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from bench.gemv import SHAPES, SKINNY_SWEEP_ROWS, fastest, skinny_tile_fits, tile_label, time_per_call_us
from gpu_target import gemv_tiles
from gpu_target.gemv import MAX_STREAMING_ROWS, gemv, linear, skinny_gemm, streaming_tile
from gpu_target.quantization import quantize
from gpu_target.quantization.linear import QuantizedLinear

try:
    from triton.runtime.errors import OutOfResources
except ImportError:
    OutOfResources = RuntimeError

FORMATS = ("fp8", "int4")
SHAPES_70B = dict(qkv_proj=(10240, 8192), o_proj=(8192, 8192), gate_up_proj=(57344, 8192), down_proj=(8192, 28672))


def layer_of(weight) -> QuantizedLinear:
    layer = QuantizedLinear(weight.shape[1], weight.shape[0], bias=False)
    layer.load_weight(weight)
    return layer


def bench_shape(name: str, n: int, k: int, row_counts: list[int], sweep: bool, rows: list[dict], best: list[dict]) -> None:
    source = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    bf16_copies = max(2, int(2e9 // (n * k * 2)))
    bf16 = [source.clone() for _ in range(bf16_copies)]
    for fmt in FORMATS:
        quantized = quantize(source, fmt)
        copies = max(2, int(2e9 // quantized.nbytes))
        layers = [layer_of(quantize(source, fmt)) for _ in range(copies)]
        gigabytes = quantized.nbytes / 1e9
        reference = quantized.dequantize(torch.bfloat16)
        for m in row_counts:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16_us = time_per_call_us(lambda i: linear(x, bf16[i]), bf16_copies)
            us = time_per_call_us(lambda i: layers[i](x), copies)
            error = (layers[0](x).float() - F.linear(x, reference).float()).abs().max() / F.linear(x, reference).float().abs().max()
            tile = tile_label(streaming_tile(quantized, m)) if m <= MAX_STREAMING_ROWS else "scaled_mm / dequantise"
            rows.append(dict(shape=name, format=fmt, m=m, tile=tile, us=round(us, 2), TBps=round(gigabytes / us * 1e3, 2),
                             bf16_us=round(bf16_us, 2), speedup_vs_bf16=round(bf16_us / us, 3), max_rel_err=f"{error.item():.1e}"))
            print(rows[-1], flush=True)
        if sweep:
            sweeps = [(1, gemv_tiles.GEMV_CANDIDATES, gemv)]
            sweeps += [(m, gemv_tiles.SKINNY_CANDIDATES, skinny_gemm) for m in SKINNY_SWEEP_ROWS]
            for m, candidates, kernel in sweeps:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                swept, seen = [], set()
                for candidate in candidates:
                    tile = streaming_tile(quantized, m, **candidate)  # 4-bit K tiles cut to the group size
                    label = tile_label(tile)
                    if label in seen or (m > 1 and not skinny_tile_fits(m, tile)):
                        continue
                    seen.add(label)
                    try:
                        us = time_per_call_us(lambda i, t=tile: kernel(x, layers[i].quantized, **t), copies, 5)
                    except OutOfResources as error:
                        print(f"skip {name} {fmt} m={m} {tile}: {error}", flush=True)
                        continue
                    swept.append(dict(shape=name, format=fmt, n=n, k=k, m=m, tile=label, tile_dict=tile, us=round(us, 2),
                                      TBps=round(gigabytes / us * 1e3, 2)))
                    print(swept[-1], flush=True)
                best += fastest([dict(r, hetero_us=r["us"]) for r in swept])
        layers.clear()  # free this format's copies before the next one
        torch.cuda.empty_cache()


def tile_table(best: list[dict]) -> dict:
    """gemv_tiles.json's content: each (format, shape)'s fastest GEMV tile, its fastest skinny
    tile at M = 17 for BLOCK_M 16 and 32, and at M = 64 for BLOCK_M 64. A shape swept at 17
    rows only takes the 17-row tile at 64 with the heuristic's stages (the heuristic's tile
    where that still overflows shared memory)."""
    table: dict = {"gemv": {}, "skinny": {}}
    swept_at_64 = {(r["format"], r["n"], r["k"]) for r in best if r["m"] > 32}
    for row in sorted(best, key=lambda r: r["us"], reverse=True):  # the fastest of each key written last
        fmt, n, k, tile = row["format"], row["n"], row["k"], row["tile_dict"]
        if row["m"] == 1:
            table["gemv"][gemv_tiles.gemv_key(fmt, n, k)] = tile
        elif row["m"] > 32:
            table["skinny"][gemv_tiles.skinny_key(fmt, n, k, 64)] = tile
        else:
            for block_m in (16, 32):
                table["skinny"][gemv_tiles.skinny_key(fmt, n, k, block_m)] = tile
            if (fmt, n, k) not in swept_at_64:
                heuristic = gemv_tiles.heuristic_skinny_tile(fmt, n, k, 64)
                chosen = dict(tile, num_stages=min(heuristic["num_stages"], tile["num_stages"]))
                table["skinny"][gemv_tiles.skinny_key(fmt, n, k, 64)] = chosen if skinny_tile_fits(64, chosen) else heuristic
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--rows", default="1,17,64,65")
    parser.add_argument("--shapes", default="8b", help="8b, 70b or 8b,70b: the Llama-3 projections timed")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--write-tiles", action="store_true",
                        help=f"write the sweep's fastest tiles to {gemv_tiles.TABLE_PATH} (the kernels' table)")
    args = parser.parse_args(argv)
    row_counts = [int(m) for m in args.rows.split(",")]
    if not torch.cuda.is_available():
        sys.exit("bench.quant_gemv times CUDA kernels and needs a CUDA GPU")
    shapes = {}
    for size in args.shapes.split(","):
        for name, shape in (SHAPES if size == "8b" else SHAPES_70B).items():
            if name != "lm_head":  # the LM head stays bf16
                shapes[f"{size}/{name}"] = shape
    rows: list[dict] = []
    best: list[dict] = []
    for name, (n, k) in shapes.items():
        bench_shape(name, n, k, row_counts, args.sweep, rows, best)
    body = ["## QuantizedLinear vs bf16 linear(), the tiles the kernels take before this sweep", "", *markdown_table(rows), ""]
    if best:
        body += [f"## sweep: the three fastest tiles per shape and format (M = 1 GEMV, M = {' and '.join(map(str, SKINNY_SWEEP_ROWS))} skinny)", "",
                 *markdown_table([{k: v for k, v in r.items() if k not in ("hetero_us", "tile_dict")} for r in best]), ""]
    info = dict(describe_machine(), torch=torch.__version__, gpu=torch.cuda.get_device_name(), python=platform.python_version())
    command = "python -m bench.quant_gemv " + " ".join(sys.argv[1:] if argv is None else argv)
    stem = f"{args.out}/quant_gemv-{time.strftime('%Y%m%d-%H%M%S')}"
    if best:
        table = dict(gpu=info["gpu"], command=command, **tile_table(best))
        with open(f"{stem}-tiles.json", "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)
        if args.write_tiles:
            with open(gemv_tiles.TABLE_PATH, "w", encoding="utf-8") as f:
                json.dump(table, f, indent=1)
            print(f"wrote {gemv_tiles.TABLE_PATH}")
    print(write_markdown_and_json(stem, "Quantised weight-only kernels vs bf16 (Llama-3 projections)", command, info,
                                  [{k: v for k, v in r.items() if k != "tile_dict"} for r in rows + best], body))


if __name__ == "__main__":
    main()
