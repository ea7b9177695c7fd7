"""Byte layout of one message: a fixed slot header, then a table of named 1-D arrays and their bytes.

A slot is ``SLOT_HEADER_BYTES`` of header followed by the payload::

    header  : seq u64 | payload_len u64 | crc32 u32 | kind i32      (padded to 64 bytes)
    payload : count u32 | pad u32 | count * entry | array bytes
    entry   : name 32s (utf-8, NUL-padded) | dtype 8s (numpy dtype.str) | length u64 | offset u64

Offsets are relative to the payload start and aligned to ``ARRAY_ALIGN`` bytes so readers get
aligned numpy views. The CRC32 covers the whole payload (table and array bytes). Native
byte order and sizes are used throughout: both ends run on the same host.

This is the hot path of every message, so validation results are cached per name and
dtype and the whole table is packed and unpacked with one struct call.
"""
from __future__ import annotations

import functools
import struct
from typing import Mapping, NamedTuple

import numpy as np

from ipc.errors import CorruptMessageError, IPCError

SLOT_HEADER = struct.Struct("@QQIi")
SLOT_HEADER_BYTES = 64
TABLE_HEADER = struct.Struct("@I4x")
ENTRY_FORMAT = "32s8sQQ"
ENTRY_BYTES = struct.calcsize("@" + ENTRY_FORMAT)
MAX_NAME_BYTES = 32
ARRAY_ALIGN = 64
SUPPORTED_DTYPE_KINDS = "biufc"


class ArrayEntry(NamedTuple):
    """Where one named array lives inside a payload."""

    name: str
    dtype: np.dtype
    length: int
    offset: int
    nbytes: int


class PayloadPlan(NamedTuple):
    """The placed arrays of a payload, its total length, and its packed-table arguments."""

    entries: tuple[ArrayEntry, ...]
    length: int
    table_fields: tuple


def align_up(n: int, alignment: int = ARRAY_ALIGN) -> int:
    return -(-n // alignment) * alignment


@functools.lru_cache(maxsize=64)
def table_struct(count: int) -> struct.Struct:
    return struct.Struct("@I4x" + ENTRY_FORMAT * count)


def plan_payload(arrays: Mapping[str, np.ndarray]) -> PayloadPlan:
    """Check every array and place it; raises IPCError naming the offending array."""
    offset = align_up(TABLE_HEADER.size + ENTRY_BYTES * len(arrays))
    entries = []
    fields: list = [len(arrays)]
    end = TABLE_HEADER.size
    for name, array in arrays.items():
        encoded_name = _encoded_name(name)
        if not isinstance(array, np.ndarray):
            raise IPCError(f"array {name!r} must be a numpy ndarray, got {type(array).__name__}")
        if array.ndim != 1:
            raise IPCError(f"array {name!r} must be 1-D, got shape {array.shape}")
        dtype_code = _dtype_code(array.dtype, name)
        entry = ArrayEntry(name, array.dtype, len(array), offset, array.nbytes)
        entries.append(entry)
        fields += (encoded_name, dtype_code, entry.length, offset)
        end = offset + entry.nbytes
        offset = align_up(end)
    return PayloadPlan(tuple(entries), end, tuple(fields))


def write_payload(dest: np.ndarray, arrays: Mapping[str, np.ndarray], plan: PayloadPlan) -> None:
    """Write the table and the array bytes of ``plan`` into ``dest`` (a uint8 array of at least ``plan.length``)."""
    table_struct(len(plan.entries)).pack_into(dest, 0, *plan.table_fields)
    raw = memoryview(dest)
    for entry in plan.entries:
        array = arrays[entry.name]
        if array.flags.c_contiguous:
            raw[entry.offset : entry.offset + entry.nbytes] = array.view(np.uint8)
        else:
            dest[entry.offset : entry.offset + entry.nbytes].view(entry.dtype)[...] = array


def read_payload(src: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """Numpy views of the arrays in the payload ``src[:length]``; raises CorruptMessageError on a bad table."""
    if length < TABLE_HEADER.size:
        raise CorruptMessageError(f"payload of {length} bytes is shorter than its table header")
    (count,) = TABLE_HEADER.unpack_from(src, 0)
    if TABLE_HEADER.size + count * ENTRY_BYTES > length:
        raise CorruptMessageError(f"array table of {count} entries overruns the {length}-byte payload")
    fields = table_struct(count).unpack_from(src, 0)
    arrays = {}
    for i in range(1, 1 + 4 * count, 4):
        raw_name, raw_dtype, n, offset = fields[i : i + 4]
        dtype = _dtype_from_code(raw_dtype)
        if offset % dtype.alignment or offset + n * dtype.itemsize > length:
            raise CorruptMessageError(f"array entry {i // 4} ({n} x {dtype} at {offset}) lies outside the {length}-byte payload")
        arrays[_name_from_bytes(raw_name)] = np.frombuffer(src, dtype, n, offset)
    return arrays


@functools.lru_cache(maxsize=1024)
def _encoded_name(name: object) -> bytes:
    if not isinstance(name, str) or not name or "\0" in name:
        raise IPCError(f"array names must be non-empty strings without NUL, got {name!r}")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise IPCError(f"array name {name!r} cannot be encoded as utf-8") from exc
    if len(encoded) > MAX_NAME_BYTES:
        raise IPCError(f"array name {name!r} is longer than {MAX_NAME_BYTES} bytes in utf-8")
    return encoded


@functools.lru_cache(maxsize=256)
def _dtype_code(dtype: np.dtype, name: str) -> bytes:
    if dtype.kind not in SUPPORTED_DTYPE_KINDS or dtype.fields is not None:
        raise IPCError(f"array {name!r} has unsupported dtype {dtype} (bool, int, uint, float, complex only)")
    return dtype.str.encode("ascii")


@functools.lru_cache(maxsize=256)
def _dtype_from_code(code: bytes) -> np.dtype:
    try:
        dtype = np.dtype(code.rstrip(b"\0").decode("ascii"))
    except (TypeError, ValueError, UnicodeDecodeError) as exc:
        raise CorruptMessageError(f"array table holds an unknown dtype code {code!r}") from exc
    if dtype.kind not in SUPPORTED_DTYPE_KINDS:
        raise CorruptMessageError(f"array table holds an unsupported dtype {dtype}")
    return dtype


@functools.lru_cache(maxsize=1024)
def _name_from_bytes(raw: bytes) -> str:
    try:
        return raw.rstrip(b"\0").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptMessageError(f"array table holds an undecodable name {raw!r}") from exc
