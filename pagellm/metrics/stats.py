"""Plain stats objects; exporters (the log line, Prometheus, traces, the dashboard) read them.

Two producers, one consumer side:
- The engine core fills a ``SchedulerStats`` each step (gauges now + counters of the step) and stamps each request's
  core-side times (``RequestTimes``: queued, first scheduled, first token) on the request's first output.
- The frontend's output processor turns each step's outputs into an ``IterationStats``: the tokens it returned, the
  time to first token and inter-token gaps it saw, and one ``FinishedRequestStats`` per request that ended.
Both cross into ``metrics.sink.StatsSink`` implementations, which alone know about exporters. No exporter library is
imported here, so the core stays free of metrics dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec


class SpecDecodingStats(msgspec.Struct, omit_defaults=True):
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.append(0)
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def add(self, step: SpecDecodingStats) -> None:
        """Sum another step's counts into these."""
        self.num_drafts += step.num_drafts
        self.num_draft_tokens += step.num_draft_tokens
        self.num_accepted_tokens += step.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(step.num_accepted_tokens_per_pos) - len(per_pos)))
        for pos, count in enumerate(step.num_accepted_tokens_per_pos):
            per_pos[pos] += count

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: the accepted drafts plus the corrected or bonus token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Per draft position (tree depth), the share of drafts whose token there was accepted."""
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos] if self.num_drafts else []


class CoreGauges(msgspec.Struct):
    """One data-parallel engine core's gauges (``SchedulerStats.engine_cores``)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """One step's view: gauges are current values, the rest count events during the step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0          # tokens looked up
    prefix_cache_hits: int = 0             # tokens found
    num_preemptions: int = 0
    num_prompt_tokens: int = 0             # prompt tokens computed (prefix hits excluded)
    num_generation_tokens: int = 0         # tokens sampled and kept
    num_scheduled_tokens: int = 0
    kv_cache_evictions: int = 0            # cached blocks whose contents were dropped to make room
    spec_decoding: SpecDecodingStats | None = None
    # --kv-cache-metrics: the step's evicted sampled blocks' lifetimes and idle times, and their reuse gaps (seconds)
    kv_block_lifetimes: list[float] = []
    kv_block_idle: list[float] = []
    kv_block_reuse_gaps: list[float] = []
    # With data parallelism: each core's own gauges, in core order (the gauges above are their sum and mean)
    engine_cores: list[CoreGauges] = []

    def accumulate(self, step: SchedulerStats) -> None:
        """Take a step into these totals: gauges take the step's value, every other number (a per-step counter) is
        summed."""
        for name in SchedulerStats.__struct_fields__:
            value = getattr(step, name)
            if name in _GAUGES:
                setattr(self, name, value)
            elif name == "spec_decoding":
                if value is not None:
                    self.spec_decoding = self.spec_decoding or SpecDecodingStats()
                    self.spec_decoding.add(value)
            else:
                setattr(self, name, getattr(self, name) + value)


_GAUGES = frozenset({"num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "engine_cores"})


class RequestTimes(msgspec.Struct, array_like=True):
    """Core-side wall-clock times (``time.time()``) of one request, sent once with its first output tokens.

    All three come from the core's clock, so the queue and prefill intervals never mix two processes' clocks.
    """

    queued: float            # added to the scheduler's waiting queue
    scheduled: float         # first admitted into the running batch
    first_token: float       # its first output token was produced


@dataclass
class RequestStats:
    """What the frontend tracks per live request for metrics and traces (plain data, no exporter)."""

    arrival_time: float
    num_prompt_tokens: int
    params: Any = None                    # the request's SamplingParams (for trace attributes)
    caller_id: str | None = None          # the id the API caller sees, when it differs from the core id
    trace_context: Any = None             # the OpenTelemetry parent context, when tracing is on
    core_times: RequestTimes | None = None
    first_token_time: float = 0.0         # frontend clock, 0 until the first token arrives
    last_token_time: float = 0.0
    num_generation_tokens: int = 0


@dataclass
class FinishedRequestStats:
    """One request that ended on its own (stop or length), with every interval the histograms need."""

    request_id: str
    finish_reason: str
    stats: RequestStats
    finished_time: float

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.stats.arrival_time

    @property
    def time_to_first_token(self) -> float:
        return self.stats.first_token_time - self.stats.arrival_time

    @property
    def queue_time(self) -> float:
        times = self.stats.core_times
        return 0.0 if times is None else max(0.0, times.scheduled - times.queued)

    @property
    def prefill_time(self) -> float:
        times = self.stats.core_times
        return 0.0 if times is None else max(0.0, times.first_token - times.scheduled)

    @property
    def decode_time(self) -> float:
        return max(0.0, self.stats.last_token_time - self.stats.first_token_time)

    @property
    def time_per_output_token(self) -> float | None:
        """Mean gap between output tokens after the first; None for a one-token output."""
        n = self.stats.num_generation_tokens
        return self.decode_time / (n - 1) if n > 1 else None


@dataclass
class IterationStats:
    """What the frontend saw in one batch of core outputs (one engine step)."""

    time: float = 0.0
    num_prompt_tokens: int = 0                 # prompts of requests whose first token arrived now
    num_generation_tokens: int = 0             # output tokens returned now
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)  # one per request that got tokens again
    finished: list[FinishedRequestStats] = field(default_factory=list)
    num_aborted: int = 0                       # requests aborted (client gone, explicit abort)
    admission_rejections: dict[str, int] = field(default_factory=dict)  # requests refused, by the limit they hit

    def observe_tokens(self, stats: RequestStats, num_new_tokens: int, core_times: RequestTimes | None,
                       now: float) -> None:
        """One request's output in this step: its first token (TTFT) or a later one (an inter-token gap)."""
        if core_times is not None:
            stats.core_times = core_times
        if num_new_tokens == 0:
            return
        if stats.num_generation_tokens == 0:
            stats.first_token_time = now
            self.time_to_first_tokens.append(now - stats.arrival_time)
            self.num_prompt_tokens += stats.num_prompt_tokens
        else:
            self.inter_token_latencies.append(now - stats.last_token_time)
        stats.last_token_time = now
        stats.num_generation_tokens += num_new_tokens
        self.num_generation_tokens += num_new_tokens

    def observe_finished(self, request_id: str, finish_reason: str, stats: RequestStats, now: float) -> None:
        self.finished.append(FinishedRequestStats(request_id, finish_reason, stats, now))
