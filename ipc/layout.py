"""Byte layout of one message: a fixed slot header, then a table of named 1-D arrays and their bytes.

A slot is ``SLOT_HEADER_BYTES`` of header followed by the payload::

    header  : seq u64 | payload_len u64 | crc32 u32 | kind i32      (padded to 64 bytes)
    payload : count u32 | pad u32 | count * entry | array bytes
    entry   : name 32s (utf-8, NUL-padded) | dtype 8s (numpy dtype.str) | length u64 | offset u64

Offsets are relative to the payload start and aligned to ``ARRAY_ALIGN`` bytes so readers get
aligned numpy views. The CRC32 covers the whole payload (table and array bytes). Native
byte order and sizes are used throughout: both ends run on the same host.
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ipc.errors import CorruptMessageError, IPCError

SLOT_HEADER = struct.Struct("@QQIi")
SLOT_HEADER_BYTES = 64
TABLE_HEADER = struct.Struct("@I4x")
TABLE_ENTRY = struct.Struct("@32s8sQQ")
MAX_NAME_BYTES = 32
ARRAY_ALIGN = 64
SUPPORTED_DTYPE_KINDS = "biufc"


@dataclass(frozen=True)
class ArrayEntry:
    """Where one named array lives inside a payload."""

    name: str
    dtype: np.dtype
    length: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.length * self.dtype.itemsize


@dataclass(frozen=True)
class PayloadPlan:
    """The table of a payload and its total length in bytes."""

    entries: tuple[ArrayEntry, ...]
    length: int


def align_up(n: int, alignment: int = ARRAY_ALIGN) -> int:
    return -(-n // alignment) * alignment


def plan_payload(arrays: Mapping[str, np.ndarray]) -> PayloadPlan:
    """Check every array and place it; raises IPCError naming the offending array."""
    offset = align_up(TABLE_HEADER.size + TABLE_ENTRY.size * len(arrays))
    entries = []
    for name, array in arrays.items():
        _check_array(name, array)
        entry = ArrayEntry(name, array.dtype, len(array), offset)
        entries.append(entry)
        offset = align_up(offset + entry.nbytes)
    length = entries[-1].offset + entries[-1].nbytes if entries else TABLE_HEADER.size
    return PayloadPlan(tuple(entries), length)


def _check_array(name: object, array: object) -> None:
    if not isinstance(name, str) or not name or "\0" in name:
        raise IPCError(f"array names must be non-empty strings without NUL, got {name!r}")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise IPCError(f"array name {name!r} cannot be encoded as utf-8") from exc
    if len(encoded) > MAX_NAME_BYTES:
        raise IPCError(f"array name {name!r} is longer than {MAX_NAME_BYTES} bytes in utf-8")
    if not isinstance(array, np.ndarray):
        raise IPCError(f"array {name!r} must be a numpy ndarray, got {type(array).__name__}")
    if array.ndim != 1:
        raise IPCError(f"array {name!r} must be 1-D, got shape {array.shape}")
    if array.dtype.kind not in SUPPORTED_DTYPE_KINDS or array.dtype.fields is not None:
        raise IPCError(f"array {name!r} has unsupported dtype {array.dtype} (bool, int, uint, float, complex only)")


def write_payload(dest: np.ndarray, arrays: Mapping[str, np.ndarray], plan: PayloadPlan) -> None:
    """Write the table and the array bytes of ``plan`` into ``dest`` (a uint8 array of at least ``plan.length``)."""
    TABLE_HEADER.pack_into(dest, 0, len(plan.entries))
    for i, entry in enumerate(plan.entries):
        TABLE_ENTRY.pack_into(
            dest,
            TABLE_HEADER.size + i * TABLE_ENTRY.size,
            entry.name.encode("utf-8"),
            entry.dtype.str.encode("ascii"),
            entry.length,
            entry.offset,
        )
        target = dest[entry.offset : entry.offset + entry.nbytes].view(entry.dtype)
        target[...] = arrays[entry.name]


def read_payload(src: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """Numpy views of the arrays in the payload ``src[:length]``; raises CorruptMessageError on a bad table."""
    if length < TABLE_HEADER.size:
        raise CorruptMessageError(f"payload of {length} bytes is shorter than its table header")
    (count,) = TABLE_HEADER.unpack_from(src, 0)
    if TABLE_HEADER.size + count * TABLE_ENTRY.size > length:
        raise CorruptMessageError(f"array table of {count} entries overruns the {length}-byte payload")
    arrays = {}
    for i in range(count):
        raw_name, raw_dtype, n, offset = TABLE_ENTRY.unpack_from(src, TABLE_HEADER.size + i * TABLE_ENTRY.size)
        dtype = _dtype_from_code(raw_dtype)
        if offset % dtype.alignment or offset + n * dtype.itemsize > length:
            raise CorruptMessageError(f"array entry {i} ({n} x {dtype} at {offset}) lies outside the {length}-byte payload")
        arrays[_name_from_bytes(raw_name)] = src[offset : offset + n * dtype.itemsize].view(dtype)
    return arrays


@functools.lru_cache(maxsize=256)
def _dtype_from_code(code: bytes) -> np.dtype:
    try:
        dtype = np.dtype(code.rstrip(b"\0").decode("ascii"))
    except (TypeError, ValueError, UnicodeDecodeError) as exc:
        raise CorruptMessageError(f"array table holds an unknown dtype code {code!r}") from exc
    if dtype.kind not in SUPPORTED_DTYPE_KINDS:
        raise CorruptMessageError(f"array table holds an unsupported dtype {dtype}")
    return dtype


@functools.lru_cache(maxsize=256)
def _name_from_bytes(raw: bytes) -> str:
    try:
        return raw.rstrip(b"\0").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptMessageError(f"array table holds an undecodable name {raw!r}") from exc
