"""Tiles of the streaming kernels (gpu_target/gemv.py) for quantised weights, per shape.

bf16 weights keep gemv.py's own tiles. For FP8 and 4-bit weights a tile is looked up by
(format, N, K) for the GEMV and (format, N, K, BLOCK_M) for the skinny GEMM in
`gemv_tiles.json`, next to this module, which `python -m bench.quant_gemv --sweep
--write-tiles` writes on the GPU from the fastest of `GEMV_CANDIDATES` / `SKINNY_CANDIDATES`
(per format) per shape. A shape it lacks takes `heuristic_gemv_tile` / `heuristic_skinny_tile`:

- GEMV (1 row): a weight-only GEMV is bound by streaming W, so each program must keep many
  bytes in flight and stream tens of KB, and the grid must cover the 132 SMs a few times.
  FP8: 8 rows over 1024 columns a program, fewer rows where N leaves fewer programs than
  SMs. 4-bit: the GEMV's instructions per code, not bytes, bound it (gemv.py's
  `_int4_gemv_sums`); its x work (load, conversion, sum) is per thread and column, so
  each thread should own several rows of the same columns: 128 rows over 128 columns on 2
  warps (8 rows of 4 words a thread), which leaves a 4096-row matrix only 32 programs, so K
  is split (`split_k`: deterministic, gemv.py's `_split_sum`) until the programs are
  4 per SM, each share at least two K tiles; each segment's loads are issued a segment
  ahead (`prefetch`, which the sweep picked for every 8B projection).
- skinny GEMM (2..64 rows): gemv.py's bf16 tile has 64 W rows a program, which leaves a
  4096-row matrix 64 programs (half the SMs); FP8 W streams fewer bytes per row, so 32-row
  programs (16 under N = 4096) cover the GPU. 4-bit W: 64 rows a warpgroup (4 warps) over
  one group of K, 128 columns: its codes convert in the registers of Hopper's warpgroup MMA
  (wgmma, whose M is 64 rows a warpgroup), and with fewer rows than 16 a warp Triton
  splits the MMA's warps over x's rows, each converting the same W codes. A 4096-row
  matrix then has 64 programs, so K is split (`split_k`, gemv.py's `_split_sum` as the
  GEMV's) until the programs cover the SMs.

Each program's tile must be the same in a fused kernel and in its unfused twin (the sums
are then bit-identical); both look it up here by the same (format, N, K).

FP8 weights at 2..64 rows also have W8A8 kernels (gpu_target/fp8_gemm.py): the table's
"w8a8" tiles of its Triton GEMM, keyed (N, K, BLOCK_M), and "fp8_paths", the kernel the
bench measured fastest per (N, K, BLOCK_M): "w8a16" (the skinny GEMM), "w8a8" (the Triton
FP8 GEMM) or "scaled_mm" (torch._scaled_mm). A shape it lacks takes `DEFAULT_FP8_PATH` and
`heuristic_w8a8_tile`: 64 W rows a program (an FP8 MMA's smallest warpgroup tile), 128 at
BLOCK_M 64 (each program reads all of x's rows, so wider programs read x fewer times), over
128-column K tiles (128 bytes a row: one swizzled shared-memory line), K split in up to 4
shares while the programs are fewer than the SMs.
"""
from __future__ import annotations

import functools
import json
import pathlib
from typing import Optional

TABLE_PATH = pathlib.Path(__file__).with_name("gemv_tiles.json")
SMS = 132  # an H100 SXM's streaming multiprocessors: the heuristic's grid target
FORMAT_NAMES = {1: "fp8", 2: "int4"}  # gemv.py's W_FORMAT values of the quantised formats

