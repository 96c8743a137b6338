"""The scheduler: one token-budget rule, no phases.

Every request has ``num_computed_tokens`` chasing ``num_tokens_with_spec`` (prompt + output + draft tokens). Each
step hands out ``budget`` tokens, running requests first, then waiting ones, under ``max_num_seqs``. Chunked
prefill, prefix-cache hits, resumed preemptions and draft tokens all follow from that rule. When the KV pool runs
short, the last running request is preempted (recompute): under FCFS the newest one, under ``priority`` the
lowest-priority one (the running list is kept sorted for that policy). ``num_computed_tokens`` advances when a
request is scheduled; ``update_from_output`` rolls back rejected drafts and applies token-level stop rules.

Both per-request loops run over the numpy columns of ``RunningBatch``: ``_grant`` hands the budget out with one
cumulative sum, and only the rows that need the KV manager (a block to allocate or one that fills,
``_needs_kv``) come back to per-request Python, in row order, so every KV call and every block id is what a plain
loop over the requests would produce. The output side (``update_from_output``: only the rows that may stop or get
their first output come back to Python) is ``sched/intake.Intake`` and the admission of waiting requests
(``_schedule_waiting``) is ``sched/admission.Admission``; ``Scheduler`` inherits both.
``tests/unit/test_scheduler_fastpath.py`` runs the scheduler in lockstep with a twin that takes the per-request
path for every row and hands the budget out one request at a time.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.kv.block import KVBlock
from pagellm.kv.events import KVEventRecorder
from pagellm.kv.hash_algos import make_hasher
from pagellm.kv.hashing import ROOT_HASH, extend_block_hashes
from pagellm.kv.manager import KVCacheManager
from pagellm.kv.residency import BlockResidency
from pagellm.metrics.stats import SchedulerStats, SpecDecodingStats
from pagellm.request import Request, RequestStatus
from pagellm.sched.admission import Admission
from pagellm.sched.intake import Intake, _Step
from pagellm.sched.native import fastpath
from pagellm.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagellm.sched.queue import make_queue
from pagellm.sched.running import RunningBatch
from pagellm.sched.stop import StopRules
from pagellm.sched.whole_images import cut_grants

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _RunningPart:
    """The running requests' share of a step."""

    cached: CachedRequestData
    num_scheduled: list[int]
    rows: np.ndarray              # their RunningBatch rows
    num_spec: np.ndarray | None
    spec: dict[str, list[int]]
    num_tokens: int
    preempted: bool


