"""A single-producer/single-consumer ring of fixed-size slots in one shared-memory segment.

Segment layout (native u64 words; each line is its own 64-byte cache line so the producer's
and the consumer's hot counters do not share one)::

    line 0 : magic | version | num_slots | slot_bytes
    line 1 : tail   - messages published; written by the producer only
    line 2 : head   - messages released; written by the consumer only
    line 3 : producer pid | start ticks | heartbeat (monotonic ns) | closed | waiting
    line 4 : consumer pid | start ticks | heartbeat (monotonic ns) | closed | waiting
    slots  : num_slots * (64-byte slot header + slot_bytes of payload)

Ordering: the producer writes the payload, then the slot header, then publishes ``tail``;
the consumer reads ``tail``, then the slot. x86 does not reorder stores with older stores
or loads with older loads, each counter is one aligned 8-byte store (the counters are read
and written through a memoryview cast to ``Q``, which CPython packs and unpacks with a
fixed 8-byte ``memcpy``: one ``mov``), and the interpreter cannot move memory accesses
across bytecodes, so a consumer that sees the new ``tail`` sees the finished slot. The
slot's own sequence number and CRC32 are checked on every read as a second line of defence.

The ``waiting`` words let a side skip ringing a doorbell nobody sleeps on. That is the one
place where x86 may reorder (a store with a later load), so both sides put a full fence
between "store my state" and "load the other's": see ``ipc.doorbell.full_fence``.

This module only moves bytes; waiting, doorbells and liveness live in ``ipc.channel``.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Mapping, NamedTuple

import numpy as np

from ipc.errors import CorruptMessageError, IPCError, MessageTooLargeError
from ipc.layout import SLOT_HEADER, SLOT_HEADER_BYTES, LayoutCache, PayloadLayout, TypedViews, align_up, read_payload, write_payload

MAGIC = 0x4845544552495043  # "HETERIPC"
VERSION = 1
LINE_WORDS = 8
CONTROL_BYTES = 5 * LINE_WORDS * 8
TAIL = 1 * LINE_WORDS
HEAD = 2 * LINE_WORDS
HEARTBEAT, CLOSED, WAITING = 2, 3, 4  # word offsets within an endpoint line


class Role(IntEnum):
    """Which end of a ring a process holds; the value is the word index of its endpoint line."""

    PRODUCER = 3 * LINE_WORDS
    CONSUMER = 4 * LINE_WORDS


@dataclass(frozen=True)
class Endpoint:
    """What one end of a ring last said about itself."""

    pid: int
    start_ticks: int
    heartbeat_ns: int
    closed: bool


class Message(NamedTuple):
    """One received message.

    ``arrays`` are read-only numpy views into the ring slot: they stay valid only until the
    receiver releases the slot (``release()`` or the next receive); after that the producer
    may overwrite them. Use ``copy()`` to keep a message longer.
    """

    kind: int
    arrays: Mapping[str, np.ndarray]
    seq: int = -1

    def copy(self) -> "Message":
        return Message(self.kind, {name: array.copy() for name, array in self.arrays.items()}, self.seq)


def segment_bytes(num_slots: int, slot_bytes: int) -> int:
    return CONTROL_BYTES + num_slots * (SLOT_HEADER_BYTES + align_up(slot_bytes))


def control_words(raw: np.ndarray) -> memoryview:
    """The control lines of a segment as native u64 words."""
    return memoryview(raw)[:CONTROL_BYTES].cast("Q")


class RingSegment:
    """The mapped segment of one ring: its geometry, counters and endpoint lines."""

    def __init__(self, name: str, raw: np.ndarray) -> None:
        self.name = name
        self.raw = raw
        self.words = control_words(raw)
        if self.words[0] != MAGIC or self.words[1] != VERSION:
            raise IPCError(f"shared-memory segment {name!r} is not a version-{VERSION} hetero ring")
        self.num_slots = self.words[2]
        self.slot_bytes = self.words[3]
        self.slot_stride = SLOT_HEADER_BYTES + align_up(self.slot_bytes)
        if raw.size < segment_bytes(self.num_slots, self.slot_bytes):
            raise IPCError(f"shared-memory segment {name!r} is smaller than its header says")

    @staticmethod
    def format(raw: np.ndarray, num_slots: int, slot_bytes: int) -> None:
        """Write a fresh ring header into a zeroed segment."""
        words = control_words(raw)
        words[2], words[3] = num_slots, slot_bytes
        words[1] = VERSION
        words[0] = MAGIC

    def slots(self, writable: bool) -> list[tuple[memoryview, memoryview]]:
        """Every slot's header and payload bytes; read-only ones for the reader, so the arrays it hands out are too."""
        memory = memoryview(self.raw) if writable else memoryview(self.raw).toreadonly()
        starts = range(CONTROL_BYTES, CONTROL_BYTES + self.num_slots * self.slot_stride, self.slot_stride)
        return [(memory[start : start + SLOT_HEADER_BYTES], memory[start + SLOT_HEADER_BYTES : start + self.slot_stride]) for start in starts]

    def endpoint(self, role: Role) -> Endpoint:
        pid, ticks, beat, closed = self.words[role : role + 4].tolist()
        return Endpoint(pid, ticks, beat, bool(closed))

    def claim(self, role: Role, pid: int, start_ticks: int) -> None:
        self.words[role + 1] = start_ticks
        self.words[role + HEARTBEAT] = time.monotonic_ns()
        self.words[role] = pid

    def beat(self, role: Role) -> None:
        self.words[role + HEARTBEAT] = time.monotonic_ns()

    def mark_closed(self, role: Role) -> None:
        self.words[role + CLOSED] = 1

    def set_waiting(self, role: Role, waiting: bool) -> None:
        self.words[role + WAITING] = waiting


