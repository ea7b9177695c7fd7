"""Byte layout of one message: a fixed slot header, then a table of named 1-D arrays and their bytes.

A slot is ``SLOT_HEADER_BYTES`` of header followed by the payload::

    header  : seq u64 | payload_len u64 | crc32 u32 | kind i32      (padded to 64 bytes)
    payload : count u32 | pad u32 | count * entry | array bytes
    entry   : name 32s (utf-8, NUL-padded) | dtype 8s (numpy dtype.str) | length u64 | offset u64

Offsets are relative to the payload start and aligned to ``ARRAY_ALIGN`` bytes so readers get
aligned numpy views. The CRC32 covers the whole payload (table and array bytes). Native
byte order and sizes are used throughout: both ends run on the same host.

This is the hot path of every message, and for a small message the Python bookkeeping
costs several times the copy of its bytes, so nothing is worked out twice:

* a ``PayloadLayout`` (where each array goes, and the packed table that says so) is made
  once per message shape by the writer and once per table by the reader, and kept in a
  ``LayoutCache``: the writer keys it by names, dtypes and shapes, the reader by the table
  bytes. A miss costs one validated plan or parse.
* the writer copies an array as ``payload[a:b] = array.tobytes()``: for small arrays that is
  about half the cost of a numpy slice assignment, and for large ones the extra copy is
  small next to the CRC32 pass over the same bytes.
* the reader keeps numpy views of each slot's payload, one per dtype (``TypedViews``), and
  hands out slices of them: ``np.frombuffer`` costs about three times as much as a slice.
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
MAX_CACHED_LAYOUTS = 256


class PayloadLayout(NamedTuple):
    """Where the arrays of one message shape lie in the payload, for each side, and the table that says so.

    ``copies`` (name, first byte, end byte) is what the writer copies where; ``views``
    (name, dtype, first item, end item of the payload viewed as dtype) is what the reader
    hands out. Both hold the arrays in table order.
    """

    copies: tuple[tuple[str, int, int], ...]
    views: tuple[tuple[str, np.dtype, int, int], ...]
    table: bytes
    length: int


def place_arrays(entries: list[tuple[str, np.dtype, int, int]], table: bytes) -> PayloadLayout:
    """The layout of arrays given as (name, dtype, length, byte offset), each offset a whole number of items."""
    copies, views = [], []
    length = len(table)
    for name, dtype, count, offset in entries:
        end = offset + count * dtype.itemsize
        first_item = offset // dtype.itemsize
        copies.append((name, offset, end))
        views.append((name, dtype, first_item, first_item + count))
        length = max(length, end)
    return PayloadLayout(tuple(copies), tuple(views), table, length)


class TypedViews(dict):
    """Views of one slot's payload as each dtype, made on first use and then kept.

    The payload is a multiple of ``ARRAY_ALIGN`` bytes, so it divides into whole items of
    every supported dtype.
    """

    def __init__(self, payload: memoryview) -> None:
        super().__init__()
        self.payload = payload

    def __missing__(self, dtype: np.dtype) -> np.ndarray:
        view = self[dtype] = np.frombuffer(self.payload, dtype)
        return view


class LayoutCache:
    """Layouts already made, by key; forgets them all once it holds ``MAX_CACHED_LAYOUTS``.

    A stream of messages repeats a few shapes; one whose shapes never repeat just pays a
    plan or parse per message, as it would without the cache.
    """

    def __init__(self) -> None:
        self._layouts: dict[object, PayloadLayout] = {}

    def for_arrays(self, arrays: Mapping[str, np.ndarray]) -> PayloadLayout:
        """The layout of ``arrays``; a new shape is validated first (IPCError names the offending array)."""
        shape = []
        try:
            for name, array in arrays.items():
                shape += (name, array.dtype, array.shape)
            key = tuple(shape)
            layout = self._layouts.get(key)
        except (AttributeError, TypeError):  # not a mapping of arrays: the planner says what is wrong
            return plan_payload(arrays)
        if layout is None:
            layout = self._remember(key, plan_payload(arrays))
        return layout

    def for_table(self, table: bytes) -> PayloadLayout:
        """The layout a packed array table describes; a new table is validated first (CorruptMessageError)."""
        layout = self._layouts.get(table)
        if layout is None:
            layout = self._remember(table, parse_table(table))
        return layout

    def _remember(self, key: object, layout: PayloadLayout) -> PayloadLayout:
        if len(self._layouts) >= MAX_CACHED_LAYOUTS:
            self._layouts.clear()
        self._layouts[key] = layout
        return layout


def align_up(n: int, alignment: int = ARRAY_ALIGN) -> int:
    return -(-n // alignment) * alignment


@functools.lru_cache(maxsize=64)
def table_struct(count: int) -> struct.Struct:
    return struct.Struct("@I4x" + ENTRY_FORMAT * count)


def plan_payload(arrays: Mapping[str, np.ndarray]) -> PayloadLayout:
    """Check every array and place it; raises IPCError naming the offending array."""
    offset = align_up(TABLE_HEADER.size + ENTRY_BYTES * len(arrays))
    entries = []
    fields: list = [len(arrays)]
    for name, array in arrays.items():
        encoded_name = _encoded_name(name)
        if not isinstance(array, np.ndarray):
            raise IPCError(f"array {name!r} must be a numpy ndarray, got {type(array).__name__}")
        if array.ndim != 1:
            raise IPCError(f"array {name!r} must be 1-D, got shape {array.shape}")
        dtype_code = _dtype_code(array.dtype, name)
        entries.append((name, array.dtype, len(array), offset))
        fields += (encoded_name, dtype_code, len(array), offset)
        offset = align_up(offset + array.nbytes)
    return place_arrays(entries, table_struct(len(arrays)).pack(*fields))


def parse_table(table: bytes) -> PayloadLayout:
    """The layout an array table describes; raises CorruptMessageError on an entry no writer makes."""
    (count,) = TABLE_HEADER.unpack_from(table)
    fields = table_struct(count).unpack(table)
    entries = []
    for i in range(1, 1 + 4 * count, 4):
        raw_name, raw_dtype, n, offset = fields[i : i + 4]
        dtype = _dtype_from_code(raw_dtype)
        if offset % dtype.itemsize:
            raise CorruptMessageError(f"array entry {i // 4} ({n} x {dtype}) starts at {offset}, not at a whole item")
        entries.append((_name_from_bytes(raw_name), dtype, n, offset))
    return place_arrays(entries, table)


def write_payload(payload: memoryview, arrays: Mapping[str, np.ndarray], layout: PayloadLayout) -> None:
    """Write the table and the array bytes of ``layout`` into ``payload``."""
    payload[: len(layout.table)] = layout.table
    for name, first_byte, end_byte in layout.copies:
        payload[first_byte:end_byte] = arrays[name].tobytes()


def read_payload(payload: memoryview, typed_views: TypedViews, length: int, layouts: LayoutCache) -> dict[str, np.ndarray]:
    """Views of the arrays in the first ``length`` bytes of ``payload``; raises CorruptMessageError on a bad table."""
    if length < TABLE_HEADER.size:
        raise CorruptMessageError(f"payload of {length} bytes is shorter than its table header")
    (count,) = TABLE_HEADER.unpack_from(payload)
    table_end = TABLE_HEADER.size + count * ENTRY_BYTES
    if table_end > length:
        raise CorruptMessageError(f"array table of {count} entries overruns the {length}-byte payload")
    layout = layouts.for_table(payload[:table_end].tobytes())
    if layout.length > length:
        raise CorruptMessageError(f"array table places arrays up to byte {layout.length} of the {length}-byte payload")
    arrays = {}
    for name, dtype, first_item, end_item in layout.views:
        arrays[name] = typed_views[dtype][first_item:end_item]
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
