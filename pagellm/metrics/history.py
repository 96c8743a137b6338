"""A short in-memory history of the engine's stats, one point per second, for the live dashboard.

``StatsHistory`` is a stats sink: each second gets a bucket of what happened in it (tokens, prefix-cache lookups,
finished requests' TTFT and TPOT) and the latest gauges (running, waiting, KV usage). ``snapshot()`` returns the
last ``window_s`` seconds as plain lists (JSON-ready, one entry per second, idle seconds included): prompt and
generation tokens/s, running and waiting requests, KV-cache usage, the prefix-cache hit rate over the trailing
``rate_window_s`` seconds, and TTFT/TPOT p50/p95 over the requests finished in the trailing ``latency_window_s``
seconds (null where none finished). It is per process: with several API workers each shows its own.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from pagellm.metrics.stats import IterationStats, SchedulerStats


@dataclass
class _Bucket:
    second: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    finished: int = 0
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)


class StatsHistory:
    def __init__(self, window_s: int = 300, rate_window_s: int = 10, latency_window_s: int = 30,
                 clock: Callable[[], float] = time.time) -> None:
        self.window_s = window_s
        self.rate_window_s = rate_window_s
        self.latency_window_s = latency_window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: deque[_Bucket] = deque()
        self._gauges: dict[int, tuple[int, int, float]] = {}  # second → (running, waiting, kv usage), latest
        self._last_gauges = (0, 0, 0.0)
        self.total_finished = 0

    # ------------------------------------------------------------------------------------------- recording
    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats | None) -> None:
        with self._lock:
            bucket = self._bucket(int(self._clock()))
            if scheduler is not None:
                bucket.prefix_queries += scheduler.prefix_cache_queries
                bucket.prefix_hits += scheduler.prefix_cache_hits
                self._last_gauges = (scheduler.num_running_reqs, scheduler.num_waiting_reqs,
                                     scheduler.kv_cache_usage)
                self._gauges[bucket.second] = self._last_gauges
            if iteration is not None:
                bucket.prompt_tokens += iteration.num_prompt_tokens
                bucket.generation_tokens += iteration.num_generation_tokens
                bucket.ttfts.extend(iteration.time_to_first_tokens)
                for done in iteration.finished:
                    bucket.finished += 1
                    tpot = done.time_per_output_token
                    if tpot is not None:
                        bucket.tpots.append(tpot)
                self.total_finished += len(iteration.finished)

    def _bucket(self, second: int) -> _Bucket:
        if not self._buckets or self._buckets[-1].second < second:
            self._buckets.append(_Bucket(second))
            self._trim(second)
        return self._buckets[-1]  # a late record from the previous second lands in the newest: harmless

    def _trim(self, now: int) -> None:
        horizon = now - self.window_s - max(self.rate_window_s, self.latency_window_s)
        while self._buckets and self._buckets[0].second < horizon:
            self._gauges.pop(self._buckets.popleft().second, None)

    # ------------------------------------------------------------------------------------------- reading
    def snapshot(self, window_s: int | None = None) -> dict[str, Any]:
        """The last ``window_s`` seconds (default: all kept), one point per second up to the current second."""
        with self._lock:
            now = int(self._clock())
            span = min(window_s or self.window_s, self.window_s)
            by_second = {b.second: b for b in self._buckets}
            seconds = list(range(now - span + 1, now + 1))
            series: dict[str, list[Any]] = {k: [] for k in (
                "time", "prompt_tokens_per_s", "generation_tokens_per_s", "running", "waiting", "kv_cache_usage",
                "prefix_cache_hit_rate", "ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "finished")}
            gauges = self._gauges_before(seconds[0])
            for second in seconds:
                bucket = by_second.get(second) or _Bucket(second)
                gauges = self._gauges.get(second, gauges)
                self._append_point(series, second, bucket, gauges, by_second)
            return {"now": now, "total_finished": self.total_finished, "series": series}

    def _gauges_before(self, second: int) -> tuple[int, int, float]:
        earlier = [s for s in self._gauges if s < second]
        return self._gauges[max(earlier)] if earlier else (0, 0, 0.0)

    def _append_point(self, series: dict[str, list[Any]], second: int, bucket: _Bucket,
                      gauges: tuple[int, int, float], by_second: dict[int, _Bucket]) -> None:
        series["time"].append(second)
        series["prompt_tokens_per_s"].append(bucket.prompt_tokens)
        series["generation_tokens_per_s"].append(bucket.generation_tokens)
        series["running"].append(gauges[0])
        series["waiting"].append(gauges[1])
        series["kv_cache_usage"].append(gauges[2])
        series["finished"].append(bucket.finished)
        recent = [by_second[s] for s in range(second - self.rate_window_s + 1, second + 1) if s in by_second]
        queries = sum(b.prefix_queries for b in recent)
        series["prefix_cache_hit_rate"].append(sum(b.prefix_hits for b in recent) / queries if queries else None)
        window = [by_second[s] for s in range(second - self.latency_window_s + 1, second + 1) if s in by_second]
        ttfts = sorted(v for b in window for v in b.ttfts)
        tpots = sorted(v for b in window for v in b.tpots)
        series["ttft_p50"].append(percentile(ttfts, 50))
        series["ttft_p95"].append(percentile(ttfts, 95))
        series["tpot_p50"].append(percentile(tpots, 50))
        series["tpot_p95"].append(percentile(tpots, 95))

    def shutdown(self) -> None:
        pass


def percentile(sorted_values: list[float], pct: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
    return sorted_values[rank - 1]