# Candidates bench.quant_gemv --sweep times per shape (the heuristic's tile is among them):
# the GEMV's and the skinny GEMM's per format.
GEMV_CANDIDATES = {
    "fp8": [
        dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, split_k=1)
        for block_n, block_k, warps, stages in (
            (2, 2048, 8, 1), (4, 1024, 4, 1), (4, 2048, 8, 1), (8, 512, 4, 1), (8, 1024, 4, 1), (8, 1024, 4, 2),
            (8, 2048, 8, 1), (16, 256, 4, 1), (16, 512, 4, 1), (16, 1024, 4, 1), (16, 1024, 8, 1), (32, 256, 4, 1),
            (32, 512, 4, 1), (32, 512, 8, 1), (32, 1024, 4, 1),
        )
    ],
    # 4-bit: several rows a thread (its x work is per thread and column), programs from K shares;
    # the same with each segment's loads issued a segment ahead (`prefetch`)
    "int4": [
        dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=1, split_k=split_k, prefetch=False)
        for block_n, block_k, warps, split_k in (
            (16, 512, 4, 1), (32, 512, 4, 1), (32, 256, 1, 4), (32, 256, 1, 8), (64, 256, 2, 2), (64, 256, 2, 4),
            (64, 256, 2, 8), (64, 256, 2, 16), (64, 128, 1, 8), (128, 128, 2, 2), (128, 128, 2, 4), (128, 128, 2, 8),
            (128, 128, 2, 16), (128, 256, 2, 4), (128, 128, 4, 4), (128, 256, 4, 8),
        )
    ] + [
        dict(block_n=block_n, block_k=128, num_warps=warps, num_stages=1, split_k=split_k, prefetch=True)
        for block_n, warps, split_k in (
            (32, 1, 8), (32, 1, 16), (64, 2, 2), (64, 2, 4), (64, 2, 8), (64, 2, 16), (64, 4, 8), (128, 2, 4),
            (128, 2, 8), (128, 2, 16), (128, 4, 4), (128, 4, 8),
        )
    ],
}
SKINNY_CANDIDATES = {
    "fp8": [
        dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, w_first=True)
        for block_n, block_k, warps, stages in (
            (16, 256, 4, 3), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3),
            (64, 128, 4, 4), (64, 256, 4, 4), (32, 256, 8, 3), (64, 128, 8, 3), (64, 256, 8, 3), (128, 128, 8, 3),
        )
    ],
    # 4-bit: 16 W rows a warp or more (each code converts once), 64 or 128 a warpgroup, K split
    # where the column tiles alone leave SMs idle
    "int4": [
        dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, w_first=True, split_k=split_k)
        for block_n, block_k, warps, stages, split_k in (
            (64, 128, 4, 2, 1), (64, 128, 4, 3, 1), (64, 128, 4, 4, 1), (64, 256, 4, 3, 1), (128, 128, 4, 3, 1),
            (128, 128, 8, 3, 1), (128, 128, 8, 4, 1), (128, 256, 8, 3, 1), (64, 128, 4, 3, 2), (64, 128, 4, 3, 4),
            (64, 256, 4, 3, 2), (128, 128, 8, 3, 2), (128, 128, 8, 3, 4), (128, 128, 4, 3, 2), (128, 128, 4, 3, 4),
        )
    ],
}


W8A8_CANDIDATES = [
    dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=warps, num_stages=stages)
    for block_n, block_k, split_k, warps, stages in (
        (32, 128, 1, 4, 4), (32, 256, 2, 4, 3), (64, 128, 1, 4, 4), (64, 128, 2, 4, 4), (64, 128, 4, 4, 4),
        (64, 128, 8, 4, 4), (64, 256, 2, 4, 3), (128, 128, 1, 4, 4), (128, 128, 2, 4, 4), (128, 128, 4, 4, 4),
        (128, 128, 4, 8, 4), (128, 128, 8, 4, 4), (128, 256, 4, 8, 3),
    )
]
FP8_PATHS = ("w8a16", "w8a8", "scaled_mm")
DEFAULT_FP8_PATH = "w8a8"  # FP8 x FP8 reads half the skinny GEMM's bytes of x and needs no conversion of W


@functools.lru_cache(maxsize=1)
def measured_tiles(path: pathlib.Path = TABLE_PATH) -> dict:
    """The sweep's table ({"gemv": {key: tile}, "skinny": {key: tile}}), or empty ones."""
    if not path.exists():
        return {"gemv": {}, "skinny": {}}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def gemv_key(fmt: str, n: int, k: int) -> str:
    return f"{fmt} {n} {k}"


def skinny_key(fmt: str, n: int, k: int, block_m: int) -> str:
    return f"{fmt} {n} {k} {block_m}"


