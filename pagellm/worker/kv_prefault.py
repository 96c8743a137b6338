"""Populating the KV cache's memory while the engine has nothing else to do.

The cache's pages come from the OS zero-filled on first touch (``attention/base.py: new_kv_cache``), so start-up
does not pay for gigabytes up front; but a step that writes K/V into a block never used before pays for the touch
inside its forward pass, on the main thread while the other OpenMP threads wait. On a VM whose host has not backed
that memory yet this cost 1.5-2.8 s per GiB on transparent huge pages: a c=32 run on a server that populated its
cache while idle gave 10 % more output tokens/s than one that did not (docs/performance.md, Round 17). The cache is
on 4 KiB pages now unless asked otherwise (0.3-0.5 s per GiB, Round 38). vLLM pays it before it is ready (it writes
its cache with zeros at start-up).

``KVPrefaulter.step`` asks the kernel to populate one piece of the cache (``madvise(MADV_POPULATE_WRITE)``: the
pages are faulted in writable as a write would, their contents left as they are, so blocks in use are safe): 2 MiB
of one layer's K or V. Pieces go in the order the free queue hands blocks out (ascending ids, each block range
across every layer), so the first blocks used are the first populated. A background thread takes the steps while
the engine core says it is idle (``resume``/``pause``: ``EngineCoreLoop.run`` after 2 s with nothing to run, until
the next input), at the lowest scheduling priority (``SCHED_IDLE``: in the guest it runs only on a core nothing else
wants; the host's share of each fault no priority lowers, hence the loop's grace). A server that waits for traffic
thus gets its cache ready without delaying its start. Where the kernel lacks the call (Linux < 5.14, other systems)
the first step says so and the thread stops.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence

import torch

logger = logging.getLogger(__name__)

MADV_DONTNEED = 4  # <linux/mman.h>: the pages go back to the OS; the next touch finds them zeroed
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux >= 5.14
PIECE_BYTES = 2 << 20     # of one layer's K or V: one transparent huge page, where the cache asks for them
PAGE = 4096


def _libc_madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


def populate(address: int, length: int) -> bool:
    """Fault in ``[address, address + length)`` (widened to whole pages) writable without writing it."""
    if _MADVISE is None:
        return False
    start = address - address % PAGE
    end = -(-(address + length) // PAGE) * PAGE
    return _MADVISE(start, end - start, MADV_POPULATE_WRITE) == 0


def discard(address: int, length: int) -> bool:
    """Give the whole pages inside ``[address, address + length)`` back to the OS (sleep mode); the mapping stays,
    and the next touch of a page finds it zeroed. Pages the range shares with other data are kept."""
    if _MADVISE is None:
        return False
    start = -(-address // PAGE) * PAGE
    end = (address + length) // PAGE * PAGE
    return end <= start or _MADVISE(start, end - start, MADV_DONTNEED) == 0


def release_freed_memory() -> None:
    """Give the memory of tensors just let go (sleep level 2's weights) back to the OS: collect what cycles still
    hold, then ask glibc to return its arenas' free pages (``malloc_trim``; tensors below its mmap threshold live
    there). Elsewhere only the collection runs."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def block_ranges(num_blocks: int, block_bytes: int, piece_bytes: int = PIECE_BYTES) -> Iterator[tuple[int, int]]:
    """Block ranges ``[first, end)`` in ascending order, each about ``piece_bytes`` of one region."""
    step = max(1, piece_bytes // block_bytes)
    for first in range(0, num_blocks, step):
        yield first, min(num_blocks, first + step)


class KVPrefaulter:
    """Populates a model's ``[2, num_blocks, ...]`` caches (one per attention layer), one piece per ``step``."""

    def __init__(self, caches: Sequence[torch.Tensor], piece_bytes: int = PIECE_BYTES) -> None:
        if not caches or any(c.dim() < 2 or c.shape[0] != 2 or not c.is_contiguous() for c in caches):
            raise ValueError("KVPrefaulter takes contiguous [2, num_blocks, ...] caches")
        self.num_blocks = caches[0].shape[1]
        if any(c.shape[1] != self.num_blocks for c in caches):
            raise ValueError("every cache must have the same number of blocks")
        self.populated_blocks = 0  # blocks [0, populated_blocks) are populated in every cache
        self.done = False
        self.seconds = 0.0  # spent in ``step``
        self._pieces = self._walk(list(caches), piece_bytes)
        self._idle = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def resume(self) -> None:
        """The engine is idle: take steps in the background (the thread starts on the first call)."""
        if self.done:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._background, daemon=True, name="kv-prefault")
            self._thread.start()
        self._idle.set()

    def pause(self) -> None:
        """The engine has work: no further step until ``resume`` (one under way finishes, a few ms at most)."""
        self._idle.clear()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` s) for the background thread to finish; True once it has nothing left to do
        (every block populated, or a kernel without the call)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.done

    def close(self, timeout: float | None = None) -> None:
        self._closed = True
        self._idle.set()
        self.wait(timeout)

    def _background(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # pid 0: this thread only
        except (AttributeError, OSError) as exc:  # not Linux: no idle class, and no MADV_POPULATE_WRITE either
            logger.info("the KV cache fills on first use (no SCHED_IDLE: %s)", exc)
            self.done = True
            return
        while self._idle.wait() and not self._closed and self.step():
            pass

    def step(self) -> bool:
        """Populate the next piece; False once there is nothing left to do (so the caller may sleep)."""
        if self.done:
            return False
        start = time.perf_counter()
        piece = next(self._pieces, None)
        ok = piece is not None and populate(*piece)
        self.seconds += time.perf_counter() - start
        if not ok:
            self.done = True
            if piece is None:
                logger.info("KV cache populated (%d blocks) in %.1f s of idle time", self.num_blocks, self.seconds)
            else:
                logger.info("the KV cache fills on first use (MADV_POPULATE_WRITE: errno %d)", ctypes.get_errno())
        return ok

    def _walk(self, caches: list[torch.Tensor], piece_bytes: int) -> Iterator[tuple[int, int]]:
        sizes = [c[0, 0].numel() * c.element_size() for c in caches]  # bytes of one block of one region
        for first, end in block_ranges(self.num_blocks, min(sizes), piece_bytes):
            for cache, block_bytes in zip(caches, sizes):
                for half in (0, 1):  # K, then V
                    yield (cache.data_ptr() + (half * self.num_blocks + first) * block_bytes,
                           (end - first) * block_bytes)
            self.populated_blocks = end
