"""Shared-memory rings and channels: round trips, backpressure, corruption, dead peers, clean-up."""
from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import tempfile
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ipc import (
    Channel,
    CorruptMessageError,
    IPCError,
    MessageTooLargeError,
    PeerDeadError,
    RecvTimeoutError,
    RingFullError,
    cleanup_orphans,
)
from ipc.layout import MAX_CACHED_LAYOUTS, SLOT_HEADER_BYTES, parse_table, table_struct
from ipc.ring import CONTROL_BYTES, RingReader, RingSegment, RingWriter, segment_bytes
from ipc.segment import SHM_DIR, attach_segment, create_segment, new_token, segment_name, segment_path, unlink_quietly

PREFIX = "hetero-test"
STOP = 99
PAIR_SLOT_BYTES = 2048
NEVER_CHECK_S = 60.0  # a liveness-check interval so long that only a doorbell can wake a sleeper
SPAWN = multiprocessing.get_context("spawn")


def leftovers(channel_name: str) -> list[str]:
    """Segments and socket files of one channel that still exist."""
    shm = [f"{SHM_DIR}/{e}" for e in os.listdir(SHM_DIR) if e.startswith(channel_name)]
    tmp = tempfile.gettempdir()
    return shm + [f"{tmp}/{e}" for e in os.listdir(tmp) if e.startswith(channel_name)]


def tree_message(n: int, offset: int = 0) -> dict[str, np.ndarray]:
    return {
        "tokens": np.arange(offset, offset + n, dtype=np.int64),
        "parents": np.arange(-1, n - 1, dtype=np.int32),
    }


@pytest.fixture
def pair():
    """An owner and a peer end of one channel in this process (3 slots of 2 KiB)."""
    owner = Channel.create(PREFIX, num_slots=3, slot_bytes=PAIR_SLOT_BYTES)
    peer = Channel.attach(owner.spec)
    yield owner, peer
    peer.close()
    owner.close()
    assert leftovers(owner.name) == []


def test_round_trips_wrap_around_many_times(pair):
    owner, peer = pair
    for i in range(40):
        batch = 1 + i % 3  # 1..3 messages in flight, so the slot index wraps at every phase
        for j in range(batch):
            owner.send(kind=j, arrays=tree_message(1 + (i + j) % 60, offset=1000 * i + j), timeout=1)
        for j in range(batch):
            msg = peer.recv(timeout=1)
            expected = tree_message(1 + (i + j) % 60, offset=1000 * i + j)
            assert msg.kind == j
            assert set(msg.arrays) == {"tokens", "parents"}
            for name, array in expected.items():
                assert msg.arrays[name].dtype == array.dtype
                np.testing.assert_array_equal(msg.arrays[name], array)
        peer.release()  # the held message occupies a slot until released
        reply = {"accepted": np.array([i], dtype=np.int32)}
        peer.send(7, reply, timeout=1)
        assert owner.recv(timeout=1).arrays["accepted"][0] == i


def test_views_are_read_only_and_copy_outlives_the_slot(pair):
    owner, peer = pair
    owner.send(1, {"x": np.full(8, 5, dtype=np.int64)})
    msg = peer.recv(timeout=1)
    kept = msg.copy()
    with pytest.raises(ValueError):
        msg.arrays["x"][0] = 0
    for value in range(6, 6 + 3):  # cycle through all 3 slots: the first one is rewritten
        owner.send(1, {"x": np.full(8, value, dtype=np.int64)})
        peer.recv(timeout=1)
    assert msg.arrays["x"][0] == 8  # the stale view now shows what the producer wrote last
    np.testing.assert_array_equal(kept.arrays["x"], np.full(8, 5))


def test_full_ring_times_out_then_a_release_wakes_a_blocked_sender():
    owner = Channel.create(PREFIX, num_slots=2, slot_bytes=256, spin_s=0, check_interval_s=NEVER_CHECK_S)
    peer = Channel.attach(owner.spec)
    try:
        owner.send(0, tree_message(4))
        owner.send(1, tree_message(4))
        started = time.monotonic()
        with pytest.raises(RingFullError, match="2 slots stayed full"):
            owner.send(2, tree_message(4), timeout=0.2)
        assert time.monotonic() - started >= 0.2

        outcome = []
        sender = threading.Thread(target=lambda: outcome.append(owner.send(2, tree_message(4, 2), timeout=20)))
        sender.start()
        time.sleep(0.1)
        assert sender.is_alive() and not outcome  # blocked by backpressure
        assert peer.recv(timeout=1).kind == 0
        peer.release()  # frees a slot and rings the space bell; nothing else can wake the sender
        sender.join(timeout=20)
        assert outcome == [None]
        assert [peer.recv(timeout=1).kind for _ in range(2)] == [1, 2]
        with pytest.raises(RecvTimeoutError):
            peer.recv(timeout=0.05)
    finally:
        peer.close()
        owner.close()


