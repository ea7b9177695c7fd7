"""A duplex channel between the coordinator (owner) and one worker process (peer).

Two SPSC rings - ``to_peer`` (requests) and ``to_owner`` (responses) - plus four ZeroMQ
doorbells: per ring, a *data* bell (producer -> consumer: "a message is ready") and a
*space* bell (consumer -> producer: "a slot is free"). Each side binds the bells it waits
on and connects to the ones it rings; all socket files, like the segments, are named
after the owner and removed by the owner.

Liveness: each side stamps its pid, process start time and a heartbeat into the endpoint
lines of both segments (a background thread beats every ``heartbeat_timeout_s / 4``, so
a peer busy in a long computation still counts as alive). While one side waits, it checks
at least every ``check_interval_s`` whether the other side closed, exited (also as an
unreaped zombie) or stopped beating, and raises PeerDeadError if so: a killed peer is
noticed within ``check_interval_s``, a hung one within ``heartbeat_timeout_s +
check_interval_s``. Messages that were already published are still delivered first.

Threads: ``send`` may run in one thread while ``recv``/``release`` run in another (each
direction touches only its own ring and sockets); otherwise a Channel is not thread-safe.
A Channel joins exactly one owner and one peer: to replace a dead worker, close the
channel and create a new one.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import zmq

from ipc.doorbell import BellReceiver, BellSender, Waiter, full_fence
from ipc.errors import IPCError, PeerDeadError, RecvTimeoutError, RingFullError
from ipc.liveness import process_alive, process_start_ticks
from ipc.ring import Message, RingReader, RingSegment, RingWriter, Role, segment_bytes
from ipc.segment import (
    attach_segment,
    cleanup_orphans,
    create_segment,
    new_token,
    segment_name,
    segment_path,
    unlink_quietly,
)

MAX_SOCKET_PATH_BYTES = 107  # sun_path of a Unix-domain socket, less the terminating NUL
KIND_MIN, KIND_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class ChannelSpec:
    """What a peer process needs to attach: picklable, or pass ``dataclasses.asdict(spec)``."""

    to_peer: str
    to_owner: str
    socket_dir: str
    owner_pid: int
    heartbeat_timeout_s: float
    check_interval_s: float
    spin_s: float

    def bell_path(self, segment: str, bell: str) -> str:
        return os.path.join(self.socket_dir, f"{segment}.{bell}.sock")

    def socket_paths(self) -> list[str]:
        return [self.bell_path(s, b) for s in (self.to_peer, self.to_owner) for b in ("data", "space")]


class Channel:
    """One end of a duplex shared-memory channel; make it with ``create`` (owner) or ``attach`` (peer)."""

    @classmethod
    def create(
        cls,
        name_prefix: str = "hetero",
        num_slots: int = 8,
        slot_bytes: int = 1 << 16,
        *,
        heartbeat_timeout_s: float = 2.0,
        check_interval_s: float = 0.05,
        spin_s: float = 100e-6,
        socket_dir: str | None = None,
    ) -> "Channel":
        """Create both rings and bind the owner's doorbells.

        Removes orphans of earlier crashed owners with the same prefix first.
        ``slot_bytes`` is the largest payload (array table plus array bytes) one message may have.
        A waiting side spins for ``spin_s`` before it sleeps on its doorbell, and while asleep
        checks the peer's liveness every ``check_interval_s``.
        """
        _require(isinstance(num_slots, int) and num_slots >= 1, f"num_slots must be an int >= 1, got {num_slots!r}")
        _require(isinstance(slot_bytes, int) and slot_bytes >= 64, f"slot_bytes must be an int >= 64, got {slot_bytes!r}")
        _require(heartbeat_timeout_s > 0, f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s!r}")
        _require(check_interval_s > 0, f"check_interval_s must be > 0, got {check_interval_s!r}")
        _require(spin_s >= 0, f"spin_s must be >= 0, got {spin_s!r}")
        pid, token = os.getpid(), new_token()
        spec = ChannelSpec(
            to_peer=segment_name(name_prefix, pid, token, "req"),
            to_owner=segment_name(name_prefix, pid, token, "rsp"),
            socket_dir=os.path.abspath(socket_dir or tempfile.gettempdir()),
            owner_pid=pid,
            heartbeat_timeout_s=float(heartbeat_timeout_s),
            check_interval_s=float(check_interval_s),
            spin_s=float(spin_s),
        )
        longest = max(spec.socket_paths(), key=len)
        _require(
            len(longest.encode()) <= MAX_SOCKET_PATH_BYTES,
            f"socket_dir {spec.socket_dir!r} is too long: doorbell socket path {longest!r} exceeds {MAX_SOCKET_PATH_BYTES} bytes",
        )
        cleanup_orphans(name_prefix, spec.socket_dir)
        raws = []
        try:
            for name in (spec.to_peer, spec.to_owner):
                raws.append(create_segment(name, segment_bytes(num_slots, slot_bytes)))
                RingSegment.format(raws[-1], num_slots, slot_bytes)
            return cls(spec, is_owner=True, raws=raws)
        except BaseException:
            for path in [segment_path(spec.to_peer), segment_path(spec.to_owner), *spec.socket_paths()]:
                unlink_quietly(path)
            raise

    @classmethod
    def attach(cls, spec: ChannelSpec | Mapping) -> "Channel":
        """Attach to a channel made by ``create`` in another process, as its one peer."""
        if not isinstance(spec, ChannelSpec):
            spec = ChannelSpec(**spec)
        try:
            raws = [attach_segment(spec.to_peer), attach_segment(spec.to_owner)]
        except FileNotFoundError as exc:
            raise PeerDeadError(f"channel segment {exc.filename!r} does not exist: its owner (pid {spec.owner_pid}) closed it or died") from exc
        return cls(spec, is_owner=False, raws=raws)

    def __init__(self, spec: ChannelSpec, *, is_owner: bool, raws: list[np.ndarray]) -> None:
        """Use ``create`` or ``attach``."""
        self.spec = spec
        self.is_owner = is_owner
        requests, responses = RingSegment(spec.to_peer, raws[0]), RingSegment(spec.to_owner, raws[1])
        out_ring, in_ring = (requests, responses) if is_owner else (responses, requests)
        if not is_owner:
            _check_attachable(requests, spec)
        pid = os.getpid()
        ticks = process_start_ticks(pid)
        out_ring.claim(Role.PRODUCER, pid, ticks)
        in_ring.claim(Role.CONSUMER, pid, ticks)
        self._writer = RingWriter(out_ring)
        self._reader = RingReader(in_ring)
        resources = _Resources(
            endpoints=[(out_ring, Role.PRODUCER), (in_ring, Role.CONSUMER)],
            owned_paths=[segment_path(spec.to_peer), segment_path(spec.to_owner), *spec.socket_paths()] if is_owner else [],
        )
        self._finalizer = weakref.finalize(self, _release, resources)
        try:
            context = resources.context = zmq.Context(io_threads=1)
            space_bell = resources.add(BellReceiver(context, spec.bell_path(out_ring.name, "space")))
            data_bell = resources.add(BellReceiver(context, spec.bell_path(in_ring.name, "data")))
            self._data_sender = resources.add(BellSender(context, spec.bell_path(out_ring.name, "data")))
            self._space_sender = resources.add(BellSender(context, spec.bell_path(in_ring.name, "space")))
            resources.heartbeat = _Heartbeat(resources.endpoints, spec.heartbeat_timeout_s / 4)
        except BaseException:
            self._finalizer()
            raise
        check_peer = functools.partial(_check_peer, out_ring, spec)
        self._space_waiter = Waiter(
            space_bell, functools.partial(out_ring.set_waiting, Role.PRODUCER), check_peer, spec.spin_s, spec.check_interval_s
        )
        self._data_waiter = Waiter(
            data_bell, functools.partial(in_ring.set_waiting, Role.CONSUMER), check_peer, spec.spin_s, spec.check_interval_s
        )

    @property
    def name(self) -> str:
        return _channel_name(self.spec)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def peer_pid(self) -> int:
        """The other side's pid; 0 while no peer has attached yet."""
        return self._writer.segment.endpoint(Role.CONSUMER).pid

    def send(self, kind: int, arrays: Mapping[str, np.ndarray], timeout: float | None = None) -> None:
        """Copy ``arrays`` (named 1-D numpy arrays) into the next free slot and ring the peer.

        Blocks while the ring is full (backpressure) for up to ``timeout`` seconds (None:
        until a slot frees), then raises RingFullError. Raises MessageTooLargeError if the
        message cannot fit a slot, PeerDeadError if the peer dies while we wait.
        """
        self._require_open()
        if type(kind) is not int or not KIND_MIN <= kind <= KIND_MAX:
            kind = _checked_kind(kind)
        layout = self._writer.layout(arrays)
        if not self._space_waiter.wait(self._writer.has_space, timeout):
            raise RingFullError(
                f"channel {self.name}: all {self._writer.segment.num_slots} slots stayed full for {timeout} s; "
                f"the peer (pid {self.peer_pid}) is not receiving"
            )
        self._writer.put(kind, arrays, layout)
        full_fence()
        if self._writer.consumer_waiting():
            self._data_sender.ring()

    def can_send(self) -> bool:
        """Whether a slot is free now (a `send` would not wait)."""
        self._require_open()
        return self._writer.has_space()

    def recv(self, timeout: float | None = None, spin_s: float | None = None) -> Message:
        """Release the previous message and return the next one, waiting up to ``timeout`` s (None: forever).

        ``spin_s`` overrides the channel's spin before sleeping, for a wait whose answer is due
        soon (a reply, the next step's request): waking from a sleep costs more than the spin.

        The returned arrays are read-only views into shared memory, valid until the next
        ``recv``/``try_recv``/``release``/``close``; ``Message.copy()`` keeps them longer.
        Raises RecvTimeoutError on timeout, PeerDeadError if the peer dies while we wait,
        CorruptMessageError if the message fails its checksum (it is dropped).
        """
        self.release()
        if not self._data_waiter.wait(self._reader.has_message, timeout, spin_s):
            raise RecvTimeoutError(f"channel {self.name}: no message from the peer (pid {self.peer_pid}) within {timeout} s")
        return self._reader.get()

    def try_recv(self) -> Message | None:
        """Like ``recv`` but never waits: None when no message is ready."""
        self.release()
        return self._reader.get() if self._reader.has_message() else None

    def release(self) -> None:
        """Free the slot of the message last received (its views become invalid) and ring the producer."""
        self._require_open()
        if self._reader.release():
            full_fence()
            if self._reader.producer_waiting():
                self._space_sender.ring()

    def close(self) -> None:
        """Mark this end closed for the peer, stop the heartbeat, close the sockets; the owner also
        removes the segments and socket files. Idempotent; also runs at garbage collection and exit."""
        self._finalizer()

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _require_open(self) -> None:
        if not self._finalizer.alive:
            raise IPCError(f"channel {self.name} is closed")


