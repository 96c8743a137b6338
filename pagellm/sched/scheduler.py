"""The scheduler: one token-budget rule, no phases.

Every request has ``num_computed_tokens`` chasing ``num_tokens_with_spec`` (prompt + output + draft tokens). Each
step hands out ``budget`` tokens, running requests first, then waiting ones, under ``max_num_seqs``. Chunked
prefill, prefix-cache hits, resumed preemptions and draft tokens all follow from that rule. When the KV pool runs
short, the last running request is preempted (recompute): under FCFS the newest one, under ``priority`` the
lowest-priority one (the running list is kept sorted for that policy). ``num_computed_tokens`` advances when a
request is scheduled; ``update_from_output`` rolls back rejected drafts and applies token-level stop rules.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.kv.block import KVBlock
from pagellm.kv.manager import KVCacheManager
from pagellm.metrics.stats import RequestTimes, SchedulerStats, SpecDecodingStats
from pagellm.request import Request, RequestStatus
from pagellm.sched.output import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput, NewRequestData,
                                  SchedulerOutput)
from pagellm.sched.queue import make_queue

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        num_lookahead_tokens: int = 0,
        disable_by_batch_size: int | None = None,
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.budget = config.token_budget(max_model_len)
        self.chunked_prefill = config.enable_chunked_prefill
        self.by_priority = config.scheduling_policy == "priority"
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        # The worker drafts nothing after a step of more requests than this (SpeculativeConfig); slots for drafts
        # are reserved only in steps that surely stay at or below it (``_step_lookahead``, set by ``schedule``).
        self.disable_by_batch_size = disable_by_batch_size
        self._step_lookahead = num_lookahead_tokens
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.waiting = make_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._dropped_req_ids: set[str] = set()  # workers must forget these at the next step
        self._stats = SchedulerStats()
        self._spec_stats = SpecDecodingStats()
        self._evictions_seen = 0

    # ----------------------------------------------------------------------------------------- requests in/out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.queued_time = time.time()
        params = request.sampling_params
        stops = frozenset(params.stop_token_ids or ())
        request.stop_ids = stops if params.ignore_eos else stops | frozenset(request.eos_token_ids)
        length_limit = self.max_model_len
        if request.max_tokens is not None:
            length_limit = min(length_limit, request.num_prompt_tokens + request.max_tokens)
        request.length_limit = length_limit
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        if self.by_priority:
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        self._step_lookahead = self._reservation()
        scheduled: dict[str, int] = {}
        cached_reqs = CachedRequestData()
        spec: dict[str, list[int]] = {}
        budget, preempted = self._schedule_running(self.budget, scheduled, cached_reqs, spec)
        new_reqs: list[NewRequestData] = []
        if not preempted and self.waiting:  # no room for newcomers while running requests are being pushed out
            self._schedule_waiting(budget, scheduled, new_reqs)
        total = sum(scheduled.values())
        self._stats.num_scheduled_tokens += total
        dropped, self._dropped_req_ids = self._dropped_req_ids, set()
        return SchedulerOutput(new_reqs, cached_reqs, scheduled, total, spec, sorted(dropped))

    def _schedule_running(
        self, budget: int, scheduled: dict[str, int], cached: CachedRequestData, spec: dict[str, list[int]],
    ) -> tuple[int, bool]:
        """Hand ``budget`` to the running requests in order; the per-request body is the hot loop of a step."""
        preempted = False
        running, max_len, max_lookahead = self.running, self.max_model_len, self._step_lookahead
        req_ids, computed, new_block_ids = cached.req_ids, cached.num_computed_tokens, cached.new_block_ids
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            index += 1  # preemption only removes requests behind this one, so the index stays valid
            num_computed = request.num_computed_tokens
            num_tokens = len(request.all_token_ids)
            num_new = num_tokens + len(request.spec_token_ids)
            num_new = (num_new if num_new < max_len else max_len) - num_computed
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                continue
            end = num_computed + num_new
            lookahead = self._lookahead(end) if max_lookahead else 0
            # Fast path (see KVCacheManager's contract): the step fits in held blocks, so the manager is needed
            # only when a block fills (to register it) and ``allocate_slots`` only when more blocks are needed.
            if end + lookahead <= request.kv_slots:
                if (end if end < num_tokens else num_tokens) >= request.kv_next_full:
                    self.kv.cache_full_blocks(request, end if end < num_tokens else num_tokens)
            else:
                new_blocks, preempted_now = self._allocate_or_preempt(request, num_new)
                preempted |= preempted_now
                if new_blocks is None:
                    break  # ``request`` itself was the last one and got preempted
                if new_blocks:
                    new_block_ids[request.request_id] = [b.block_id for b in new_blocks]
            request_id = request.request_id
            req_ids.append(request_id)
            computed.append(num_computed)
            if end > num_tokens:
                spec[request_id] = request.spec_token_ids[:end - num_tokens]
            scheduled[request_id] = num_new
            request.num_computed_tokens = end
            budget -= num_new
        return budget, preempted

    def _allocate_or_preempt(self, request: Request, num_new: int) -> tuple[list[KVBlock] | None, bool]:
        """Allocate slots for ``request``, preempting from the end of the running list until they fit."""
        preempted = False
        while True:
            lookahead = self._lookahead(request.num_computed_tokens + num_new)
            blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            if blocks is not None:
                return blocks, preempted
            victim = self.running[-1]
            self._preempt(victim)
            preempted = True
            if victim is request:
                return None, preempted

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

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self._stats.num_preemptions += 1
        self._dropped_req_ids.add(request.request_id)
        self.waiting.add_front(request)
        logger.debug("preempted %s", request.request_id)

    def _schedule_waiting(self, budget: int, scheduled: dict[str, int], new_reqs: list[NewRequestData]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(request, num_new, hit_blocks, self._lookahead(num_hit + num_new)) is None:
                break
            self.waiting.pop()
            self._admit(request, num_hit)
            new_reqs.append(NewRequestData(
                request.request_id, list(request.all_token_ids), request.num_prompt_tokens,
                request.sampling_params, self.kv.block_ids(request.request_id), num_hit,
                sorted(_suppressed_tokens(request)),
            ))
            scheduled[request.request_id] = num_new
            request.num_computed_tokens += num_new
            budget -= num_new

    def _admit(self, request: Request, num_hit: int) -> None:
        self.running.append(request)
        self._dropped_req_ids.discard(request.request_id)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
            request.scheduled_time = time.time()
        self._stats.prefix_cache_queries += request.num_tokens
        self._stats.prefix_cache_hits += num_hit
        self._stats.num_prompt_tokens += request.num_tokens - num_hit

    # ------------------------------------------------------------------------------------------- outputs
    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append the sampled tokens, apply stop rules, and report each request's news (hot loop of a step)."""
        outputs: list[EngineCoreOutput] = []
        requests, running = self.requests, RequestStatus.RUNNING
        spec_sent, drafts_out, logprobs_out = sched_out.spec_token_ids, runner_out.draft_token_ids, runner_out.logprobs
        prompt_logprobs_out = runner_out.prompt_logprobs
        num_generated = 0
        for request_id, sampled in zip(runner_out.req_ids, runner_out.sampled_token_ids):
            request = requests.get(request_id)
            if request is None or request.status is not running:
                continue  # aborted or preempted while the step ran
            if spec_sent:
                drafts = spec_sent.get(request_id)
                if drafts:
                    request.num_computed_tokens -= len(drafts) + 1 - len(sampled)
                    self._spec_stats.observe(len(drafts), len(sampled) - 1)
            if drafts_out:
                request.spec_token_ids = drafts_out.get(request_id, [])
            elif request.spec_token_ids:
                request.spec_token_ids = []
            prompt_logprobs = prompt_logprobs_out.get(request_id) if prompt_logprobs_out else None
            first = not request.output_token_ids
            if not sampled:
                if prompt_logprobs is None:
                    continue  # mid-prompt: nothing to report
                new_tokens, first = [], False  # a prompt chunk scored for prompt_logprobs
            elif len(sampled) == 1:
                token = sampled[0]
                request.output_token_ids.append(token)
                request.all_token_ids.append(token)
                # One set look-up and one comparison rule out every stop; the exact rules run only if they hit.
                if token in request.stop_ids or len(request.all_token_ids) >= request.length_limit:
                    self._stop_if_done(request, token)
                new_tokens = sampled
            else:
                new_tokens = self._append_tokens(request, sampled)
            num_generated += len(new_tokens)
            logprobs = logprobs_out.get(request_id) if logprobs_out else None
            if logprobs is not None:  # a stop rule may have cut the accepted tokens: cut their logprobs too
                logprobs = logprobs.head(len(new_tokens))
            status = request.status
            outputs.append(EngineCoreOutput(
                request_id, new_tokens, None if status is running else status.finish_reason, request.stop_reason,
                request.num_cached_tokens, logprobs,
                RequestTimes(request.queued_time, request.scheduled_time, time.time()) if first else None,
                prompt_logprobs))
        self._stats.num_generation_tokens += num_generated
        return outputs

    def _append_tokens(self, request: Request, sampled: list[int]) -> list[int]:
        """Several tokens (accepted drafts + 1): append one at a time, stopping at the first stop rule."""
        kept: list[int] = []
        for token in sampled:
            request.append_output_token(token)
            kept.append(token)
            if self._stop_if_done(request, token):
                break
        return kept

    def _stop_if_done(self, request: Request, token: int) -> bool:
        status = self._check_stop(request, token)
        if status is None:
            return False
        self.running.remove(request)
        self._finish(request, status)
        return True

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.spec_token_ids = []
        self.kv.free(request)
        self._dropped_req_ids.add(request.request_id)
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
        return stats


def _suppressed_tokens(request: Request) -> set[int]:
    """Tokens the sampler must not pick while fewer than ``min_tokens`` tokens were generated."""
    params = request.sampling_params
    if params.min_tokens <= request.num_output_tokens:
        return set()
    stops = set(params.stop_token_ids or ())
    return stops if params.ignore_eos else stops | set(request.eos_token_ids)
