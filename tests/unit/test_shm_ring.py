"""The shared-memory broadcast ring: every reader process gets every message in order, through wrap-arounds (the
writer waits for slow readers instead of overwriting), messages longer than a slot, and timeouts both ways."""

from __future__ import annotations

import hashlib
import multiprocessing as mp

import pytest

from pagellm.distributed.shm_ring import RingReader, ShmRing


def _message(i: int) -> bytes:
    size = 5000 if i % 7 == 3 else i % 50  # every seventh is longer than a slot
    return bytes((i + k) % 251 for k in range(size))


def _read_all(reader: RingReader, count: int, out: mp.Queue) -> None:
    digest = hashlib.sha256()
    for _ in range(count):
        digest.update(reader.get(timeout=30))
        digest.update(b"|")
    reader.detach()
    out.put(digest.hexdigest())


def test_every_reader_gets_every_message_in_order_through_wraps_and_long_messages() -> None:
    ctx = mp.get_context("spawn")
    ring = ShmRing(2, ctx, slots=3, slot_bytes=1024)
    out = ctx.Queue()
    count = 60  # twenty times round the ring: the writer must wait for the readers
    readers = [ctx.Process(target=_read_all, args=(ring.reader(i), count, out)) for i in range(2)]
    for process in readers:
        process.start()
    try:
        for i in range(count):
            ring.put(_message(i), timeout=30)
        expected = hashlib.sha256(b"".join(_message(i) + b"|" for i in range(count))).hexdigest()
        assert [out.get(timeout=60), out.get(timeout=60)] == [expected, expected]
    finally:
        for process in readers:
            process.join(30)
        ring.close()
    assert all(process.exitcode == 0 for process in readers)


def test_a_reader_times_out_without_messages_and_the_writer_without_readers() -> None:
    ring = ShmRing(1, mp.get_context("spawn"), slots=2, slot_bytes=64)
    reader = ring.reader(0)
    try:
        with pytest.raises(TimeoutError, match="no message within 0.05s"):
            reader.get(timeout=0.05)
        ring.put(b"a")
        ring.put(b"b" * 100)  # a one-off segment
        with pytest.raises(TimeoutError, match="ring reader 0 did not take its messages within 0.05s"):
            ring.put(b"c", timeout=0.05)  # both slots still unread
        assert (reader.get(timeout=1), reader.get(timeout=1)) == (b"a", b"b" * 100)
        ring.put(b"c", timeout=1)
        assert reader.get(timeout=1) == b"c"
    finally:
        reader.detach()
        ring.close()
