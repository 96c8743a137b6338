"""The scheduler's admission side: ``_schedule_waiting`` admits waiting requests into the running batch.

Waiting requests are admitted in queue order while the step's token budget and ``max_num_seqs`` allow: each gets its
prefix-cache hits and first KV slots (``_allocate_new``), joins the running batch as its last row, and its
``NewRequestData`` joins the step. As vLLM's, a request is admitted only when the pool has room for its whole sequence
(``scheduler_reserve_full_isl``, on by default: a long prompt does not start, chunk by chunk, into a pool that cannot
hold it, to be preempted half way), and, while others run, ``watermark`` of the pool besides. With the native fast
path the whole loop is one call (``admit_waiting`` in ``csrc/fastpath.cpp``) on the same objects; the Python loop
here is its twin. ``Admission`` is a part of ``Scheduler`` (which inherits it and owns the state it reads), a module
of its own only to keep the scheduler's parts apart, like ``sched/intake.Intake``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from pagellm.kv.manager import KVCacheManager
from pagellm.metrics.stats import SchedulerStats
from pagellm.request import Request, RequestStatus
from pagellm.sched.output import NewRequestData
from pagellm.sched.queue import RequestQueue
from pagellm.sched.running import RunningBatch
from pagellm.sched.stop import suppressed_tokens
from pagellm.sched.whole_images import whole_images


class Admission:
    waiting: RequestQueue
    running: RunningBatch
    kv: KVCacheManager
    max_num_seqs: int
    max_model_len: int
    chunked_prefill: bool
    chunk_cap: int
    reserve_full: bool  # an admission needs room for its whole sequence (scheduler_reserve_full_isl)
    watermark_blocks: int  # ... and leaves these blocks free while other requests run (watermark)
    _step_lookahead: int
    _needs_sort: bool
    _dropped_req_ids: set[str]
    _stats: SchedulerStats
    _native: Any  # sched/native.py's extension module, or None
    _kv_args: tuple
    _lookahead: Callable[[int], int]  # Scheduler's: draft slots to reserve after a step
    stored: Any  # disagg/connector.StoredBlocks with a KV connector that loads, else None

    def _schedule_waiting(self, budget: int, req_ids: list[str], num_scheduled: list[int],
                          new_reqs: list[NewRequestData]) -> int:
        """Admit waiting requests in queue order while budget and ``max_num_seqs`` allow; returns the budget left."""
        waiting, batch, limit = self.waiting, self.running, self.max_num_seqs
        rows = batch.requests
        if self._native is not None and self.stored is None:  # the whole loop in one call (the loop below is its twin)
            batch.reserve(min(limit, len(rows) + len(waiting)))
            budget, admitted, queries, hits = self._native.admit_waiting(
                waiting, budget, limit, self.chunked_prefill, self._step_lookahead, self.max_model_len,
                batch._columns, rows, batch.req_ids, batch.token_lists, new_reqs, req_ids, num_scheduled,
                self._dropped_req_ids, RequestStatus.RUNNING, NewRequestData, suppressed_tokens, *self._kv_args,
                self.chunk_cap, self.watermark_blocks, self.reserve_full)
            if admitted:
                batch.version += 1
                self._needs_sort = True
                self._count_admitted(queries, hits)
            return budget
        while budget > 0 and len(rows) < limit and waiting:
            request = waiting.peek()
            got = self._allocate_new(request, budget)
            if got is None:
                break
            num_hit, num_new, block_ids, kv_slots, kv_next_full, loads = got
            waiting.pop()
            new_reqs.append(NewRequestData(
                request.request_id, list(request.all_token_ids), request.num_prompt_tokens,
                request.sampling_params, block_ids, num_hit, suppressed_tokens(request), *loads,
            ))
            batch.append(request, num_hit + num_new, kv_slots, kv_next_full)
            self._admitted(request, num_hit)
            req_ids.append(request.request_id)
            num_scheduled.append(num_new)
            budget -= num_new
        return budget

    def _allocate_new(self, request: Request, budget: int) -> tuple[int, int, list[int], int, int, tuple] | None:
        """A waiting request's prefix hits and first slots within ``budget``: (tokens hit, tokens to compute now,
        its block ids, ``slots_and_next_full``, the blocks to load from the KV connector's store and their hashes),
        or None when it does not fit this step (the Python twin of the native ``admit_waiting``'s KV part). Stored
        blocks that continue the local hits count as hits too: they are loaded, not computed."""
        kv = self.kv
        hit_blocks, num_hit = kv.get_computed_blocks(request)
        num_stored = 0
        if self.stored is not None:
            first, end = len(hit_blocks), (request.num_tokens - 1) // kv.block_size
            num_stored = self.stored.count(request.block_hashes[first:end]) * kv.block_size
        num_new = request.num_tokens - num_hit - num_stored
        if not self.chunked_prefill and num_new > budget:
            return None
        num_new = min(num_new, budget, self.chunk_cap or num_new)
        if request.image_runs is not None:  # disable_chunked_mm_input (the scheduler takes no native path then)
            num_new = whole_images(request.image_runs, num_hit + num_stored, num_new)
            if not num_new:
                return None
        reach = num_hit + num_stored + num_new
        must_fit = min(request.num_tokens, self.max_model_len) if self.reserve_full and not kv.sliding_window else 0
        reserve = self.watermark_blocks if len(self.running) else 0
        if kv.allocate_slots(request, 0, num_stored + num_new, hit_blocks, self._lookahead(reach), must_fit,
                             reserve) is None:
            return None
        block_ids = kv.block_ids(request.request_id)
        first, end = len(hit_blocks), len(hit_blocks) + num_stored // kv.block_size
        loads = (block_ids[first:end], list(request.block_hashes[first:end])) if num_stored else ()
        return (num_hit + num_stored, num_new, block_ids, *kv.slots_and_next_full(request.request_id), loads)

    def _admitted(self, request: Request, num_hit: int) -> None:
        """The rest of an admission, once ``request`` is the running batch's last row (the native ``admit_waiting``
        does the same)."""
        self._needs_sort = True
        self._dropped_req_ids.discard(request.request_id)
        request.status = RequestStatus.RUNNING
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
            request.scheduled_time = time.time()
        self._count_admitted(request.num_tokens, num_hit)

    def _count_admitted(self, num_tokens: int, num_hit: int) -> None:
        """Prefix-cache and prompt-token stats for admitted requests of ``num_tokens`` tokens, ``num_hit`` of them
        found in the cache."""
        self._stats.prefix_cache_queries += num_tokens
        self._stats.prefix_cache_hits += num_hit
        self._stats.num_prompt_tokens += num_tokens - num_hit
