"""The KV cache is zeroed without writing it: start-up does not pay for (or resident-map) gigabytes up front."""

import ctypes
import os

import torch

from pagellm.attention.base import new_kv_cache


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _resident_bytes(tensor: torch.Tensor) -> int:
    """How much of ``tensor``'s memory is resident (mincore, page by page): its own pages only, whatever else the
    process allocates or frees meanwhile (a garbage collection of an earlier test's tensors moves the process's RSS)."""
    address, length = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    start = address - address % 4096
    pages = -(-(address + length - start) // 4096)
    vec = ctypes.create_string_buffer(pages)
    assert _libc.mincore(start, pages * 4096, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) * 4096


def test_kv_cache_is_zero_writable_and_shaped():
    cache = new_kv_cache(64, 16, 3, 64, torch.bfloat16)
    assert cache.shape == (2, 64, 16, 3, 64) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any()
    cache[1, 5, 3] = 2.5
    assert cache[1, 5, 3].eq(2.5).all() and cache.count_nonzero() == 3 * 64
    assert not new_kv_cache(64, 16, 3, 64, torch.bfloat16).any()  # a fresh cache never sees an old one's writes


def test_a_large_cache_takes_memory_only_as_it_is_used():
    cache = new_kv_cache(4096, 16, 8, 128, torch.float32)  # 512 MiB
    assert _resident_bytes(cache) < 32 << 20
    cache[0, :64].fill_(1.0)  # 64 blocks: 4 MiB of pages
    assert 4 << 20 <= _resident_bytes(cache) < 48 << 20
    assert cache[0, :64].eq(1.0).all() and not cache[0, 64:].any()


def _mapping_of(address: int) -> tuple[str, list[str]]:
    """The permissions and VmFlags of the mapping holding ``address``, from ``/proc/self/smaps``."""
    perms, flags, inside = None, [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's header line: "start-end perms offset dev inode"
                start, end = (int(x, 16) for x in head[0].split("-"))
                inside = start <= address < end
                if inside:
                    perms = head[1]
            elif inside and head[0] == "VmFlags:":
                flags = head[1:]
    assert perms is not None, f"no mapping holds {address:#x}"
    return perms, flags


def test_the_cache_is_private_memory_on_small_pages_by_default(monkeypatch):
    # A shared mapping is shmem: a slower fault per 4 KiB of a new block. Huge pages are opt-in: on VMs whose host
    # takes back free 2 MiB blocks their first touch costs ~20x a 4 KiB page's (docs/performance.md, Round 38).
    monkeypatch.delenv("PAGELLM_KV_HUGE_PAGES", raising=False)
    cache = new_kv_cache(1024, 16, 4, 64, torch.bfloat16)  # 16 MiB
    perms, flags = _mapping_of(cache.data_ptr())
    assert perms.endswith("p"), f"the KV cache mapping is {perms}, not private"
    assert "hg" not in flags, f"the KV cache mapping asks for huge pages by default: {flags}"


def test_huge_pages_when_asked(monkeypatch):
    monkeypatch.setenv("PAGELLM_KV_HUGE_PAGES", "1")
    cache = new_kv_cache(1024, 16, 4, 64, torch.bfloat16)
    perms, flags = _mapping_of(cache.data_ptr())
    assert perms.endswith("p"), f"the KV cache mapping is {perms}, not private"
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):  # a kernel with THP takes the advice
        assert "hg" in flags, f"no MADV_HUGEPAGE on the KV cache mapping: {flags}"
    cache[0, :8].fill_(1.0)
    assert cache[0, :8].eq(1.0).all() and not cache[1].any()
