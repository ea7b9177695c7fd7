"""Errors raised by the ipc package; every one says which ring or peer it is about."""
from __future__ import annotations


class IPCError(Exception):
    """Base class for every error the ipc package raises."""


class MessageTooLargeError(IPCError, ValueError):
    """A message does not fit into one ring slot."""


class CorruptMessageError(IPCError):
    """A slot's sequence number, array table or CRC32 checksum does not match its payload."""


class RingFullError(IPCError, TimeoutError):
    """The peer freed no slot before the send timeout (backpressure gave up)."""


class RecvTimeoutError(IPCError, TimeoutError):
    """No message arrived before the receive timeout."""


class PeerDeadError(IPCError):
    """The process on the other end exited, was killed, closed its end or stopped its heartbeat."""
