"""Builds and loads the native draft forward (`csrc/draft_forward.cpp`) at first use.

The source is compiled with the host's C++ compiler for the host's CPU (``-march=native``)
into a cache directory (``$HETERO_CACHE_DIR``, else ``~/.cache/hetero/native``) under a
name hashed from the source, the compiler command, its flags, the machine and the CPU's
flags, so a changed source or a different CPU builds afresh and a second process reuses
the first one's build. The build writes a temporary file and renames it into place, so
processes building at once (test workers, the draft worker) never load a half-written
library. Where the compiler is missing or the build fails, `load_library` logs one
warning and returns None, and callers keep the torch forward (`cpu_draft.lean_model`).

The library uses only the OpenMP calls every libgomp has, so loaded after torch it binds
to torch's libgomp (soname ``libgomp.so.1``): one OpenMP thread pool in the process.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch  # noqa: F401  (loads torch's libgomp first, so the library binds to it)

logger = logging.getLogger("hetero.cpu_draft.native")

SOURCE = Path(__file__).resolve().parent / "csrc" / "draft_forward.cpp"
COMPILER = os.environ.get("CXX", "g++")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300

_lock = threading.Lock()
_libraries: dict[tuple, Optional[ctypes.CDLL]] = {}


def cache_dir() -> Path:
    base = os.environ.get("HETERO_CACHE_DIR")
    return Path(base) / "native" if base else Path.home() / ".cache" / "hetero" / "native"


def load_library(extra_flags: Sequence[str] = ()) -> Optional[ctypes.CDLL]:
    """The compiled draft forward, built if needed; None (warned once per build setup) if it cannot be built.

    ``extra_flags`` are appended to the compiler flags (tests build the portable AVX2 path with
    ``-mno-avx512f`` on an AVX-512 machine).
    """
    compiler, flags, directory = COMPILER, (*FLAGS, *extra_flags), cache_dir()
    key = (compiler, flags, str(directory))
    with _lock:
        if key not in _libraries:
            _libraries[key] = _build_and_load(compiler, flags, directory)
        return _libraries[key]


def available() -> bool:
    return load_library() is not None


def amx(library: ctypes.CDLL) -> bool:
    """Whether matmuls of 4 rows or more use AMX tiles: the library was built for AMX (``-march=native`` on a
    CPU with it), the CPU has it, Linux granted the process its tile data, and it is not turned off."""
    return bool(library.draft_amx())


def set_amx(library: ctypes.CDLL, on: bool) -> bool:
    """Turns the AMX kernels on (where `amx` could be true) or off (``HETERO_NATIVE_AMX=0`` turns them off at
    load), between forwards; returns `amx`. INT8 results are the same either way, bit for bit."""
    return bool(library.draft_set_amx(int(on)))


def enable_profile(library: ctypes.CDLL, on: bool = True) -> None:
    """Turns the per-phase timing on or off (``HETERO_NATIVE_PROFILE=1`` turns it on at load); keeps the sums."""
    library.draft_profile_enable(int(on))


def reset_profile(library: ctypes.CDLL) -> None:
    library.draft_profile_reset()


def read_profile(library: ctypes.CDLL) -> dict:
    """The phase timing summed since the last reset: ``calls``, ``total_s`` (wall time inside the calls),
    ``threads``, and per phase (``embed``, ``qkv`` with rotary and the K/V store, ``attention``, ``o``,
    ``gate_up`` with silu, ``down``, ``lm_head``, ``top_k``: the drafter's read of the logits, in
    `NativeDraftModel.forward_top` calls only) a dict of ``compute_s`` (mean over threads),
    ``compute_max_s`` (the busiest thread) and ``wait_s`` (mean time at the barrier that ends the phase:
    load imbalance plus the barrier itself)."""
    names = library.draft_profile_names().decode().split(",")
    values = (ctypes.c_double * (3 + 3 * len(names)))()
    library.draft_profile(values, len(values))
    phases = {name: {"compute_s": values[3 + 3 * i], "compute_max_s": values[4 + 3 * i], "wait_s": values[5 + 3 * i]}
              for i, name in enumerate(names)}
    return {"calls": int(values[0]), "total_s": values[1], "threads": int(values[2]), "phases": phases}


def profile_table(profile: dict) -> dict[str, float]:
    """Milliseconds per forward: each phase's wall time (mean compute + mean barrier wait), then ``barrier``
    (all waits), ``imbalance`` (busiest thread minus mean, summed), ``other`` (the rest of the call:
    buffers, the parallel region's start and join) and ``total``."""
    calls = max(profile["calls"], 1)
    table = {name: 1e3 * (p["compute_s"] + p["wait_s"]) / calls for name, p in profile["phases"].items()}
    phases = profile["phases"].values()
    table["barrier"] = 1e3 * sum(p["wait_s"] for p in phases) / calls
    table["imbalance"] = 1e3 * sum(p["compute_max_s"] - p["compute_s"] for p in phases) / calls
    table["other"] = 1e3 * profile["total_s"] / calls - sum(table[name] for name in profile["phases"])
    table["total"] = 1e3 * profile["total_s"] / calls
    return table


def _build_and_load(compiler: str, flags: tuple[str, ...], directory: Path) -> Optional[ctypes.CDLL]:
    source = SOURCE.read_bytes()
    digest = hashlib.sha256()
    for part in (source, compiler.encode(), " ".join(flags).encode(), platform.machine().encode(), _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    path = directory / f"draft_forward-{digest.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            _compile(compiler, flags, path)
        library = ctypes.CDLL(str(path))
        library.draft_vector_width.restype = ctypes.c_int64
        library.draft_bf16_pairs.restype = ctypes.c_int64
        library.draft_int8_quads.restype = ctypes.c_int64
        library.draft_forward.restype = ctypes.c_int
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        library.draft_forward.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr]
        library.draft_to_bf16.argtypes = [ptr, i64, ptr]
        library.draft_matmul.argtypes = [ptr, i64, ptr, ptr, i64, ptr]
        library.draft_profile_enable.argtypes = [i64]
        library.draft_profile_enabled.restype = i64
        library.draft_profile_names.restype = ctypes.c_char_p
        library.draft_profile.argtypes = [ptr, i64]
        library.draft_profile.restype = i64
        library.draft_amx.restype = i64
        library.draft_amx_kernels.restype = i64
        library.draft_set_amx.argtypes = [i64]
        library.draft_set_amx.restype = i64
        return library
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("native draft forward unavailable, using the torch forward instead: %s", _short(exc))
        return None


def _compile(compiler: str, flags: tuple[str, ...], path: Path) -> None:
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"C++ compiler {compiler!r} not found")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
    os.close(fd)
    try:
        command = [compiler, *flags, str(SOURCE), "-o", temporary]
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise subprocess.SubprocessError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def _short(exc: BaseException, limit: int = 2000) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + " ..."
