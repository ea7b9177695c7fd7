"""ZeroMQ doorbells: a waiting side sleeps in ``zmq.poll`` until the other side rings.

A bell carries no data; the ring counters are the truth. Every wait re-checks its
condition after draining the bell and before sleeping, and every ring happens after the
state change it announces, so a ring cannot be lost between the check and the sleep. A
ring that cannot be queued (receiver not connected yet, or already flooded with unread
rings) is dropped: in both cases the receiver re-checks the counters before it sleeps
again, and sleeps are capped at ``check_interval_s`` anyway.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import zmq

RECONNECT_INTERVAL_MS = 10
BELL_HIGH_WATER_MARK = 64


class BellSender:
    """Rings the bell whose receiver is bound at ``path``."""

    def __init__(self, context: zmq.Context, path: str) -> None:
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, BELL_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_INTERVAL_MS)
        self._socket.connect(f"ipc://{path}")

    def ring(self) -> None:
        try:
            self._socket.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self._socket.close(linger=0)


class BellReceiver:
    """Binds the socket file ``path`` and sleeps until someone rings."""

    def __init__(self, context: zmq.Context, path: str) -> None:
        self._socket = context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, BELL_HIGH_WATER_MARK)
        self._socket.bind(f"ipc://{path}")

    def drain(self) -> None:
        try:
            while True:
                self._socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass

    def sleep(self, timeout_s: float) -> None:
        self._socket.poll(max(1, math.ceil(timeout_s * 1000)), zmq.POLLIN)

    def close(self) -> None:
        self._socket.close(linger=0)


def wait_until(
    condition: Callable[[], bool],
    bell: BellReceiver,
    timeout_s: float | None,
    spin_s: float,
    check_interval_s: float,
    check_peer: Callable[[], None],
) -> bool:
    """Wait until ``condition()`` holds: spin for ``spin_s``, then sleep on ``bell``.

    While sleeping, wakes at least every ``check_interval_s`` to run ``check_peer`` (which
    raises when the other side is gone). Returns False when ``timeout_s`` (None: forever)
    elapses first.
    """
    if condition():
        return True
    now = time.monotonic()
    deadline = math.inf if timeout_s is None else now + timeout_s
    spin_until = min(now + spin_s, deadline)
    while time.monotonic() < spin_until:
        if condition():
            return True
    while True:
        bell.drain()
        if condition():
            return True
        check_peer()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        bell.sleep(min(remaining, check_interval_s))