array_sets = st.dictionaries(
    keys=st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), min_size=1, max_size=8),
    values=st.sampled_from(["int64", "int32", "float32", "float16", "float64", "uint8", "int8", "bool", "complex64"]).flatmap(
        lambda dtype: hnp.arrays(dtype, st.integers(0, 300))
    ),
    max_size=5,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(messages=st.lists(st.tuples(st.integers(-(2**31), 2**31 - 1), array_sets), min_size=1, max_size=3))
def test_random_array_sets_round_trip_bit_exactly_or_are_refused(pair, messages):
    owner, peer = pair
    sent = []
    for kind, arrays in messages:
        raw = sum(a.nbytes for a in arrays.values())
        worst_case = raw + 8 + len(arrays) * (56 + 64) + 64
        try:
            owner.send(kind, arrays, timeout=1)
        except MessageTooLargeError:
            assert worst_case > PAIR_SLOT_BYTES, "a message that surely fits was refused"
            continue
        assert raw <= PAIR_SLOT_BYTES, "a message larger than a slot was accepted"
        sent.append((kind, arrays))
    for kind, arrays in sent:
        msg = peer.recv(timeout=1)
        assert msg.kind == kind
        assert list(msg.arrays) == list(arrays)
        for name, array in arrays.items():
            got = msg.arrays[name]
            assert got.dtype == array.dtype and got.shape == array.shape
            assert got.tobytes() == array.tobytes()
    assert peer.try_recv() is None  # also releases the last slot for the next example


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(CONTROL_BYTES + SLOT_HEADER_BYTES + 128 + 3, id="array-byte"),
        pytest.param(CONTROL_BYTES + SLOT_HEADER_BYTES + 8 + 2, id="table-name"),
        pytest.param(CONTROL_BYTES + 0, id="header-seq"),
    ],
)
@pytest.mark.parametrize("earlier_messages", [0, 3], ids=["first-message", "cached-layout"])
def test_corruption_is_caught_and_the_next_message_still_arrives(pair, where, earlier_messages):
    owner, peer = pair
    for i in range(earlier_messages):  # 3 slots: the corrupt message lands in slot 0 again, its layout already known
        owner.send(i, tree_message(16))
        peer.recv(timeout=1)
    owner.send(3, tree_message(16))
    raw = attach_segment(owner.spec.to_peer)
    raw[where] ^= 0x40
    del raw
    with pytest.raises(CorruptMessageError):
        peer.recv(timeout=1)
    owner.send(4, tree_message(16, 7))
    msg = peer.recv(timeout=1)
    assert msg.kind == 4
    np.testing.assert_array_equal(msg.arrays["tokens"], np.arange(7, 23))


def test_a_repeated_shape_carries_new_data_and_a_changed_one_is_planned_afresh(pair):
    owner, peer = pair
    for value in range(5):  # same names, dtypes and lengths: the writer's and the reader's layouts are reused
        owner.send(value, {"x": np.full(8, value, np.int64), "y": np.arange(value, value + 3, dtype=np.float32)})
        msg = peer.recv(timeout=1)
        np.testing.assert_array_equal(msg.arrays["x"], np.full(8, value))
        np.testing.assert_array_equal(msg.arrays["y"], np.arange(value, value + 3, dtype=np.float32))
    owner.send(5, {"x": np.full(8, 5, np.int32), "y": np.arange(3, dtype=np.float32)[::-1]})  # new dtype, strided
    msg = peer.recv(timeout=1)
    assert msg.arrays["x"].dtype == np.int32
    np.testing.assert_array_equal(msg.arrays["y"], [2, 1, 0])
    with pytest.raises(IPCError, match="must be 1-D"):  # same name, dtype and size as before, but 2-D
        owner.send(6, {"x": np.zeros((2, 4), np.int64), "y": np.arange(3, dtype=np.float32)})
    assert peer.try_recv() is None


def test_more_shapes_than_the_layout_cache_holds_still_round_trip(pair):
    owner, peer = pair
    for n in range(MAX_CACHED_LAYOUTS + 20):
        owner.send(n, {"tokens": np.arange(n % 200, dtype=np.int64), f"tag{n}": np.array([n], np.int16)})
        msg = peer.recv(timeout=1)
        assert list(msg.arrays) == ["tokens", f"tag{n}"]
        np.testing.assert_array_equal(msg.arrays["tokens"], np.arange(n % 200))
        assert msg.arrays[f"tag{n}"][0] == n


