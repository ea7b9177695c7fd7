"""Named POSIX shared-memory segments and their clean-up, including after a crash.

Segments are POSIX shared-memory objects (the same ones ``multiprocessing.shared_memory``
makes: files under /dev/shm on Linux), opened and mapped here directly rather than through
``SharedMemory`` for two reasons:

* ``SharedMemory.close()`` raises BufferError while any numpy view into the segment is
  alive, and its ``__del__`` then prints that error; handing out zero-copy views is the
  point of this package, so the mapping must instead live exactly as long as the last view.
  A mapping made with ``mmap`` and wrapped by numpy does that: it is unmapped when the last
  array referencing it is collected, never earlier.
* ``SharedMemory`` registers every segment, including merely attached ones, with
  multiprocessing's resource tracker, which then unlinks them or warns about "leaked"
  segments when some process exits (on Python < 3.13, where ``track=False`` does not
  exist). Ownership here is explicit instead: the creating process unlinks on close or at
  exit, and ``cleanup_orphans`` removes segments whose owner died without doing so.

Every name encodes the owner's pid (``<prefix>_pid<pid>_<token>_<tag>``), which is what lets
``cleanup_orphans`` decide, from the name alone, whether a segment's owner is gone. Socket
files of the ZeroMQ doorbells reuse the segment name plus a suffix.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import tempfile

import numpy as np

from ipc.liveness import process_alive

SHM_DIR = "/dev/shm"
NAME_PATTERN = re.compile(r"^(?P<prefix>.+)_pid(?P<pid>\d+)_(?P<token>[0-9a-f]{8})_(?P<tag>[a-z]+)(?P<suffix>\.[a-z.]+)?$")
PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*$")


def segment_name(prefix: str, owner_pid: int, token: str, tag: str) -> str:
    if not PREFIX_PATTERN.match(prefix):
        raise ValueError(f"name_prefix {prefix!r} must start with a letter or digit and hold only letters, digits, '.' and '-'")
    return f"{prefix}_pid{owner_pid}_{token}_{tag}"


def new_token() -> str:
    return secrets.token_hex(4)


def owner_pid_of(name: str) -> int | None:
    """The owner pid encoded in a segment or socket-file name, or None if the name is not ours."""
    match = NAME_PATTERN.match(name)
    return int(match["pid"]) if match else None


def create_segment(name: str, size: int) -> np.ndarray:
    """Create segment ``name`` of ``size`` zeroed bytes (fails if it exists) and map it as a uint8 array."""
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        return np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
    except BaseException:
        os.unlink(_path(name))
        raise
    finally:
        os.close(fd)


def attach_segment(name: str) -> np.ndarray:
    """Map the existing segment ``name`` as a uint8 array."""
    fd = os.open(_path(name), os.O_RDWR)
    try:
        return np.frombuffer(mmap.mmap(fd, os.fstat(fd).st_size), dtype=np.uint8)
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def segment_path(name: str) -> str:
    return _path(name)


def cleanup_orphans(prefix: str = "hetero", socket_dir: str | None = None) -> list[str]:
    """Remove segments (and doorbell socket files) named ``prefix...`` whose owner process is dead.

    Returns the removed paths. Entries of live owners, and entries whose names this package
    did not make, are left alone.
    """
    removed = []
    for directory in (SHM_DIR, socket_dir or tempfile.gettempdir()):
        try:
            entries = os.listdir(directory)
        except FileNotFoundError:
            continue
        for entry in entries:
            match = NAME_PATTERN.match(entry)
            if match and match["prefix"].startswith(prefix) and not process_alive(int(match["pid"])):
                path = os.path.join(directory, entry)
                unlink_quietly(path)
                removed.append(path)
    return removed


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)
