"""The stats sink: the one interface between the frontend engine and every stats exporter.

``AsyncLLM`` hands each batch of core outputs to its sink as plain data: the core's ``SchedulerStats`` (gauges and
per-step counters; None for a batch that carried none) and the frontend's ``IterationStats`` (tokens, TTFT,
inter-token gaps, finished and aborted requests). Exporters (``prometheus.PrometheusSink``, ``log.LogStatsSink``,
``tracing.TracingSink``, ``history.StatsHistory``) implement ``record``; ``FanoutSink`` feeds several;
``NullStatsSink`` is what runs when stats are off, so the hot path never asks whether a feature is enabled.

``record`` runs on the engine client's output thread, once per engine step: implementations must be quick and must
not block (exports happen in their own threads or on scrape).
"""

from __future__ import annotations

import logging
from typing import Protocol, Sequence

from pagellm.metrics.stats import IterationStats, SchedulerStats

logger = logging.getLogger(__name__)


class StatsSink(Protocol):
    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats | None) -> None: ...

    def shutdown(self) -> None: ...


class NullStatsSink:
    """Stats off: drops everything."""

    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats | None) -> None:
        pass

    def shutdown(self) -> None:
        pass


class FanoutSink:
    """Feeds several sinks in order; one sink's error is logged and never reaches the engine."""

    def __init__(self, sinks: Sequence[StatsSink]) -> None:
        self.sinks = list(sinks)

    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats | None) -> None:
        for sink in self.sinks:
            try:
                sink.record(scheduler, iteration)
            except Exception:  # a metrics bug must not take serving down
                logger.exception("stats sink %s failed", type(sink).__name__)

    def shutdown(self) -> None:
        for sink in self.sinks:
            sink.shutdown()


def combine(sinks: Sequence[StatsSink]) -> StatsSink:
    """The cheapest sink that feeds all of ``sinks``: the null sink for none, the sink itself for one."""
    if not sinks:
        return NullStatsSink()
    return sinks[0] if len(sinks) == 1 else FanoutSink(sinks)