def test_a_reader_keeps_every_slot_it_took_until_it_releases():
    name = segment_name(PREFIX, os.getpid(), new_token(), "ring")
    raw = create_segment(name, segment_bytes(2, 256))
    try:
        RingSegment.format(raw, 2, 256)
        writer, reader = RingWriter(RingSegment(name, raw)), RingReader(RingSegment(name, raw))
        for kind in (1, 2):
            writer.put(kind, {}, writer.layout({}))
        assert [reader.get().kind for _ in range(2)] == [1, 2]
        assert not writer.has_space()  # taken is not released
        assert reader.release()
        writer.put(3, {}, writer.layout({}))
        writer.put(4, {}, writer.layout({}))  # both slots came back at once
        assert not reader.release()  # nothing taken since
        assert [reader.get().kind for _ in range(2)] == [3, 4]
    finally:
        unlink_quietly(segment_path(name))


def test_a_table_no_writer_makes_is_corrupt():
    misaligned = table_struct(1).pack(1, b"x", b"<i8", 4, 68)
    with pytest.raises(CorruptMessageError, match="not at a whole item"):
        parse_table(misaligned)
    assert parse_table(table_struct(1).pack(1, b"x", b"<i8", 4, 64)).length == 64 + 32
    with pytest.raises(CorruptMessageError, match="unknown dtype"):
        parse_table(table_struct(1).pack(1, b"x", b"<q9", 4, 64))


def test_oversized_message_is_refused_with_a_clear_error_and_publishes_nothing(pair):
    owner, peer = pair
    with pytest.raises(MessageTooLargeError, match=r"4064 bytes \(probs: 1000 x float32\) does not fit a 2048-byte slot"):
        owner.send(0, {"probs": np.zeros(1000, np.float32)})
    assert peer.try_recv() is None


@pytest.mark.parametrize(
    "arrays, complaint",
    [
        ({"grid": np.zeros((2, 2))}, "must be 1-D"),
        ({"objs": np.array([None, 1], dtype=object)}, "unsupported dtype"),
        ({"x" * 33: np.zeros(1)}, "longer than 32 bytes"),
        ({"ids": [1, 2, 3]}, "must be a numpy ndarray"),
    ],
)
def test_bad_arrays_are_refused_naming_the_array(pair, arrays, complaint):
    owner, _ = pair
    with pytest.raises(IPCError, match=complaint):
        owner.send(0, arrays)


def test_bad_channel_settings_name_the_field():
    with pytest.raises(ValueError, match="num_slots"):
        Channel.create(PREFIX, num_slots=0)
    with pytest.raises(ValueError, match="slot_bytes"):
        Channel.create(PREFIX, slot_bytes=8)
    with pytest.raises(ValueError, match="name_prefix"):
        Channel.create("bad/prefix")


def echo_worker(spec):
    """Peer process: add 1 to every array and send it back, until a STOP message."""
    with Channel.attach(spec) as channel:
        while True:
            msg = channel.recv(timeout=30)
            if msg.kind == STOP:
                return
            channel.send(msg.kind, {name: array + 1 for name, array in msg.arrays.items()}, timeout=30)


def test_cross_process_round_trips_woken_by_the_doorbell():
    owner = Channel.create(PREFIX, num_slots=4, slot_bytes=4096, spin_s=0, check_interval_s=NEVER_CHECK_S)
    worker = SPAWN.Process(target=echo_worker, args=(owner.spec,))
    worker.start()
    try:
        for i in range(30):
            owner.send(i, tree_message(64, offset=i), timeout=10)
            reply = owner.recv(timeout=10)  # neither side spins: only the bells wake them
            assert reply.kind == i
            np.testing.assert_array_equal(reply.arrays["tokens"], np.arange(i + 1, i + 65))
            np.testing.assert_array_equal(reply.arrays["parents"], np.arange(0, 64))
        owner.send(STOP, {}, timeout=10)
        worker.join(timeout=10)
        assert worker.exitcode == 0
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()
        owner.close()
    assert leftovers(owner.name) == []


def silent_worker(spec):
    """Peer process: attach, say hello, then never answer again."""
    channel = Channel.attach(spec)
    channel.send(0, {"pid": np.array([os.getpid()])}, timeout=10)
    time.sleep(600)


