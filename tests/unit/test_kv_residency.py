"""KV block residency (vLLM's ``--kv-cache-metrics``): a followed block's lifetime, idle time and reuse gaps as the
pool hands it out, finds it in the prefix cache and evicts it; sampling; what a reset forgets."""

from __future__ import annotations

import time

import pytest

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.kv.block_pool import BlockPool
from pagellm.kv.residency import BlockResidency
from pagellm.sched.scheduler import Scheduler
from sched_fakes import make_request, run_to_completion


def test_a_followed_block_records_its_life_at_eviction() -> None:
    pool = BlockPool(2, enable_caching=True)
    pool.residency = BlockResidency(1.0)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"h1")
    pool.free_blocks([block])
    for _ in range(3):  # three prefix-cache hits, a few ms apart
        time.sleep(0.005)
        pool.touch([block])
        pool.free_blocks([block])
    time.sleep(0.02)
    assert pool.residency.drain() == ([], [], [])  # nothing evicted yet
    pool.get_new_blocks(2)  # takes the free block without a hash first, then evicts ours
    lifetimes, idle, gaps = pool.residency.drain()
    assert len(lifetimes) == len(idle) == 1 and len(gaps) == 2
    assert lifetimes[0] >= 0.035 and 0.02 <= idle[0] < lifetimes[0] and all(g >= 0.005 for g in gaps)


def test_only_a_sample_is_followed_and_a_reset_forgets() -> None:
    residency = BlockResidency(0.25, seed=0)
    for block_id in range(4000):
        residency.allocated(block_id)
    for block_id in range(4000):
        residency.evicted(block_id)
    assert 800 < len(residency.drain()[0]) < 1200
    residency.allocated(7)
    residency.reset()
    residency.evicted(7)
    assert residency.drain() == ([], [], [])
    with pytest.raises(ValueError, match=r"kv_cache_metrics_sample must be in \(0, 1\]"):
        CacheConfig(kv_cache_metrics=True, kv_cache_metrics_sample=0.0)


def test_the_scheduler_reports_evictions_in_its_stats() -> None:
    """A pool too small for every prompt's blocks evicts; with every block followed, each eviction's lifetime
    reaches the stats (the scheduler runs its Python paths then)."""
    cache = CacheConfig(block_size=4, kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), cache, 12, 64)
    assert sched._native is None
    for i in range(6):
        sched.add_request(make_request(f"r{i}", range(100 * i, 100 * i + 16), max_tokens=2))
    run_to_completion(sched)
    stats = sched.make_stats()
    assert len(stats.kv_block_lifetimes) == stats.kv_cache_evictions > 0