def _check_peer(out_ring: RingSegment, spec: ChannelSpec) -> None:
    """Raise PeerDeadError if the peer closed, exited or stopped beating (the peer consumes our out ring)."""
    peer = out_ring.endpoint(Role.CONSUMER)
    name = _channel_name(spec)
    if peer.closed:
        raise PeerDeadError(f"channel {name}: the peer (pid {peer.pid}) closed its end")
    if peer.pid == 0:
        return
    if not process_alive(peer.pid, peer.start_ticks):
        raise PeerDeadError(f"channel {name}: the peer process (pid {peer.pid}) is gone")
    silent_s = (time.monotonic_ns() - peer.heartbeat_ns) / 1e9
    if silent_s > spec.heartbeat_timeout_s:
        raise PeerDeadError(
            f"channel {name}: the peer (pid {peer.pid}) has not beaten for {silent_s:.2f} s "
            f"(heartbeat_timeout_s={spec.heartbeat_timeout_s})"
        )


def _channel_name(spec: ChannelSpec) -> str:
    return spec.to_peer.removesuffix("_req")


def _checked_kind(kind: object) -> int:
    _require(isinstance(kind, (int, np.integer)) and KIND_MIN <= kind <= KIND_MAX, f"kind must be an int32, got {kind!r}")
    return int(kind)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_attachable(requests: RingSegment, spec: ChannelSpec) -> None:
    owner = requests.endpoint(Role.PRODUCER)
    if owner.closed or not process_alive(owner.pid, owner.start_ticks):
        raise PeerDeadError(f"channel owner (pid {spec.owner_pid}) has closed or died")
    previous = requests.endpoint(Role.CONSUMER)
    if previous.pid != 0:
        raise IPCError(f"channel {spec.to_peer!r} already had a peer (pid {previous.pid}); create a new channel for a new peer")