@pytest.mark.parametrize("waiting_in", ["recv", "send"])
def test_sigkilled_peer_is_reported_within_the_bound(waiting_in):
    owner = Channel.create(PREFIX, num_slots=1, slot_bytes=256, check_interval_s=0.05, heartbeat_timeout_s=30)
    worker = SPAWN.Process(target=silent_worker, args=(owner.spec,))
    worker.start()
    try:
        assert owner.recv(timeout=30).arrays["pid"][0] == worker.pid
        if waiting_in == "send":
            owner.send(1, {}, timeout=1)  # fills the only slot: the next send must wait
        killed_at = []
        threading.Timer(0.2, lambda: (killed_at.append(time.monotonic()), os.kill(worker.pid, signal.SIGKILL))).start()
        with pytest.raises(PeerDeadError, match=f"pid {worker.pid}.*gone"):
            if waiting_in == "recv":
                owner.recv(timeout=20)
            else:
                owner.send(2, {}, timeout=20)
        assert time.monotonic() - killed_at[0] < 1.0  # bound: check_interval_s plus scheduling slack
    finally:
        worker.kill()
        worker.join()
        owner.close()


def test_hung_peer_is_reported_once_its_heartbeat_is_stale():
    owner = Channel.create(PREFIX, num_slots=2, slot_bytes=256, heartbeat_timeout_s=0.4)
    worker = SPAWN.Process(target=silent_worker, args=(owner.spec,))
    worker.start()
    try:
        owner.recv(timeout=30)
        with pytest.raises(RecvTimeoutError):
            owner.recv(timeout=0.8)  # alive and beating, just silent: a plain timeout
        os.kill(worker.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with pytest.raises(PeerDeadError, match="has not beaten"):
            owner.recv(timeout=20)
        assert time.monotonic() - stopped_at < 0.4 + 1.0
    finally:
        worker.kill()
        worker.join()
        owner.close()


def test_peer_that_closes_is_reported_after_its_last_messages(pair):
    owner, peer = pair
    peer.send(5, {"last": np.arange(3)})
    peer.close()
    assert owner.recv(timeout=1).kind == 5
    with pytest.raises(PeerDeadError, match="closed its end"):
        owner.recv(timeout=5)


def test_attach_refuses_a_second_peer_and_a_closed_owner(pair):
    owner, _ = pair
    with pytest.raises(IPCError, match="already had a peer"):
        Channel.attach(owner.spec)
    spec = owner.spec
    owner.close()
    with pytest.raises(PeerDeadError, match="does not exist"):
        Channel.attach(spec)
    with pytest.raises(IPCError, match="is closed"):
        owner.send(0, {})


def test_close_and_garbage_collection_leave_nothing_behind():
    owner = Channel.create(PREFIX, num_slots=2, slot_bytes=256)
    peer = Channel.attach(owner.spec)
    name = owner.name
    assert len(leftovers(name)) == 2 + 4  # two segments, four doorbell sockets
    owner.send(1, tree_message(3))
    held = peer.recv(timeout=1)  # a live view must not keep anything on disk
    peer.close()
    owner.close()
    assert leftovers(name) == []
    np.testing.assert_array_equal(held.arrays["tokens"], np.arange(3))  # mapping lives as long as the view

    dropped = Channel.create(PREFIX, num_slots=2, slot_bytes=256)
    name = dropped.name
    del dropped
    gc.collect()
    assert leftovers(name) == []


def crashing_owner(prefix, conn):
    """Owner process: create a channel, report its name and wait to be killed."""
    channel = Channel.create(prefix, num_slots=2, slot_bytes=256)
    conn.send(channel.name)
    time.sleep(600)


def test_crashed_owner_leaves_orphans_that_cleanup_removes():
    prefix = f"{PREFIX}-crash{os.getpid()}"
    live = Channel.create(prefix, num_slots=2, slot_bytes=256)
    receiving, sending = SPAWN.Pipe(duplex=False)
    owner = SPAWN.Process(target=crashing_owner, args=(prefix, sending))
    owner.start()
    try:
        orphan = receiving.recv()
        owner.kill()
        owner.join()
        orphaned = leftovers(orphan)
        assert len(orphaned) == 2 + 2  # segments and the owner's bound sockets survive SIGKILL
        assert sorted(cleanup_orphans(prefix)) == sorted(orphaned)
        assert leftovers(orphan) == []
        assert len(leftovers(live.name)) == 2 + 2  # a live owner's channel is untouched
    finally:
        owner.kill()
        owner.join()
        live.close()


def test_next_create_removes_orphans_of_a_crashed_owner():
    prefix = f"{PREFIX}-restart{os.getpid()}"
    receiving, sending = SPAWN.Pipe(duplex=False)
    owner = SPAWN.Process(target=crashing_owner, args=(prefix, sending))
    owner.start()
    orphan = receiving.recv()
    owner.kill()
    owner.join()
    assert leftovers(orphan) != []
    with Channel.create(prefix, num_slots=2, slot_bytes=256):
        assert leftovers(orphan) == []
