"""How long KV blocks stay and how they are reused (vLLM's ``--kv-cache-metrics``), for sizing the cache and judging
the prefix cache's hit pattern.

Contract:
- ``BlockResidency(sample)`` follows a ``sample`` share of the blocks the pool hands out (each handed-out block is
  drawn afresh): from its allocation (its birth), each prefix-cache hit on it (an access; the last four kept), to its
  eviction (its cached contents dropped to make room for other tokens). At eviction it records the block's lifetime
  (birth to eviction), its idle time (last access, else birth, to eviction) and the gaps between its accesses, as
  vLLM's collector does; a block handed out again without having cached anything starts over unrecorded.
- ``drain()`` returns the step's records (lifetimes, idle times, reuse gaps, in seconds) and forgets them; the
  scheduler puts them in its ``SchedulerStats``, which the Prometheus sink turns into the histograms
  ``pagellm:kv_block_lifetime_seconds``, ``pagellm:kv_block_idle_before_evict_seconds`` and
  ``pagellm:kv_block_reuse_gap_seconds``. ``reset()`` forgets every block (a prefix-cache reset).
"""

from __future__ import annotations

import random
import time
from collections import deque


class BlockResidency:
    def __init__(self, sample: float, seed: int | None = None) -> None:
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {sample}")
        self.sample = sample
        self._random = random.Random(seed)
        self._blocks: dict[int, tuple[float, deque[float]]] = {}  # block id → (birth, its last accesses)
        self.lifetimes: list[float] = []
        self.idle: list[float] = []
        self.reuse_gaps: list[float] = []

    def allocated(self, block_id: int) -> None:
        if self._random.random() < self.sample:
            self._blocks[block_id] = (time.monotonic(), deque(maxlen=4))
        else:
            self._blocks.pop(block_id, None)

    def accessed(self, block_id: int) -> None:
        followed = self._blocks.get(block_id)
        if followed is not None:
            followed[1].append(time.monotonic())

    def evicted(self, block_id: int) -> None:
        followed = self._blocks.pop(block_id, None)
        if followed is None:
            return
        now, (birth, accesses) = time.monotonic(), followed
        self.lifetimes.append(now - birth)
        self.idle.append(now - (accesses[-1] if accesses else birth))
        history = list(accesses)
        self.reuse_gaps.extend(b - a for a, b in zip(history, history[1:]))

    def drain(self) -> tuple[list[float], list[float], list[float]]:
        drained = self.lifetimes, self.idle, self.reuse_gaps
        self.lifetimes, self.idle, self.reuse_gaps = [], [], []
        return drained

    def reset(self) -> None:
        self._blocks.clear()
        self.drain()
