"""A shared-memory broadcast ring: one writer, N readers in other processes; every reader gets every message, in
order. The engine core hands each step's ``SchedulerOutput`` to the tensor-parallel workers through it.

Contract:
- ``ShmRing(num_readers, ctx)`` is created by the writer; ``reader(i)`` is the picklable ``RingReader`` that reader
  ``i`` takes into its process (pass it as a ``Process`` argument: it carries semaphores).
- ``put(data)`` copies ``data`` into the next of ``slots`` slots, after every reader is done with what that slot held
  (it waits on the readers' acknowledgements, with ``timeout``); a message longer than a slot goes into a one-off
  shared-memory segment whose name the slot carries, freed once every reader has read it.
- ``RingReader.get(timeout)`` blocks on its semaphore (no spinning: a small machine cannot give a core to waiting),
  returns the next message's bytes and acknowledges it; ``TimeoutError`` when none comes in time.
- ``close()`` (writer) frees the ring and any segment still held. Readers only ``detach()``.
"""

from __future__ import annotations

import struct
from multiprocessing import shared_memory
from typing import Any, Optional

_HEADER = struct.Struct("<qq")  # payload length, 1 when the payload is the name of a one-off segment
SLOTS = 8
SLOT_BYTES = 4 << 20


class ShmRing:
    """The writer's side (see the module doc)."""

    def __init__(self, num_readers: int, ctx: Any, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        if num_readers < 1 or slots < 1 or slot_bytes <= _HEADER.size:
            raise ValueError("a ring needs at least one reader, one slot and room for a message in each")
        self.slots, self.slot_bytes = slots, slot_bytes
        self.shm = shared_memory.SharedMemory(create=True, size=slots * slot_bytes)
        self.ready = [ctx.Semaphore(0) for _ in range(num_readers)]  # messages each reader may take
        self.done = [ctx.Semaphore(0) for _ in range(num_readers)]   # messages each reader has finished
        self.written = 0
        self.acked = [0] * num_readers
        self.external: dict[int, shared_memory.SharedMemory] = {}   # slot → its one-off segment

    def reader(self, index: int) -> RingReader:
        return RingReader(self.shm.name, self.slots, self.slot_bytes, self.ready[index], self.done[index])

    def put(self, data: bytes, timeout: Optional[float] = None) -> None:
        slot = self.written % self.slots
        for reader, done in enumerate(self.done):  # every reader must be past this slot's previous message
            while self.acked[reader] < self.written - self.slots + 1:
                if not done.acquire(timeout=timeout):
                    raise TimeoutError(f"ring reader {reader} did not take its messages within {timeout}s")
                self.acked[reader] += 1
        if (old := self.external.pop(slot, None)) is not None:
            old.close()
            old.unlink()
        base = slot * self.slot_bytes
        if _HEADER.size + len(data) <= self.slot_bytes:
            _HEADER.pack_into(self.shm.buf, base, len(data), 0)
            self.shm.buf[base + _HEADER.size:base + _HEADER.size + len(data)] = data
        else:
            segment = shared_memory.SharedMemory(create=True, size=max(1, len(data)))
            segment.buf[:len(data)] = data
            self.external[slot] = segment
            name = segment.name.encode()
            _HEADER.pack_into(self.shm.buf, base, len(data), 1)
            self.shm.buf[base + _HEADER.size:base + _HEADER.size + len(name)] = name
            self.shm.buf[base + _HEADER.size + len(name)] = 0
        self.written += 1
        for ready in self.ready:
            ready.release()

    def close(self) -> None:
        for segment in self.external.values():
            segment.close()
            segment.unlink()
        self.external.clear()
        self.shm.close()
        self.shm.unlink()


class RingReader:
    """One reader's side (picklable while its process is being spawned)."""

    def __init__(self, name: str, slots: int, slot_bytes: int, ready: Any, done: Any) -> None:
        self.name, self.slots, self.slot_bytes = name, slots, slot_bytes
        self.ready, self.done = ready, done
        self.cursor = 0
        self._shm: Optional[shared_memory.SharedMemory] = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_shm": None}

    def get(self, timeout: Optional[float] = None) -> bytes:
        if not self.ready.acquire(timeout=timeout):
            raise TimeoutError(f"no message within {timeout}s")
        if self._shm is None:
            self._shm = shared_memory.SharedMemory(name=self.name)  # (spawned readers share the writer's tracker)
        base = (self.cursor % self.slots) * self.slot_bytes
        length, external = _HEADER.unpack_from(self._shm.buf, base)
        start = base + _HEADER.size
        if external:
            name = bytes(self._shm.buf[start:start + self.slot_bytes - _HEADER.size]).split(b"\0", 1)[0].decode()
            segment = shared_memory.SharedMemory(name=name)
            data = bytes(segment.buf[:length])
            segment.close()
        else:
            data = bytes(self._shm.buf[start:start + length])
        self.cursor += 1
        self.done.release()
        return data

    def detach(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
