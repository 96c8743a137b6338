"""The KV cache is zeroed without writing it: start-up does not pay for (or resident-map) gigabytes up front."""

import torch

from pagellm.attention.base import new_kv_cache


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_kv_cache_is_zero_writable_and_shaped():
    cache = new_kv_cache(64, 16, 3, 64, torch.bfloat16)
    assert cache.shape == (2, 64, 16, 3, 64) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any()
    cache[1, 5, 3] = 2.5
    assert cache[1, 5, 3].eq(2.5).all() and cache.count_nonzero() == 3 * 64
    assert not new_kv_cache(64, 16, 3, 64, torch.bfloat16).any()  # a fresh cache never sees an old one's writes


def test_a_large_cache_takes_memory_only_as_it_is_used():
    before = _rss_bytes()
    cache = new_kv_cache(4096, 16, 8, 128, torch.float32)  # 512 MiB
    assert _rss_bytes() - before < 32 << 20
    cache[0, :64].fill_(1.0)  # 64 blocks: 4 MiB of pages
    grown = _rss_bytes() - before
    assert 4 << 20 <= grown < 48 << 20
    assert cache[0, :64].eq(1.0).all() and not cache[0, 64:].any()
