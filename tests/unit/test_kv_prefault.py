"""Populating the KV cache while the engine is idle (worker/kv_prefault.py): every block's pages become resident,
the first blocks the free queue hands out first, contents untouched; the background thread works only between
``resume`` and ``pause``, at the idle scheduling priority."""

from __future__ import annotations

import ctypes
import os
import platform
import threading

import pytest
import torch

from pagellm.attention.base import new_kv_cache
from pagellm.worker import kv_prefault
from pagellm.worker.kv_prefault import KVPrefaulter

NUM_BLOCKS = 1024  # 16 tokens x 4 heads x 64 x bf16 = 8 KiB a block: 8 MiB per K or V region
PIECE = 256 << 10  # 32 blocks a range
SUPPORTED = platform.system() == "Linux" and tuple(map(int, platform.release().split(".")[:2])) >= (5, 14)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident(address: int, length: int) -> bool:
    """Every page of ``[address, address + length)`` is in memory (mincore)."""
    start = address - address % 4096
    pages = -(-(address + length - start) // 4096)
    vec = ctypes.create_string_buffer(pages)
    assert _libc.mincore(start, pages * 4096, vec) == 0, ctypes.get_errno()
    return all(b & 1 for b in vec.raw)


def block_resident(cache: torch.Tensor, half: int, block: int) -> bool:
    return resident(cache[half, block].data_ptr(), cache[half, block].numel() * cache.element_size())


def caches() -> list[torch.Tensor]:
    return [new_kv_cache(NUM_BLOCKS, 16, 4, 64, torch.bfloat16) for _ in range(3)]


def test_steps_populate_every_block_first_blocks_first_and_keep_contents() -> None:
    layers = caches()
    layers[1][0, 5].fill_(1.5)  # blocks in use while the pages are populated
    layers[2][1, 600].fill_(-2.0)
    prefaulter = KVPrefaulter(layers, piece_bytes=PIECE)
    assert not any(block_resident(c, h, NUM_BLOCKS - 1) for c in layers for h in (0, 1))
    for _ in range(len(layers) * 2):  # one piece per layer and half: the first block range everywhere
        assert prefaulter.step() == SUPPORTED
    if SUPPORTED:
        assert all(block_resident(c, h, b) for c in layers for h in (0, 1) for b in (0, 31))
        assert not any(block_resident(c, h, NUM_BLOCKS - 1) for c in layers for h in (0, 1))
    while prefaulter.step():
        pass
    assert prefaulter.done and not prefaulter.step()
    if SUPPORTED:
        assert prefaulter.populated_blocks == NUM_BLOCKS
        assert all(block_resident(c, h, b) for c in layers for h in (0, 1) for b in range(NUM_BLOCKS))
    assert layers[1][0, 5].eq(1.5).all() and layers[2][1, 600].eq(-2.0).all()
    assert layers[1].count_nonzero() == layers[1][0, 5].numel() and not layers[0].any()


def test_a_kernel_without_the_call_leaves_the_cache_to_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_prefault, "populate", lambda address, length: False)
    prefaulter = KVPrefaulter(caches(), piece_bytes=PIECE)
    assert not prefaulter.step() and prefaulter.done and prefaulter.populated_blocks == 0


def test_the_thread_works_only_while_resumed_at_idle_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int]] = []  # (thread, scheduling policy) of each populate call
    entered, gate = threading.Event(), threading.Event()
    real = kv_prefault.populate

    def watched(address: int, length: int) -> bool:
        seen.append((threading.get_native_id(), os.sched_getscheduler(0)))
        if len(seen) == 1:
            entered.set()
            gate.wait()
        return real(address, length)

    monkeypatch.setattr(kv_prefault, "populate", watched)
    prefaulter = KVPrefaulter(caches(), piece_bytes=PIECE)
    assert not seen and prefaulter.populated_blocks == 0  # nothing before the engine says it is idle
    prefaulter.resume()
    assert entered.wait(10)
    prefaulter.pause()  # the engine got work while the first piece was under way
    gate.set()
    assert not prefaulter.wait(timeout=0.3) and len(seen) == 1  # that piece ends; no other starts while paused
    prefaulter.resume()
    assert prefaulter.wait(timeout=30) and prefaulter.done
    assert len(seen) == (NUM_BLOCKS // 32 * 3 * 2 if SUPPORTED else 1)  # every piece once, or one refused
    assert {thread for thread, _ in seen} != {threading.get_native_id()}
    assert {policy for _, policy in seen} == {os.SCHED_IDLE}
    prefaulter.close()


def test_close_stops_a_paused_thread() -> None:
    prefaulter = KVPrefaulter(caches(), piece_bytes=PIECE)
    prefaulter.resume()
    prefaulter.pause()
    prefaulter.close(timeout=10)
    assert prefaulter._thread is not None and not prefaulter._thread.is_alive()


def test_caches_must_be_layer_shaped() -> None:
    with pytest.raises(ValueError, match="2, num_blocks"):
        KVPrefaulter([torch.zeros(3, 4, 5)])
    with pytest.raises(ValueError, match="same number of blocks"):
        KVPrefaulter([new_kv_cache(8, 16, 1, 64, torch.float32), new_kv_cache(9, 16, 1, 64, torch.float32)])