def heuristic_gemv_tile(fmt: str, n: int, k: int) -> dict:
    """See the module docstring: 8 FP8 rows over 1024 columns, halved while that leaves fewer
    programs than SMs; 128 4-bit rows over 128 columns on 2 warps, K split in up to 16 shares
    (a power of two) while the programs are fewer than 4 per SM and each share keeps two K
    tiles; fewer rows a program while that leaves under 16 row tiles (a small model's
    matrices: their qkv tiles must also fit its heads' rotary pairs, gemv.py's `rotary_fits`)."""
    if fmt == "fp8":
        block_n = 8
        while block_n > 2 and n // block_n < SMS:
            block_n //= 2
        return dict(block_n=block_n, block_k=min(1024, _k_span(k)), num_warps=4, num_stages=1, split_k=1)
    block_n, block_k = 128, min(128, _k_span(k))
    while block_n > 2 and n // block_n < SMS // 8:
        block_n //= 2
    split_k = 1
    while split_k < 16 and -(-n // block_n) * split_k < 4 * SMS and k // (4 * split_k) >= block_k:
        split_k *= 2
    return dict(block_n=block_n, block_k=block_k, num_warps=2, num_stages=1, split_k=split_k, prefetch=True)


def heuristic_skinny_tile(fmt: str, n: int, k: int, block_m: int) -> dict:
    """See the module docstring: FP8: 32 W rows a program (16 where that leaves under one
    program per SM), W first in the MMA, a shallower pipeline at BLOCK_M = 64. 4-bit: 64 rows
    on 4 warps over 128 columns (fewer rows a program where N leaves under 16 row tiles, on
    a small model), K split in 2 or 4 shares of two K tiles or more while the programs are
    fewer than the SMs."""
    if fmt == "int4":
        block_n = 64
        while block_n > 16 and n // block_n < 16:
            block_n //= 2
        block_k = min(128, _k_span(k))
        split_k = 1
        while split_k < 4 and -(-n // block_n) * split_k < SMS and k // (2 * split_k) >= block_k:
            split_k *= 2
        return dict(block_n=block_n, block_k=block_k, num_warps=max(1, block_n // 16), num_stages=3, w_first=True,
                    split_k=split_k)
    block_n = 32 if n // 32 >= SMS else 16
    return dict(block_n=block_n, block_k=min(256, _k_span(k)), num_warps=4, num_stages=3 if block_m > 32 else 4,
                w_first=True)


def heuristic_w8a8_tile(n: int, k: int, block_m: int) -> dict:
    """See the module docstring: 64 W rows a program (128 at BLOCK_M 64) over 128-column K
    tiles, K split in 2 or 4 shares of whole tiles while the programs are fewer than the SMs."""
    block_n, block_k = (128 if block_m >= 64 else 64), 128
    split_k = 1
    while split_k < 4 and -(-n // block_n) * split_k < SMS and k // (2 * split_k) >= block_k:
        split_k *= 2
    return dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=4 if block_m <= 32 else 3)


def _k_span(k: int) -> int:
    """K rounded up to a power of two >= 16: no K tile need be wider (small test models)."""
    return max(16, 1 << (k - 1).bit_length())


def gemv_tile(w_format: int, n: int, k: int, table: Optional[dict] = None) -> dict:
    """The GEMV tile of a quantised weight (`w_format` 1 or 2) of shape [n, k]."""
    fmt = FORMAT_NAMES[w_format]
    table = measured_tiles() if table is None else table
    return dict(table["gemv"].get(gemv_key(fmt, n, k)) or heuristic_gemv_tile(fmt, n, k))


def skinny_tile(w_format: int, n: int, k: int, block_m: int, table: Optional[dict] = None) -> dict:
    """The skinny GEMM tile of a quantised weight of shape [n, k] at BLOCK_M padded rows."""
    fmt = FORMAT_NAMES[w_format]
    table = measured_tiles() if table is None else table
    return dict(table["skinny"].get(skinny_key(fmt, n, k, block_m)) or heuristic_skinny_tile(fmt, n, k, block_m))


def w8a8_tile(n: int, k: int, block_m: int, table: Optional[dict] = None) -> dict:
    """The Triton W8A8 GEMM's tile for an FP8 weight of shape [n, k] at BLOCK_M padded rows."""
    table = measured_tiles() if table is None else table
    return dict(table.get("w8a8", {}).get(skinny_key("fp8", n, k, block_m)) or heuristic_w8a8_tile(n, k, block_m))


def fp8_path(n: int, k: int, block_m: int, table: Optional[dict] = None) -> str:
    """The kernel an FP8 weight of shape [n, k] takes at 2..64 rows (BLOCK_M padded): one of `FP8_PATHS`."""
    table = measured_tiles() if table is None else table
    return table.get("fp8_paths", {}).get(skinny_key("fp8", n, k, block_m), DEFAULT_FP8_PATH)
