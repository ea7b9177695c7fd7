"""Quantised weight-only kernels on Llama-3-8B's projections, against bf16's at the same rows.

For each projection, format (fp8, int4) and row count M in ``--rows`` (1: the quantised
GEMV, 2..64: the quantised skinny GEMM, 65+: W8A8 `torch._scaled_mm` for fp8, dequantise +
cuBLAS for int4) times `QuantizedLinear` and hetero's bf16 `gemv.linear`, each call reading
another copy of the weights (bench.gemv's method: copies past L2, in one CUDA graph), and
reports microseconds, TB/s of the bytes streamed (quantised weights + scales) and the
speed-up over bf16. ``--sweep`` also times grids of tiles at M = 1 (GEMV) and M = 17 (skinny),
to choose the quantised kernels' defaults.

    python -m bench.quant_gemv --out bench/results [--rows 1,17,64,65] [--sweep]
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

import torch
import torch.nn.functional as F

from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from bench.gemv import GEMV_SWEEP, SHAPES, SKINNY_SWEEP, fastest, skinny_tile_fits, tile_label, tiles, time_per_call_us
from gpu_target.gemv import gemv, linear, skinny_gemm
from gpu_target.quantization import quantize
from gpu_target.quantization.linear import QuantizedLinear

try:
    from triton.runtime.errors import OutOfResources
except ImportError:
    OutOfResources = RuntimeError

FORMATS = ("fp8", "int4")


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
            rows.append(dict(shape=name, format=fmt, m=m, tile="default", us=round(us, 2), TBps=round(gigabytes / us * 1e3, 2),
                             bf16_us=round(bf16_us, 2), speedup_vs_bf16=round(bf16_us / us, 3), max_rel_err=f"{error.item():.1e}"))
            print(rows[-1], flush=True)
        if sweep:
            for m, grid, kernel in ((1, GEMV_SWEEP, gemv), (17, SKINNY_SWEEP, skinny_gemm)):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                swept = []
                for tile in tiles(grid):
                    if (m == 1 and tile["block_n"] * tile["block_k"] > 8192) or (m > 1 and not skinny_tile_fits(m, tile)):
                        continue
                    try:
                        us = time_per_call_us(lambda i, t=tile: kernel(x, layers[i].quantized, **t), copies, 5)
                    except OutOfResources as error:
                        print(f"skip {name} {fmt} m={m} {tile}: {error}", flush=True)
                        continue
                    swept.append(dict(shape=name, format=fmt, m=m, tile=tile_label(tile), us=round(us, 2),
                                      TBps=round(gigabytes / us * 1e3, 2)))
                best += fastest([dict(r, hetero_us=r["us"]) for r in swept])
        layers.clear()  # free this format's copies before the next one
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--rows", default="1,17,64,65")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args(argv)
    row_counts = [int(m) for m in args.rows.split(",")]
    if not torch.cuda.is_available():
        sys.exit("bench.quant_gemv times CUDA kernels and needs a CUDA GPU")
    rows: list[dict] = []
    best: list[dict] = []
    for name, (n, k) in SHAPES.items():
        if name != "lm_head":  # the LM head stays bf16
            bench_shape(name, n, k, row_counts, args.sweep, rows, best)
    body = ["## QuantizedLinear vs bf16 linear(), default tiles", "", *markdown_table(rows), ""]
    if best:
        body += ["## sweep: the three fastest tiles per shape and format (M = 1 GEMV, M = 17 skinny)", "",
                 *markdown_table([{k: v for k, v in r.items() if k != "hetero_us"} for r in best]), ""]
    info = dict(describe_machine(), torch=torch.__version__, gpu=torch.cuda.get_device_name(), python=platform.python_version())
    command = "python -m bench.quant_gemv " + " ".join(sys.argv[1:] if argv is None else argv)
    stem = f"{args.out}/quant_gemv-{time.strftime('%Y%m%d-%H%M%S')}"
    print(write_markdown_and_json(stem, "Quantised weight-only kernels vs bf16 (Llama-3-8B projections)", command, info,
                                  rows + best, body))


if __name__ == "__main__":
    main()