class Scheduler(Intake, Admission):
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        num_lookahead_tokens: int = 0,
        disable_by_batch_size: int | None = None,
        *,
        fast_path: bool = True,
        kv_window: int = 0,
        kv_events: KVEventRecorder | None = None,
    ) -> None:
        """``fast_path=False`` takes the numpy and Python paths even where the native fast path builds (its test
        oracle). ``kv_window``: every layer of the model slides over this many positions, so blocks behind it are
        released as requests move on (``KVCacheManager``; the scheduler then takes its numpy and Python paths, where
        the releases are made). ``kv_events``: record the prefix cache's changes there (``kv/events.py``; the numpy
        and Python paths again, where they are made), as ``disable_chunked_mm_input`` does (``whole_images.py``)."""
        self.max_num_seqs = config.active_limit  # max_num_active_seqs, where it is lower
        self.budget = config.token_budget(max_model_len)
        self.chunked_prefill = config.enable_chunked_prefill
        self.chunk_cap = config.long_prefill_token_threshold  # the most tokens a request computes in a step (0: all)
        self.whole_images = config.disable_chunked_mm_input  # no step ends inside a run of image tokens
        self.reserve_full = config.scheduler_reserve_full_isl
        self.watermark_blocks = int(config.watermark * num_blocks)
        self.by_priority = config.scheduling_policy == "priority"
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        # The worker drafts nothing after a step of more requests than this (SpeculativeConfig); slots for drafts
        # are reserved only in steps that surely stay at or below it (``_step_lookahead``, set by ``schedule``).
        self.disable_by_batch_size = disable_by_batch_size
        self._step_lookahead = num_lookahead_tokens
        algo = cache_config.prefix_caching_hash_algo
        residency = BlockResidency(cache_config.kv_cache_metrics_sample) if cache_config.kv_cache_metrics else None
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                 kv_window, kv_events, make_hasher(algo), residency)
        self.waiting = make_queue(config.scheduling_policy)
        # The step loops in C (sched/native.py), where no window releases blocks, no event is recorded, no block is
        # followed (--kv-cache-metrics), blocks hash in pagellm's own way and chunks may end inside images.
        native = fast_path and not (kv_window or self.whole_images) and (kv_events, algo, residency) == (None,) * 3
        self._native = fastpath() if native else None
        self.running = RunningBatch(compact=self._native.compact_rows if self._native is not None else None)
        if self._native is not None:
            kv, release = self.kv, self._native.free_blocks
            kv.release_blocks = lambda blocks: release(blocks, kv.pool.free_queue)
            kv.native_hashes = self._native.extend_block_hashes
            # The KV manager's state every native KV call takes, in its order (the objects, not copies).
            self._kv_args = (kv.req_blocks, kv.num_cached_blocks, kv.pool, kv.pool.free_queue, kv.block_size,
                             kv.enable_caching, ROOT_HASH, extend_block_hashes)
        self.stored = None  # a KV connector's stored blocks (EngineCore sets it): admission loads them as hits
        self.requests: dict[str, Request] = {}
        self._embeds_ids: set[str] = set()  # requests with embeddings prompts or images (some may have finished)
        self.stop_rules = StopRules(max_model_len)
        self._dropped_req_ids: set[str] = set()  # workers must forget these at the next step
        self._needs_sort = False      # priority policy: requests were admitted since the running list was sorted
        self._drafts_seen = False     # some request got draft tokens (until then no step has any)
        self._step: _Step | None = None
        self._stats = SchedulerStats()
        self._spec_stats = SpecDecodingStats()
        self._evictions_seen = 0

    # ----------------------------------------------------------------------------------------- requests in/out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if request.prompt_embeds is not None or request.mm_inputs is not None:
            self._embeds_ids.add(request.request_id)
        request.queued_time = time.time()
        self.stop_rules.add(request)
        self.kv.hash_blocks(request)  # now rather than at its first look-up: the hashes depend only on its tokens
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove_rows([self.running.index(request)])
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def num_computed_tokens(self, request_id: str) -> int:
        """Tokens of the request in the KV cache (0 unless it is running)."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.RUNNING:
            return 0
        return int(self.running.computed[self.running.index(request)])

    # ------------------------------------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        if self.by_priority and self._needs_sort:
            self._sort_running()
        self._step_lookahead = self._reservation()
        part = self._schedule_running(self.budget)
        req_ids, num_scheduled = list(part.cached.req_ids), part.num_scheduled
        new_reqs: list[NewRequestData] = []
        num_running, budget = len(self.running), self.budget - part.num_tokens
        if not part.preempted and self.waiting:  # no room for newcomers while running requests are pushed out
            budget = self._schedule_waiting(budget, req_ids, num_scheduled, new_reqs)
        if self._embeds_ids and new_reqs:
            self._attach_embeds(new_reqs)
        total = self.budget - budget
        self._stats.num_scheduled_tokens += total
        dropped, self._dropped_req_ids = self._dropped_req_ids, set()
        out = SchedulerOutput(new_reqs, part.cached, req_ids, num_scheduled, total, part.spec, sorted(dropped))
        rows, num_spec = part.rows, part.num_spec
        if new_reqs:
            rows = self.running.first_rows(len(self.running)) if len(rows) == num_running else \
                np.concatenate([rows, np.arange(num_running, len(self.running))])
            if num_spec is not None:
                num_spec = np.concatenate([num_spec, np.zeros(len(new_reqs), dtype=np.int64)])
        self._step = _Step(out, rows, num_spec, self.running.version)
        return out

    def _attach_embeds(self, new_reqs: list[NewRequestData]) -> None:
        """An embeddings prompt's rows, and a prompt's images, go to the workers with its request (again when it
        resumes)."""
        live = self.requests
        self._embeds_ids.intersection_update(live.keys())  # finished ones leave (the native path drops them there)
        for new in new_reqs:
            if new.req_id in self._embeds_ids:
                new.prompt_embeds = live[new.req_id].prompt_embeds
                new.mm_inputs = live[new.req_id].mm_inputs

    def _schedule_running(self, budget: int) -> _RunningPart:
        """Hand ``budget`` to the running requests in order: vectorised over the batch's columns, with the KV
        manager called only for the rows that need it (in row order, as a plain loop would call it)."""
        batch, n, drafts = self.running, len(self.running), self._drafts_seen
        if n == 0:
            return _RunningPart(CachedRequestData(), [], np.zeros(0, dtype=np.int64), None, {}, 0, False)
        if self._native is not None and not drafts:
            part = self._schedule_running_native(budget)
            if part is not None:
                return part
        computed, tokens = batch.computed[:n], batch.num_tokens[:n]  # views: computed is overwritten last
        grant = self._grant(computed, tokens, batch.num_spec[:n] if drafts else None, budget)
        if self.whole_images:
            cut_grants(batch.requests, computed, grant)
        end = computed + grant
        final = np.minimum(end, tokens) if drafts else end  # draft tokens are never final
        lookahead = self._step_lookahead
        room = end + np.minimum(np.maximum(self.max_model_len - end, 0), lookahead) if lookahead else end
        new_block_ids: dict[str, list[int]] = {}
        events = self._needs_kv(grant, room, final, batch.kv_slots[:n], batch.kv_next_full[:n]).nonzero()[0]
        if events.size:
            self._serve_kv(events, computed, grant, room, final, new_block_ids)
        m = len(batch)
        grant, end = grant[:m], end[:m]
        k = int(np.count_nonzero(grant))
        if k == m or not np.count_nonzero(grant[k:]):  # the scheduled rows are the first k (the usual case)
            rows = batch.first_rows(k)
            cached = CachedRequestData(batch.req_ids[:k], computed[:k].tolist(), new_block_ids)
            num_scheduled = grant[:k].tolist()
        else:
            rows = grant.nonzero()[0]
            cached = CachedRequestData([batch.req_ids[i] for i in rows.tolist()], computed[rows].tolist(),
                                       new_block_ids)
            num_scheduled = grant[rows].tolist()
        num_spec, spec = self._scheduled_drafts(rows, end - tokens[:m]) if drafts else (None, {})
        batch.computed[:m] = end
        return _RunningPart(cached, num_scheduled, rows, num_spec, spec, int(np.add.reduce(grant)), m < n)

    def _schedule_running_native(self, budget: int) -> _RunningPart | None:
        """``_schedule_running`` in one native call (no drafts held): the same budget rule, KV manager calls and
        columns; None (nothing changed) when the pool cannot serve every row, which the numpy path then handles."""
        batch, new_block_ids = self.running, {}
        done = self._native.schedule_running(batch._columns, len(batch), budget, self.max_model_len,
                                             self._step_lookahead, batch.requests, batch.req_ids, *self._kv_args,
                                             new_block_ids, self.chunk_cap)
        if done is None:
            return None
        num_tokens, req_ids, computed, num_scheduled, rows = done
        rows = batch.first_rows(len(req_ids)) if rows is None else np.array(rows, dtype=np.int64)
        return _RunningPart(CachedRequestData(req_ids, computed, new_block_ids), num_scheduled, rows, None, {},
                            num_tokens, False)

    def _grant(self, computed: np.ndarray, tokens: np.ndarray, num_spec: np.ndarray | None,
               budget: int) -> np.ndarray:
        """The budget rule over the running rows: each in order gets what it still needs (prompt chunk, sampled
        token, drafts; never past max_model_len) until the budget runs out; a row that needs nothing gets 0.
        Without drafts a running request never reaches max_model_len (it stops there) nor computes past its
        tokens, so what it needs is ``tokens - computed``."""
        if num_spec is None:
            want = tokens - computed
        else:
            want = np.minimum(tokens + num_spec, self.max_model_len) - computed
            np.maximum(want, 0, out=want)
        if self.chunk_cap:
            np.minimum(want, self.chunk_cap, out=want)
        used = want.cumsum()  # the method: np.cumsum's Python wrapper costs more than the sum here
        if used[-1] <= budget:
            return want
        return np.minimum(np.maximum(budget - used + want, 0), want)

    @staticmethod
    def _needs_kv(grant: np.ndarray, room: np.ndarray, final: np.ndarray, kv_slots: np.ndarray,
                  kv_next_full: np.ndarray) -> np.ndarray:
        """Scheduled rows whose step needs the KV manager: more slots (``room``: tokens after the step plus
        lookahead) than their blocks hold, or final tokens that fill a block (see KVCacheManager's contract)."""
        return (grant > 0) & ((room > kv_slots) | (final >= kv_next_full))

    def _serve_kv(self, events: np.ndarray, computed: np.ndarray, grant: np.ndarray, room: np.ndarray,
                  final: np.ndarray, new_block_ids: dict[str, list[int]]) -> None:
        """The KV manager's part of the ``events`` rows' steps, in row order: one ``allocate_running`` call for
        as many as the pool serves; when it runs short, the row it stopped at preempts from the end."""
        batch = self.running
        rooms, finals = room[events], final[events]
        rows, room_list, final_list = events.tolist(), rooms.tolist(), finals.tolist()
        while rows:
            before = computed[rows].tolist() if self.kv.sliding_window else None  # what a window leaves behind
            served = self.kv.allocate_running([batch.requests[r] for r in rows], room_list, final_list,
                                              new_block_ids, before)
            self._served_columns(events[:served], rooms[:served], finals[:served])
            if served == len(rows):
                return
            row = rows[served]
            if not self._allocate_row(row, int(computed[row]), int(grant[row]), new_block_ids):
                return  # the row itself was preempted, and every row after it
            keep = bisect.bisect_left(rows, len(batch))  # rows preempted meanwhile are gone
            rows, room_list, final_list = (rows[served + 1:keep], room_list[served + 1:keep],
                                           final_list[served + 1:keep])
            events, rooms, finals = events[served + 1:keep], rooms[served + 1:keep], finals[served + 1:keep]

    def _served_columns(self, rows: np.ndarray, rooms: np.ndarray, finals: np.ndarray) -> None:
        """``kv_slots`` / ``kv_next_full`` of rows ``allocate_running`` served, from the rule it follows: a row holds
        at least ``ceil(room / block_size)`` blocks after it, and when its final tokens reached its next-full count
        its blocks up to ``final // block_size`` are registered (with prefix caching off ``kv_next_full`` is
        ``NEVER``, which no count reaches)."""
        batch, bs = self.running, self.kv.block_size
        batch.kv_slots[rows] = np.maximum(batch.kv_slots[rows], -(-rooms // bs) * bs)
        next_full = batch.kv_next_full[rows]
        batch.kv_next_full[rows] = np.where(finals >= next_full, (finals // bs + 1) * bs, next_full)

    def _allocate_row(self, row: int, num_computed: int, num_new: int, new_block_ids: dict[str, list[int]]) -> bool:
        """One row's slots, preempting from the end of the running list while the pool is short; False when the
        row's own request had to go."""
        batch, request = self.running, self.running.requests[row]
        blocks = self._allocate_or_preempt(request, num_computed, num_new)
        if blocks is None:
            return False
        if blocks:
            new_block_ids[request.request_id] = [b.block_id for b in blocks]
        batch.kv_slots[row], batch.kv_next_full[row] = self.kv.slots_and_next_full(request.request_id)
        return True

    def _allocate_or_preempt(self, request: Request, num_computed: int, num_new: int) -> list[KVBlock] | None:
        """Allocate slots for ``request``, preempting from the end of the running list until they fit."""
        lookahead = self._lookahead(num_computed + num_new)
        while True:
            blocks = self.kv.allocate_slots(request, num_computed, num_new, num_lookahead_tokens=lookahead)
            if blocks is not None:
                return blocks
            victim = self.running.requests[-1]
            self._preempt(victim)
            if victim is request:
                return None

    def _reservation(self) -> int:
        """Draft slots to reserve per request this step: none unless even admitting every waiting request (up to
        ``max_num_seqs``) keeps the step within ``disable_by_batch_size``, so no slot is reserved for drafts the
        worker will not make. Where the step ends up smaller and drafts come anyway, scheduling them next step
        allocates their slots like any other tokens'."""
        limit = self.disable_by_batch_size
        if limit is not None and min(len(self.running) + len(self.waiting), self.max_num_seqs) > limit:
            return 0
        return self.num_lookahead_tokens

    def _lookahead(self, num_tokens_after_step: int) -> int:
        """Slots to reserve for next step's drafts, none past ``max_model_len`` (no draft is scheduled there):
        otherwise a request near ``max_model_len`` could need more blocks than the pool has and preempt itself
        forever."""
        return max(0, min(self._step_lookahead, self.max_model_len - num_tokens_after_step))

    def _scheduled_drafts(self, rows: np.ndarray, past_final: np.ndarray) -> tuple[np.ndarray | None,
                                                                                    dict[str, list[int]]]:
        """Draft tokens scheduled per scheduled row (the tokens past its final ones), and the drafts by request."""
        num_spec = np.maximum(past_final[rows], 0)
        spec: dict[str, list[int]] = {}
        for j in num_spec.nonzero()[0].tolist():
            request = self.running.requests[rows[j]]
            spec[request.request_id] = request.spec_token_ids[:num_spec[j]]
        return (num_spec if spec else None), spec

    def _sort_running(self) -> None:
        """Priority policy: lowest (priority, arrival_time) first; a stable sort, so ties keep their order."""
        requests = self.running.requests
        order = sorted(range(len(requests)), key=lambda i: (requests[i].priority, requests[i].arrival_time))
        if order != list(range(len(order))):
            self.running.reorder(order)
        self._needs_sort = False

    def _preempt(self, request: Request) -> None:
        assert request is self.running.requests[-1], "only the last running request is preempted"
        self.running.remove_rows([len(self.running) - 1])
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        request.num_preemptions += 1
        self._stats.num_preemptions += 1
        self._dropped_req_ids.add(request.request_id)
        self.waiting.add_front(request)
        logger.debug("preempted %s", request.request_id)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """End ``request`` (the caller takes it out of the running batch or the waiting queue)."""
        request.status = status
        if request.spec_token_ids:
            request.spec_token_ids = []
        self.kv.free(request)
        self._dropped_req_ids.add(request.request_id)
        self.stop_rules.remove(request)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------------------------------- stats
    def make_stats(self) -> SchedulerStats:
        """Gauges now, plus the counters accumulated since the last call."""
        stats, self._stats = self._stats, SchedulerStats()
        stats.num_running_reqs = len(self.running)
        stats.num_waiting_reqs = len(self.waiting)
        stats.kv_cache_usage = self.kv.usage
        evictions = self.kv.pool.num_evictions
        stats.kv_cache_evictions, self._evictions_seen = evictions - self._evictions_seen, evictions
        if self._spec_stats.num_drafts:
            stats.spec_decoding, self._spec_stats = self._spec_stats, SpecDecodingStats()
        if self.kv.pool.residency is not None:
            stats.kv_block_lifetimes, stats.kv_block_idle, stats.kv_block_reuse_gaps = self.kv.pool.residency.drain()
        return stats
