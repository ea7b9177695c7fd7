"""Quantised kernels on Llama-3-8B's projections, against bf16's at the same rows.

For each projection, format (fp8, int4) and row count M in ``--rows`` times `QuantizedLinear`
(the kernel it routes to: 1 row the quantised GEMV; 2..64 the quantised skinny GEMM, for
fp8 the kernel gpu_target/gemv_tiles.py's `fp8_path` names; 65+ W8A8 `scaled_mm` for fp8;
for int4 65..128 the skinny GEMM on each half of the rows, more a Triton dequantisation + cuBLAS) and hetero's bf16 `gemv.linear`, each call reading another
copy of the weights (bench.gemv's method: copies past L2, in one CUDA graph), and reports
microseconds, TB/s of the bytes streamed (quantised weights + scales) and the speed-up over
bf16. For fp8 at 2..64 rows it also times each kernel side by side: the W8A16 skinny GEMM
(w8a16_us), the Triton W8A8 GEMM with its fastest of gemv_tiles.py's `W8A8_CANDIDATES`
(w8a8_us, w8a8_tile; activation quantisation included), `torch._scaled_mm` after the fused
quantisation (scaled_mm_us), and that quantisation alone (quant_us). The fastest counts the
quantisation as the model pays it: apart for o_proj; for qkv, gate_up and down, whose norm or
SiLU-and-mul emits the FP8 rows (gpu_target/fp8_activations.py), that op's extra time over
its plain kernel (fused_quant_us) instead of quant_us. ``--write-tiles``
merges the fastest kernel and W8A8 tile per (shape, BLOCK_M) into gpu_target/gemv_tiles.json
("fp8_paths", "w8a8"), the table the routing then reads (time at 16, 17 and 64 rows to
cover BLOCK_M 16, 32 and 64).
``--sweep`` also times gpu_target/gemv_tiles.py's candidate tiles of the W8A16 kernels per
shape and format at M = 1 (GEMV) and M = 17 (skinny, BLOCK_M 32) (``--sweep gemv`` or
``--sweep skinny``: one of them), lists the three fastest,
and with ``--write-tiles`` writes the fastest into the table as well (BLOCK_M 16 and 64 take
the M = 17 winner's tile, with the heuristic's pipeline depth at 64). ``--formats fp8``
times one format; ``--shapes 8b,70b`` adds Llama-3-70B's projections.
For int4 it also times torch's own 4-bit kernel, `aten._weight_int4pack_mm` (gpt-fast's
"tinygemm", the maintained alternative in PyTorch), on the same codes, scales and zero points
(``tinygemm_us``: its fastest of inner_k_tiles 2, 4 and 8; ``tinygemm_rel_err`` as
``max_rel_err``) where the CUDA build has it.
``--layer`` also times one FP8 decoder layer's W8A8 sequence (rotary and attention left out:
the same either way) at each row count of 2..64, fused (RMSNorm and SiLU-and-mul emit the FP8
rows, gpu_target/fp8_activations.py; o_proj's quantised apart) against unfused (every
projection quantises its rows), every projection on the Triton W8A8 GEMM.

    python -m bench.quant_gemv --out bench/results [--rows 1,16,17,64,65] [--formats fp8] [--sweep [gemv|skinny]]
                               [--write-tiles] [--shapes 8b,70b] [--layer]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json
from bench.gemv import SHAPES, SKINNY_SWEEP_ROWS, fastest, skinny_tile_fits, tile_label, time_per_call_us
from gpu_target import fp8_activations, fp8_gemm, fused_ops, gemv_tiles
from gpu_target.gemv import MAX_STREAMING_ROWS, gemv, linear, skinny_block_m, skinny_gemm, streaming_tile
from gpu_target.quantization import int4, quantize
from gpu_target.quantization.linear import QuantizedLinear, w8a8_path

try:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
except ImportError:
    CompilationError = OutOfResources = RuntimeError

FORMATS = ("fp8", "int4")
SHAPES_70B = dict(qkv_proj=(10240, 8192), o_proj=(8192, 8192), gate_up_proj=(57344, 8192), down_proj=(8192, 28672))


def layer_of(weight) -> QuantizedLinear:
    layer = QuantizedLinear(weight.shape[1], weight.shape[0], bias=False)
    layer.load_weight(weight)
    return layer


def fp8_kernels_side_by_side(name: str, x: torch.Tensor, layers: list, copies: int) -> dict:
    """The W8A16 skinny GEMM, the Triton W8A8 GEMM (its fastest candidate tile) and
    torch._scaled_mm on x's rows (activation quantisation included), and the fastest."""
    n, k = layers[0].quantized.shape
    times = dict(w8a16=time_per_call_us(lambda i: skinny_gemm(x, layers[i].quantized), copies))
    tiles = [gemv_tiles.w8a8_tile(n, k, skinny_block_m(len(x)))]
    tiles += [t for t in gemv_tiles.W8A8_CANDIDATES if t not in tiles and k // t["split_k"] >= t["block_k"]]
    w8a8 = []
    for tile in tiles:
        try:
            us = time_per_call_us(lambda i, t=tile: fp8_gemm.w8a8_gemm(x, layers[i].quantized, **t), copies, 5)
        except (OutOfResources, CompilationError, RuntimeError) as error:  # RuntimeError: a tile Triton cannot lower
            print(f"skip {name} w8a8 m={len(x)} {tile}: {error}", flush=True)
            continue
        w8a8.append((us, tile))
        print(dict(shape=name, m=len(x), w8a8_tile=tile_label(tile), us=round(us, 2)), flush=True)
    if w8a8:
        times["w8a8"], w8a8_tile = min(w8a8, key=lambda r: r[0])
    try:
        times["scaled_mm"] = time_per_call_us(lambda i: fp8_gemm.scaled_mm(x, layers[i].quantized), copies)
    except RuntimeError as error:  # a torch build without row-wise _scaled_mm
        print(f"skip {name} scaled_mm m={len(x)}: {error}", flush=True)
    row = {f"{path}_us": round(us, 2) for path, us in times.items()}
    quant_us = time_per_call_us(lambda i: fp8_gemm.quantize_per_token(x), copies)  # in both W8A8 times
    row["quant_us"] = round(quant_us, 2)
    fused_quant_us = fused_quantisation_us(name, x)
    if fused_quant_us is not None:
        row["fused_quant_us"] = round(fused_quant_us, 2)
    if w8a8:
        row.update(w8a8_tile=tile_label(w8a8_tile), w8a8_tile_dict=w8a8_tile)
    return dict(row, fastest=fastest_as_paid(times, quant_us, fused_quant_us))


def fastest_as_paid(times: dict, quant_us: float, fused_quant_us: float | None) -> str:
    """The path of least time with the activation quantisation priced as the model pays it: the
    W8A8 times include `quant_us`; where the op before fuses it, `fused_quant_us` replaces it."""
    if fused_quant_us is not None:
        times = {path: us if path == "w8a16" else us - quant_us + fused_quant_us for path, us in times.items()}
    return min(times, key=times.get)


def fused_quantisation_us(name: str, x: torch.Tensor) -> float | None:
    """What quantising x's rows costs the model where the op that makes them emits them
    quantised (gpu_target/fp8_activations.py): that op's time less its plain kernel's, on
    rows of x's count (add-and-RMSNorm before qkv and gate_up, SiLU-and-mul before down);
    None for o_proj, whose rows are quantised apart."""
    projection = name.rsplit("/", 1)[-1]
    m, k = x.shape
    if projection in ("qkv_proj", "gate_up_proj"):
        residual, weight = torch.randn_like(x), torch.ones(k, device=x.device, dtype=x.dtype)
        fused = time_per_call_us(lambda i: fp8_activations.add_rms_norm_fp8(x, residual, weight, LAYER_EPS), 1)
        return fused - time_per_call_us(lambda i: fused_ops.add_rms_norm(x, residual, weight, LAYER_EPS), 1)
    if projection == "down_proj":
        gate_up = torch.randn(m, 2 * k, device=x.device, dtype=x.dtype)
        fused = time_per_call_us(lambda i: fp8_activations.silu_and_mul_fp8(gate_up), 1)
        return fused - time_per_call_us(lambda i: fused_ops.silu_and_mul(gate_up), 1)
    return None


TINYGEMM_INNER_K_TILES = (2, 4, 8)


def tinygemm_weight(weight: int4.Int4Weight, inner_k_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same 4-bit weight in `aten._weight_int4pack_mm`'s form: codes packed two a byte (even
    k in the high nibble), and per (group, row) a bf16 scale and offset, w = (q - 8) s + offset,
    so offset = (8 - z) s for hetero's integer zero point z."""
    codes = weight.codes().int()
    packed = torch.ops.aten._convert_weight_to_int4pack(((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8),
                                                        inner_k_tiles)
    scales = weight.scales.float()
    zeros = int4.SYMMETRIC_ZERO if weight.zeros is None else weight.zeros.float()
    scales_and_zeros = torch.stack([scales, (int4.SYMMETRIC_ZERO - zeros) * scales], dim=-1).transpose(0, 1)
    return packed, scales_and_zeros.contiguous().to(torch.bfloat16)


def tinygemm_side_by_side(x: torch.Tensor, weights: list[int4.Int4Weight], expected: torch.Tensor) -> dict:
    """torch's 4-bit kernel on the weight copies: its fastest inner_k_tiles and its largest error
    relative to ``expected`` (as max_rel_err); nothing where this build lacks it."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm") or weights[0].group_size not in (32, 64, 128, 256):
        return {}
    group = weights[0].group_size
    times, errors = [], []
    for tiles in TINYGEMM_INNER_K_TILES:
        packs = [tinygemm_weight(w, tiles) for w in weights]
        got = torch.ops.aten._weight_int4pack_mm(x, packs[0][0], group, packs[0][1]).float()
        errors.append(((got - expected).abs().max() / expected.abs().max()).item())
        times.append(time_per_call_us(lambda i: torch.ops.aten._weight_int4pack_mm(x, packs[i][0], group, packs[i][1]),
                                      len(packs)))
    return dict(tinygemm_us=round(min(times), 2), tinygemm_rel_err=f"{max(errors):.1e}")


def bench_shape(name: str, n: int, k: int, row_counts: list[int], formats: list[str], sweep: str, rows: list[dict],
                best: list[dict]) -> None:
    source = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    bf16_copies = max(2, int(2e9 // (n * k * 2)))
    bf16 = [source.clone() for _ in range(bf16_copies)]
    for fmt in formats:
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
            path = w8a8_path(x, layers[0].quantized) or ("gemv" if m == 1 else "w8a16" if m <= MAX_STREAMING_ROWS
                                                           else "skinny halves" if m <= 2 * MAX_STREAMING_ROWS and fmt == "int4"
                                                           else "dequantise")
            tile = tile_label(streaming_tile(quantized, m)) if path in ("gemv", "w8a16") else ""
            row = dict(shape=name, format=fmt, n=n, k=k, m=m, path=path, tile=tile, us=round(us, 2),
                       TBps=round(gigabytes / us * 1e3, 2), bf16_us=round(bf16_us, 2), speedup_vs_bf16=round(bf16_us / us, 3),
                       max_rel_err=f"{error.item():.1e}")
            if fmt == "fp8" and 1 < m <= MAX_STREAMING_ROWS:
                row.update(fp8_kernels_side_by_side(name, x, layers, copies))
            if fmt == "int4":
                row.update(tinygemm_side_by_side(x, [layer.quantized for layer in layers], F.linear(x, reference).float()))
            rows.append(row)
            print({key: v for key, v in row.items() if key != "w8a8_tile_dict"}, flush=True)
        sweeps = [(1, gemv_tiles.GEMV_CANDIDATES[fmt], gemv)] if "gemv" in sweep else []
        sweeps += [(m, gemv_tiles.SKINNY_CANDIDATES[fmt], skinny_gemm) for m in SKINNY_SWEEP_ROWS] if "skinny" in sweep else []
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


LAYER_EPS = 1e-5


def fp8_layer(shapes: dict, device: torch.device) -> dict:
    """One decoder layer's FP8 projections (`QuantizedLinear`s by name) and norm weights, random."""
    layer = {name: layer_of(quantize(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02, "fp8"))
             for name, (n, k) in shapes.items()}
    hidden = shapes["o_proj"][0]
    for name in ("input_norm", "post_norm"):
        layer[name] = (torch.rand(hidden, device=device) + 0.5).to(torch.bfloat16)
    return layer


def w8a8_layer_sequence(layer: dict, x: torch.Tensor, residual: torch.Tensor, fused: bool) -> torch.Tensor:
    """down_proj's output of one decoder layer on the W8A8 path, every projection on the Triton
    GEMM; qkv's first o_proj-input columns stand in for attention's output. Fused: the norms and
    SiLU-and-mul emit FP8 rows; unfused: `fp8_gemm.w8a8_gemm` quantises each projection's rows."""
    qkv_proj, o_proj, gate_up_proj, down_proj = (layer[name] for name in SHAPES if name != "lm_head")
    if fused:
        rows, residual = fp8_activations.add_rms_norm_fp8(x, residual, layer["input_norm"], LAYER_EPS)
        qkv = qkv_proj.forward_fp8(rows, "w8a8")
    else:
        normed, residual = fused_ops.add_rms_norm(x, residual, layer["input_norm"], LAYER_EPS, use_triton=True)
        qkv = fp8_gemm.w8a8_gemm(normed, qkv_proj.quantized)
    attended = fp8_gemm.w8a8_gemm(qkv[:, : o_proj.in_features], o_proj.quantized)
    if fused:
        rows, residual = fp8_activations.add_rms_norm_fp8(attended, residual, layer["post_norm"], LAYER_EPS)
        gate_up = gate_up_proj.forward_fp8(rows, "w8a8")
        return down_proj.forward_fp8(fp8_activations.silu_and_mul_fp8(gate_up), "w8a8")
    normed, residual = fused_ops.add_rms_norm(attended, residual, layer["post_norm"], LAYER_EPS, use_triton=True)
    gate_up = fp8_gemm.w8a8_gemm(normed, gate_up_proj.quantized)
    return fp8_gemm.w8a8_gemm(fused_ops.silu_and_mul(gate_up, use_triton=True), down_proj.quantized)


def bench_layer_sequence(row_counts: list[int]) -> list[dict]:
    """`w8a8_layer_sequence` fused and unfused on Llama-3-8B's shapes, each call reading
    another copy of the layer's weights."""
    shapes = {name: shape for name, shape in SHAPES.items() if name != "lm_head"}
    one = fp8_layer(shapes, torch.device("cuda"))
    layer_bytes = sum(one[name].quantized.nbytes for name in shapes)
    copies = max(2, int(2e9 // layer_bytes))
    layers = [one] + [fp8_layer(shapes, torch.device("cuda")) for _ in range(copies - 1)]
    rows = []
    for m in (m for m in row_counts if 1 < m <= MAX_STREAMING_ROWS):
        x = torch.randn(m, shapes["o_proj"][0], device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        times = {fused: time_per_call_us(lambda i, f=fused: w8a8_layer_sequence(layers[i], x, residual, f), copies)
                 for fused in (False, True)}
        same = torch.equal(w8a8_layer_sequence(one, x, residual, True), w8a8_layer_sequence(one, x, residual, False))
        rows.append(dict(m=m, unfused_us=round(times[False], 2), fused_us=round(times[True], 2),
                         saved_us=round(times[False] - times[True], 2), speedup=round(times[False] / times[True], 3),
                         bit_identical=same, GB_per_layer=round(layer_bytes / 1e9, 3)))
        print(rows[-1], flush=True)
    layers.clear()
    torch.cuda.empty_cache()
    return rows


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


def fp8_choices(rows: list[dict]) -> dict:
    """gemv_tiles.json's "fp8_paths" and "w8a8" entries: per (shape, BLOCK_M) timed, the fastest
    FP8 kernel and the Triton W8A8 GEMM's fastest tile (of the most rows timed at that BLOCK_M)."""
    choices: dict = {"fp8_paths": {}, "w8a8": {}}
    for row in sorted((r for r in rows if "fastest" in r), key=lambda r: r["m"]):
        key = gemv_tiles.skinny_key("fp8", row["n"], row["k"], skinny_block_m(row["m"]))
        choices["fp8_paths"][key] = row["fastest"]
        if "w8a8_tile_dict" in row:
            choices["w8a8"][key] = row["w8a8_tile_dict"]
    return choices


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--rows", default="1,17,64,65")
    parser.add_argument("--shapes", default="8b", help="8b, 70b or 8b,70b: the Llama-3 projections timed")
    parser.add_argument("--formats", default=",".join(FORMATS), help="fp8, int4, fp8,int4 or '' (with --layer: that alone)")
    parser.add_argument("--sweep", nargs="?", const="gemv,skinny", default="", choices=("gemv", "skinny", "gemv,skinny"),
                        help="time the candidate tiles: of the GEMV, the skinny GEMM or (no value) both")
    parser.add_argument("--write-tiles", action="store_true",
                        help=f"merge the fastest FP8 kernels (and the sweep's tiles) into {gemv_tiles.TABLE_PATH}")
    parser.add_argument("--layer", action="store_true",
                        help="also time one FP8 decoder layer's W8A8 sequence, fused quantisation vs unfused")
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
    formats = [f for f in args.formats.split(",") if f]
    for name, (n, k) in shapes.items() if formats else ():
        bench_shape(name, n, k, row_counts, formats, args.sweep, rows, best)
    layer_rows = bench_layer_sequence(row_counts) if args.layer else []
    shown = [{k: v for k, v in r.items() if k not in ("n", "k", "w8a8_tile_dict")} for r in rows]
    body = ["## QuantizedLinear (the kernel it routes to: path) vs bf16 linear(); fp8 at 2..64 rows: each kernel, "
            "the tables' tiles before this run", "", *markdown_table(shown), ""]
    if layer_rows:
        body += ["## one 8b FP8 decoder layer's W8A8 sequence without attention: quantisation fused into RMSNorm and "
                 "SiLU-and-mul (8 kernels) vs apart (11 kernels)", "", *markdown_table(layer_rows), ""]
    if best:
        body += [f"## sweep: the three fastest tiles per shape and format (M = 1 GEMV, M = {' and '.join(map(str, SKINNY_SWEEP_ROWS))} skinny)", "",
                 *markdown_table([{k: v for k, v in r.items() if k not in ("hetero_us", "tile_dict")} for r in best]), ""]
    info = dict(describe_machine(), torch=torch.__version__, gpu=torch.cuda.get_device_name(), python=platform.python_version())
    command = "python -m bench.quant_gemv " + " ".join(sys.argv[1:] if argv is None else argv)
    stem = f"{args.out}/quant_gemv-{time.strftime('%Y%m%d-%H%M%S')}"
    measured = fp8_choices(rows)
    if best or measured["fp8_paths"]:
        found = dict(gpu=info["gpu"], command=command, **(tile_table(best) if best else {}), **measured)
        os.makedirs(args.out, exist_ok=True)
        with open(f"{stem}-tiles.json", "w", encoding="utf-8") as f:
            json.dump(found, f, indent=1)
        if args.write_tiles:
            table = json.loads(json.dumps(gemv_tiles.measured_tiles()))  # a copy of the table as it stands
            table.update(gpu=info["gpu"], command=command)
            swept = tile_table(best) if best else {}
            for section, entries in (*swept.items(), *measured.items()):  # formats and shapes not run keep their entries
                table[section] = {**table.get(section, {}), **entries}
            with open(gemv_tiles.TABLE_PATH, "w", encoding="utf-8") as f:
                json.dump(table, f, indent=1)
            print(f"wrote {gemv_tiles.TABLE_PATH}")
    hidden = ("tile_dict", "w8a8_tile_dict")
    print(write_markdown_and_json(stem, "Quantised kernels vs bf16 (Llama-3 projections)", command, info,
                                  [{k: v for k, v in r.items() if k not in hidden} for r in rows + best + layer_rows], body))


if __name__ == "__main__":
    main()