class RingWriter:
    """The producer end: ``put`` a message into the next free slot."""

    def __init__(self, segment: RingSegment) -> None:
        self.segment = segment
        self._words = segment.words
        self._slots = segment.slots(writable=True)
        self._num_slots = segment.num_slots
        self._layouts = LayoutCache()
        self._consumer_waiting = Role.CONSUMER + WAITING
        self._tail = segment.words[TAIL]

    def layout(self, arrays: Mapping[str, np.ndarray]) -> PayloadLayout:
        """Validate ``arrays`` and check that they fit one slot."""
        layout = self._layouts.for_arrays(arrays)
        if layout.length > self.segment.slot_bytes:
            sizes = ", ".join(f"{name}: {end - first} x {dtype}" for name, dtype, first, end in layout.views)
            raise MessageTooLargeError(
                f"message of {layout.length} bytes ({sizes}) does not fit a {self.segment.slot_bytes}-byte slot "
                f"of ring {self.segment.name!r}; create the channel with a larger slot_bytes"
            )
        return layout

    def has_space(self) -> bool:
        return self._tail - self._words[HEAD] < self._num_slots

    def put(self, kind: int, arrays: Mapping[str, np.ndarray], layout: PayloadLayout) -> None:
        """Write and publish one message; the caller has checked ``has_space()``."""
        header, payload = self._slots[self._tail % self._num_slots]
        write_payload(payload, arrays, layout)
        SLOT_HEADER.pack_into(header, 0, self._tail, layout.length, zlib.crc32(payload[: layout.length]), kind)
        self._tail += 1
        self._words[TAIL] = self._tail

    def consumer_waiting(self) -> bool:
        """Whether the consumer sleeps on its doorbell; read after a full fence (see the module docstring)."""
        return self._words[self._consumer_waiting] != 0


class RingReader:
    """The consumer end: ``get`` the oldest message as views, ``release`` its slot when done.

    The slots of the messages taken since the last ``release`` stay the reader's until it
    releases them all at once.
    """

    def __init__(self, segment: RingSegment) -> None:
        self.segment = segment
        self._words = segment.words
        self._slots = [(header, payload, TypedViews(payload)) for header, payload in segment.slots(writable=False)]
        self._num_slots = segment.num_slots
        self._layouts = LayoutCache()
        self._producer_waiting = Role.PRODUCER + WAITING
        self._next = segment.words[HEAD]

    def has_message(self) -> bool:
        return self._words[TAIL] != self._next

    def release(self) -> bool:
        """Hand the slots of the messages taken back to the producer; False when none were held."""
        if self._words[HEAD] == self._next:
            return False
        self._words[HEAD] = self._next
        return True

    def producer_waiting(self) -> bool:
        """Whether the producer sleeps on its doorbell; read after a full fence (see the module docstring)."""
        return self._words[self._producer_waiting] != 0

    def get(self) -> Message:
        """Take the oldest published message; the caller has checked ``has_message()``.

        A corrupt message is consumed (its slot is freed by the next release) and reported
        with CorruptMessageError.
        """
        seq = self._next
        self._next += 1
        header, payload, typed_views = self._slots[seq % self._num_slots]
        slot_seq, length, crc, kind = SLOT_HEADER.unpack_from(header)
        if slot_seq != seq:
            raise CorruptMessageError(f"ring {self.segment.name!r}: slot holds message #{slot_seq}, expected #{seq}")
        if length > self.segment.slot_bytes:
            raise CorruptMessageError(f"ring {self.segment.name!r}: message #{seq} claims {length} bytes, slots hold {self.segment.slot_bytes}")
        actual = zlib.crc32(payload[:length])
        if actual != crc:
            raise CorruptMessageError(
                f"ring {self.segment.name!r}: checksum mismatch in message #{seq} (stored {crc:#010x}, computed {actual:#010x})"
            )
        return Message(kind, read_payload(payload, typed_views, length, self._layouts), seq)
