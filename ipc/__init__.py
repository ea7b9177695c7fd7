"""Shared-memory rings with ZeroMQ doorbells between two processes on one host.

Moves named 1-D numpy arrays plus a small int ``kind`` and knows nothing of what they mean.
Start with ``Channel.create`` (owner) / ``Channel.attach`` (peer); see ``ipc.channel``.
"""
from ipc.channel import Channel, ChannelSpec
from ipc.errors import (
    CorruptMessageError,
    IPCError,
    MessageTooLargeError,
    PeerDeadError,
    RecvTimeoutError,
    RingFullError,
)
from ipc.ring import Message
from ipc.segment import cleanup_orphans

__all__ = [
    "Channel",
    "ChannelSpec",
    "CorruptMessageError",
    "IPCError",
    "Message",
    "MessageTooLargeError",
    "PeerDeadError",
    "RecvTimeoutError",
    "RingFullError",
    "cleanup_orphans",
]
