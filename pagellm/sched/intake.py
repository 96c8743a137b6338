"""The scheduler's output side: ``update_from_output`` takes in a step's runner output.

It appends the sampled tokens, rolls back rejected drafts, takes new drafts, applies the token-level stop rules and
reports each request's news in one ``StepOutput``, vectorised over the ``RunningBatch`` columns of the step's rows:
only the rows ``_needs_look`` picks (first output, length limit, several tokens, or a token that may stop some
unfinished request) come back to per-request Python. ``Intake`` is a part of ``Scheduler`` (which inherits it and
owns the state it reads: the running batch, the stop rules, the stats and ``_finish``); it is a module of its own
only to keep the scheduler's two halves apart. ``tests/unit/test_scheduler_fastpath.py`` overrides its hooks
(``_append_all``, ``_needs_look``, ``_check_tokens``) with a plain per-token twin.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from pagellm.kv.manager import KVCacheManager
from pagellm.metrics.stats import RequestTimes, SchedulerStats, SpecDecodingStats
from pagellm.request import FinishReason, Request, RequestStatus
from pagellm.sched.output import FirstOutput, ModelRunnerOutput, SchedulerOutput, StepOutput
from pagellm.sched.running import RunningBatch
from pagellm.sched.stop import StopRules


@dataclass(slots=True)
class _Step:
    """What ``update_from_output`` needs to know about the step ``schedule()`` produced."""

    output: SchedulerOutput
    rows: np.ndarray              # the RunningBatch row of each request of output.req_ids
    num_spec: np.ndarray | None   # draft tokens scheduled per request (None: no drafts this step)
    version: int                  # RunningBatch.version when schedule() returned


def _counts(sampled: list[int]) -> np.ndarray:
    """``sampled`` as an int64 array: ones when every count is 1 (a step of decodes), else through ``bytes`` (a C
    loop) when every count is below 256."""
    if sampled.count(1) == len(sampled):
        return np.ones(len(sampled), dtype=np.int64)
    try:
        return np.frombuffer(bytes(sampled), np.uint8).astype(np.int64)
    except ValueError:
        return np.fromiter(sampled, np.int64, len(sampled))


def _first_output(out: StepOutput, request: Request, now: float) -> None:
    """Record in ``out`` that ``request`` got its first output tokens at ``now``."""
    out.first[request.request_id] = FirstOutput(
        request.num_cached_tokens, RequestTimes(request.queued_time, request.scheduled_time, now))


class Intake:
    running: RunningBatch
    requests: dict[str, Request]
    kv: KVCacheManager
    stop_rules: StopRules
    _dropped_req_ids: set[str]
    _step: _Step | None
    _drafts_seen: bool
    _stats: SchedulerStats
    _spec_stats: SpecDecodingStats
    _finish: Callable[[Request, RequestStatus], None]  # ends a request (Scheduler's)
    _native: Any  # sched/native.py's extension module, or None

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> StepOutput:
        """Append the sampled tokens, apply stop rules, and report each request's news (the other hot loop of a
        step: vectorised, with per-request Python only for the requests ``_needs_look`` picks)."""
        rows, num_spec, runner_out = self._rows_of(sched_out, runner_out)
        batch, flat, sampled = self.running, runner_out.sampled_token_ids, runner_out.num_sampled
        out = StepOutput()
        if (self._native is not None and len(rows) == len(batch) and num_spec is None and not self._drafts_seen
                and not runner_out.draft_token_ids):  # the whole batch in order, no drafts: one native call
            looked, num_empty = self._native.take_tokens(batch._columns, len(batch), sampled, flat,
                                                         batch.token_lists, self.stop_rules.tokens)
            kept, finished = self._look_native(looked, flat, out)
            self._report(out, runner_out, kept, all_sampled=not num_empty)
        else:
            kept, finished = self._take_tokens(rows, num_spec, runner_out, out)
            self._report(out, runner_out, kept)
        if finished:
            batch.remove_rows(finished)
        self._stats.num_generation_tokens += len(out.new_token_ids)
        return out

    def _take_tokens(self, rows: np.ndarray, num_spec: np.ndarray | None, runner_out: ModelRunnerOutput,
                     out: StepOutput) -> tuple[dict[int, int], list[int]]:
        """The numpy path of ``update_from_output`` (drafts, a step that is not the whole batch, or no native
        fast path): returns what ``_look_at`` does."""
        batch, flat, sampled = self.running, runner_out.sampled_token_ids, runner_out.num_sampled
        whole = len(rows) == len(batch)  # the step's rows are the whole batch, in order (the usual case)
        at = slice(0, len(rows)) if whole else rows
        counts = _counts(sampled)
        if num_spec is not None:
            self._roll_back_drafts(rows, num_spec, counts, out)
        if self._drafts_seen or runner_out.draft_token_ids:
            self._take_drafts(rows, runner_out)
        before = batch.num_tokens[at].copy()  # ``at`` may be a slice (a view)
        after = before + counts
        batch.num_tokens[at] = after
        lists = batch.token_lists if whole else [batch.token_lists[row] for row in rows.tolist()]
        self._append_all(lists, counts, sampled, flat)
        return self._look_at(self._needs_look(after, batch.check_at[at], counts, flat).nonzero()[0],
                             rows, before, counts, flat, out)

    def _rows_of(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> tuple[
            np.ndarray, np.ndarray | None, ModelRunnerOutput]:
        """The batch row of each request the runner reports. Unless requests left the batch since ``schedule()``
        (an abort between the two calls), these are the rows ``schedule()`` recorded; otherwise requests that left
        are dropped from the runner's output."""
        step = self._step
        if step is not None and step.output is sched_out and step.version == self.running.version:
            assert len(runner_out.req_ids) == len(step.rows), "the runner must report every scheduled request"
            return step.rows, step.num_spec, runner_out
        index = {rid: row for row, rid in enumerate(self.running.req_ids)}
        rows, ids, counts, flat, num_spec, start = [], [], [], [], [], 0
        for rid, count in zip(runner_out.req_ids, runner_out.num_sampled):
            if rid in index:
                rows.append(index[rid])
                ids.append(rid)
                counts.append(count)
                flat.extend(runner_out.sampled_token_ids[start:start + count])
                num_spec.append(len(sched_out.spec_token_ids.get(rid, ())))
            start += count
        present = ModelRunnerOutput(ids, counts, flat,
                                    {r: d for r, d in runner_out.draft_token_ids.items() if r in index},
                                    {r: lp for r, lp in runner_out.logprobs.items() if r in index},
                                    {r: lp for r, lp in runner_out.prompt_logprobs.items() if r in index},
                                    {r: v for r, v in runner_out.pooled.items() if r in index})
        return np.array(rows, dtype=np.int64), (np.array(num_spec) if any(num_spec) else None), present

    def _roll_back_drafts(self, rows: np.ndarray, num_spec: np.ndarray, counts: np.ndarray, out: StepOutput) -> None:
        """A row sampled its accepted drafts + 1: the rejected drafts were computed for nothing. Each drafted request's
        verify step goes out with the step's news (drafted, accepted), which the frontend adds up, so it holds them
        whoever ends the request (a stop string, a repeat and an abort end it there)."""
        drafted = num_spec.nonzero()[0]
        sent, accepted = num_spec[drafted], counts[drafted] - 1
        self.running.computed[rows[drafted]] -= sent - accepted
        requests = self.running.requests
        for row, num_sent, num_accepted in zip(rows[drafted].tolist(), sent.tolist(), accepted.tolist()):
            self._spec_stats.observe(num_sent, num_accepted)
            request = requests[row]
            request.num_draft_tokens += num_sent
            request.num_accepted_draft_tokens += num_accepted
            out.spec_counts[request.request_id] = (num_sent, num_accepted)

    def _take_drafts(self, rows: np.ndarray, runner_out: ModelRunnerOutput) -> None:
        """Each reported request now holds the drafts proposed for it (none when the proposer gave none)."""
        batch, drafts_out = self.running, runner_out.draft_token_ids
        for row in rows[batch.num_spec[rows] > 0].tolist():
            batch.requests[row].spec_token_ids = []
        batch.num_spec[rows] = 0
        if drafts_out:
            self._drafts_seen = True
            for row, rid in zip(rows.tolist(), runner_out.req_ids):
                drafts = drafts_out.get(rid)
                if drafts:
                    batch.requests[row].spec_token_ids = drafts
                    batch.num_spec[row] = len(drafts)

    def _append_all(self, lists: list[list[int]], counts: np.ndarray, sampled: list[int], flat: list[int]) -> None:
        """Append every sampled token to its request's token list (a stop rule may cut some off afterwards)."""
        if not self._drafts_seen or counts.max(initial=0) <= 1:  # one token or none per request
            collections.deque(map(list.append, itertools.compress(lists, sampled), flat), 0)  # a loop in C
            return
        start = 0
        for tokens, count in zip(lists, sampled):
            tokens.extend(flat[start:start + count])
            start += count

    def _needs_look(self, after: np.ndarray, check_at: np.ndarray, counts: np.ndarray,
                    flat: list[int]) -> np.ndarray:
        """Which requests need per-request Python: their first output, their length limit, a token that may stop
        them, or several tokens (a stop rule may cut them). The rest cannot stop and report nothing special."""
        look = after >= check_at
        if self._drafts_seen:
            look |= counts > 1
        hits = self.stop_rules.token_hits(counts, flat)
        return look if hits is None else look | hits

    def _look_at(self, looked: np.ndarray, rows: np.ndarray, before: np.ndarray, counts: np.ndarray,
                 flat: list[int], out: StepOutput) -> tuple[dict[int, int], list[int]]:
        """Record first outputs and apply the exact stop rules to the ``looked`` requests (indices into the step);
        returns the tokens kept by the requests a stop rule cut short, and the rows of those that finished."""
        if not looked.size:
            return {}, []
        if not self._drafts_seen and len(flat) == len(counts):  # one token each (see _append_all): no sum
            starts = looked.tolist()
        else:
            starts = (counts.cumsum() - counts)[looked].tolist()
        return self._look_rows(zip(looked.tolist(), rows[looked].tolist(), starts, before[looked].tolist(),
                                   counts[looked].tolist()), flat, out)

    def _look_rows(self, looked: Iterable[tuple[int, int, int, int, int]], flat: list[int],
                   out: StepOutput) -> tuple[dict[int, int], list[int]]:
        """``_look_at`` for ``(index in the step, row, start in flat, num_tokens before, count)`` entries."""
        kept: dict[int, int] = {}
        finished: list[int] = []
        requests, now = self.running.requests, time.time()
        for j, row, start, num_before, count in looked:
            if count:
                self._look_row(requests[row], j, row, flat[start:start + count], num_before, out, kept, finished, now)
        return kept, finished

    def _look_native(self, looked: list[tuple[int, int, int, int, bool]], flat: list[int],
                     out: StepOutput) -> tuple[dict[int, int], list[int]]:
        """``_look_rows`` for the native ``take_tokens``' entries ``(row, start in flat, num_tokens before, count,
        hit)`` (the step is the whole batch in order, so a row is also its index in the step; every count is
        positive). A row whose tokens hold no stop token of any unfinished request (``hit`` false) cannot stop on a
        token: below its ``length_limit`` it only records its first output, and one token that reaches the limit
        ends it there (``StopRules.check``'s length rule), both without the per-token rules: the native
        ``settle_rows`` does that part (``_finish`` included) up to the first other row; from there on every row takes
        ``_look_row``."""
        batch, kv = self.running, self.kv
        first, finished, rest = self._native.settle_rows(
            looked, batch._columns, batch.requests, batch.req_ids, self.requests, out.finish_reasons,
            RequestStatus.FINISHED_LENGTH_CAPPED, FinishReason.LENGTH, self._dropped_req_ids, self.stop_rules.tokens,
            kv.req_blocks, kv.num_cached_blocks, kv.pool.free_queue)
        kept: dict[int, int] = {}
        if first or rest:
            now = time.time()
            for request in first:
                _first_output(out, request, now)
            for row, start, num_before, count, _ in rest:
                self._look_row(batch.requests[row], row, row, flat[start:start + count], num_before, out, kept,
                               finished, now)
        return kept, finished

    def _look_row(self, request: Request, j: int, row: int, tokens: list[int], num_before: int, out: StepOutput,
                  kept: dict[int, int], finished: list[int], now: float) -> None:
        """One looked-at row (index ``j`` in the step) that got ``tokens``: its first output, the exact stop rules,
        and what they cut or ended (into ``kept`` and ``finished``)."""
        if num_before == request.num_prompt_tokens:
            _first_output(out, request, now)
        self.running.check_at[row] = request.length_limit
        num_kept = self._check_tokens(request, tokens, num_before)
        if num_kept < len(tokens):
            kept[j] = num_kept
            self.running.num_tokens[row] = num_before + num_kept
        if request.status is not RequestStatus.RUNNING:
            finished.append(row)
            out.finish_reasons[request.request_id] = request.status.finish_reason
            if request.stop_reason is not None:
                out.stop_reasons[request.request_id] = request.stop_reason

    def _check_tokens(self, request: Request, tokens: list[int], num_before: int) -> int:
        """Apply the stop rules token by token; at the first that ends the request, drop the tokens after it and
        finish it. Returns the number of tokens kept."""
        for num_kept, token in enumerate(tokens, start=1):
            status = self.stop_rules.check(request, token, num_before + num_kept)
            if status is not None:
                del request.all_token_ids[num_before + num_kept:]
                self._finish(request, status)
                return num_kept
        return len(tokens)

    def _report(self, out: StepOutput, runner_out: ModelRunnerOutput, kept: dict[int, int],
                all_sampled: bool | None = None) -> None:
        """Fill in the step's token deltas: every request that kept tokens (or got prompt logprobs), in batch order.
        ``all_sampled``: whether every request sampled a token, when the caller knows."""
        ids, flat, sampled = runner_out.req_ids, runner_out.sampled_token_ids, runner_out.num_sampled
        prompt_logprobs = runner_out.prompt_logprobs
        if kept:  # a stop rule dropped tokens after it: keep each request's leading ones
            starts = [0, *itertools.accumulate(sampled)]
            sampled = list(sampled)
            for j, num_kept in kept.items():
                sampled[j] = num_kept
            flat = [t for start, n in zip(starts, sampled) for t in flat[start:start + n]]
        # The runner's lists are fresh each step and nothing changes them afterwards, so they are passed on as is.
        if all_sampled is None:
            all_sampled = 0 not in sampled
        if not prompt_logprobs and all_sampled:  # every request sampled (the usual case)
            out.req_ids, out.num_new_tokens, out.new_token_ids = ids, sampled, flat
        else:
            picked = [j for j, n in enumerate(sampled) if n or ids[j] in prompt_logprobs]
            out.req_ids, out.num_new_tokens = [ids[j] for j in picked], [sampled[j] for j in picked]
            out.new_token_ids, out.prompt_logprobs = flat, prompt_logprobs
        if runner_out.pooled:  # a pooling request samples its one token in the step that pools it
            out.pooled = runner_out.pooled
        if runner_out.logprobs:
            out.logprobs = dict(runner_out.logprobs) if kept else runner_out.logprobs
            for j, num_kept in kept.items():
                if ids[j] in out.logprobs:
                    out.logprobs[ids[j]] = out.logprobs[ids[j]].head(num_kept)