class _Heartbeat:
    """A daemon thread stamping the monotonic clock into our endpoint lines."""

    def __init__(self, endpoints: list[tuple[RingSegment, Role]], interval_s: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_beat, args=(endpoints, interval_s, self._stop), name="hetero-ipc-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _beat(endpoints: list[tuple[RingSegment, Role]], interval_s: float, stop: threading.Event) -> None:
    while not stop.wait(interval_s):
        for segment, role in endpoints:
            segment.beat(role)


@dataclass
class _Resources:
    """What a Channel must give back; held by its finalizer, which must not reference the Channel."""

    endpoints: list[tuple[RingSegment, Role]]
    owned_paths: list[str]
    bells: list[BellSender | BellReceiver] = dataclasses.field(default_factory=list)
    context: zmq.Context | None = None
    heartbeat: _Heartbeat | None = None

    def add(self, bell):
        self.bells.append(bell)
        return bell


def _release(resources: _Resources) -> None:
    """Close one end. Mappings are not unmapped here: they go when the last numpy view does."""
    if resources.heartbeat is not None:
        resources.heartbeat.stop()
    for segment, role in resources.endpoints:
        segment.mark_closed(role)
    for bell in resources.bells:
        bell.close()
    if resources.context is not None:
        resources.context.term()
    for path in resources.owned_paths:
        unlink_quietly(path)
