"""The periodic stats log line: one INFO line every few seconds while the engine is busy, none while idle.

``LogStatsSink`` adds up what it is given between two lines and, on the first ``record`` at least ``interval_s``
after the window opened, logs::

    Engine: prompt 812.3 tok/s, generation 402.5 tok/s | running 32, waiting 4 | KV cache 41.2% |
    prefix-cache hit rate 37.5% | preemptions 0 [| spec decode: acceptance 61.0%, 1.83 accepted tokens per draft]

Rates are over the window, which opens at its first event and closes at the last event before an idle spell
longer than the interval (so idle time never dilutes them; such a burst is logged over its own span when it lasted
at least a second). The hit rate is
over the prompt tokens looked up in the window ("-" when none), gauges are the latest values. The speculative part
appears only when drafts were verified. An idle engine records nothing, so it logs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from pagellm.metrics.stats import IterationStats, SchedulerStats

logger = logging.getLogger("pagellm.stats")

DEFAULT_INTERVAL_S = 5.0
MIN_RATE_SPAN_S = 1.0  # a burst shorter than this before an idle spell is not logged (its rate would be noise)


class LogStatsSink:
    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 log: Callable[..., None] | None = None) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._log = log or logger.info
        self._lock = threading.Lock()
        self._gauges = SchedulerStats()
        self._reset(None)

    def _reset(self, start: float | None) -> None:
        self._start = start  # None: the window opens at the next event
        self._last = start or 0.0
        self.prompt_tokens = self.generation_tokens = 0
        self.prefix_queries = self.prefix_hits = self.preemptions = 0
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = 0

    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats | None) -> None:
        with self._lock:
            now = self._clock()
            if self._start is not None and now - self._last > self.interval_s:
                self._close_idle_window()
            if self._start is None:
                self._start = now
            self._last = now
            if scheduler is not None:
                self._add_scheduler(scheduler)
            if iteration is not None:
                self.prompt_tokens += iteration.num_prompt_tokens
                self.generation_tokens += iteration.num_generation_tokens
            if now - self._start >= self.interval_s and self._busy():
                self._log("%s", self.format_line(now - self._start))
                self._reset(None)

    def _close_idle_window(self) -> None:
        """The engine went idle mid-window: log that burst over its own span (if long enough to give a rate)."""
        if self._last - self._start >= MIN_RATE_SPAN_S and self._busy():  # type: ignore[operator]
            self._log("%s", self.format_line(self._last - self._start))  # type: ignore[operator]
        self._reset(None)

    def _add_scheduler(self, stats: SchedulerStats) -> None:
        self._gauges = stats
        self.prefix_queries += stats.prefix_cache_queries
        self.prefix_hits += stats.prefix_cache_hits
        self.preemptions += stats.num_preemptions
        if stats.spec_decoding is not None:
            self.spec_drafts += stats.spec_decoding.num_drafts
            self.spec_draft_tokens += stats.spec_decoding.num_draft_tokens
            self.spec_accepted += stats.spec_decoding.num_accepted_tokens

    def _busy(self) -> bool:
        g = self._gauges
        return bool(self.prompt_tokens or self.generation_tokens or g.num_running_reqs or g.num_waiting_reqs)

    def format_line(self, elapsed: float) -> str:
        g = self._gauges
        hit_rate = f"{100 * self.prefix_hits / self.prefix_queries:.1f}%" if self.prefix_queries else "-"
        line = (f"Engine: prompt {self.prompt_tokens / elapsed:.1f} tok/s, generation "
                f"{self.generation_tokens / elapsed:.1f} tok/s | running {g.num_running_reqs}, waiting "
                f"{g.num_waiting_reqs} | KV cache {100 * g.kv_cache_usage:.1f}% | prefix-cache hit rate {hit_rate} | "
                f"preemptions {self.preemptions}")
        if self.spec_drafts:
            line += (f" | spec decode: acceptance {100 * self.spec_accepted / self.spec_draft_tokens:.1f}%, "
                     f"{self.spec_accepted / self.spec_drafts:.2f} accepted tokens per draft")
        return line

    def shutdown(self) -> None:
        pass
