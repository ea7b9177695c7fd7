"""ZeroMQ doorbells: a waiting side sleeps in ``zmq.poll`` until the other side rings.

A bell carries no data; the ring counters are the truth. Rings are skipped while the other
side is not asleep (a spinning side sees the counters itself; a ZeroMQ send costs several
microseconds), which makes "am I asleep" and "did the state change" a Dekker-style pair:

    waiter:  waiting = 1 ; full_fence() ; check state    -> sleep if unchanged
    ringer:  change state ; full_fence() ; check waiting -> ring if set

With both fences at least one side sees the other's store, so either the waiter finds the
new state or the ringer rings. The waiter drains the bell before every re-check, and a
ring always follows the change it announces, so a ring cannot be lost between check and
sleep either. A ring that cannot be queued (receiver not connected yet, or already
flooded with unread rings) is dropped: the receiver re-checks the state before it sleeps
again, and sleeps are capped at ``check_interval_s`` anyway.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import zmq

RECONNECT_INTERVAL_MS = 10
BELL_HIGH_WATER_MARK = 64
_FENCE = threading.Lock()


def full_fence() -> None:
    """Order every earlier store before every later load (what x86 otherwise may swap).

    Python has no fence of its own; acquiring and releasing a CPython lock runs atomic
    read-modify-write instructions (sem_trywait/sem_post: ``lock cmpxchg``/``lock xadd`` on
    x86), and any locked instruction is a full barrier there.
    """
    _FENCE.acquire()
    _FENCE.release()


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


@dataclass
class Waiter:
    """How one side waits for one condition: spin for ``spin_s``, then sleep on ``bell``.

    The spin yields the CPU on every turn: when both sides share a core, a plain spin
    would hold that core while the side it waits for cannot run.

    ``set_waiting`` publishes whether we sleep (so the other side knows to ring);
    ``check_peer`` raises when the other side is gone and runs every ``check_interval_s``
    while we sleep.
    """

    bell: BellReceiver
    set_waiting: Callable[[bool], None]
    check_peer: Callable[[], None]
    spin_s: float
    check_interval_s: float

    def wait(self, condition: Callable[[], bool], timeout_s: float | None, spin_s: float | None = None) -> bool:
        """True once ``condition()`` holds; False when ``timeout_s`` (None: forever) elapses first.
        ``spin_s`` (None: the waiter's own) is how long to spin before sleeping."""
        if condition():
            return True
        now = time.monotonic()
        deadline = math.inf if timeout_s is None else now + timeout_s
        spin_until = min(now + (self.spin_s if spin_s is None else spin_s), deadline)
        while time.monotonic() < spin_until:
            if condition():
                return True
            os.sched_yield()
        next_check = time.monotonic() + self.check_interval_s
        self.set_waiting(True)
        try:
            while True:
                self.bell.drain()
                full_fence()
                if condition():
                    return True
                now = time.monotonic()
                if now >= next_check:
                    self.check_peer()
                    next_check = now + self.check_interval_s
                if now >= deadline:
                    self.check_peer()  # a dead peer is worth more than a timeout
                    return False
                self.bell.sleep(min(deadline, next_check) - now)
        finally:
            self.set_waiting(False)
