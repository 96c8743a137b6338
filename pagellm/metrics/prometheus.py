"""Prometheus export: the frontend's stats sink that turns plain stats into ``pagellm:*`` series.

Contract:
- ``PrometheusSink(model_name, cache_config, ...)`` registers every series (only the build and cache-config info
  with ``engine_series=False``, when stats are off and the sink is never fed) in its own ``CollectorRegistry`` (so
  several engines in one process never clash), each labelled ``model_name``; names mirror vLLM's with the
  ``pagellm:`` prefix, so a vLLM dashboard ports by renaming. ``docs/metrics.md`` lists them all.
- ``record`` is called once per engine step with the core's ``SchedulerStats`` (gauges, prefix cache, preemptions,
  evictions, speculative decoding, tokens per step) and the frontend's ``IterationStats`` (tokens, TTFT,
  inter-token gaps, one observation per finished request in each request histogram, aborts).
- ``render()`` gives the text exposition for ``GET /metrics``. With ``PROMETHEUS_MULTIPROC_DIR`` set (several API
  worker processes), values live in that directory's files and ``render()`` aggregates every process's: counters
  and histograms add up, engine gauges take the most recent value.
"""

from __future__ import annotations

import logging
import math
import os
import platform
from typing import Any, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from pagellm.metrics.stats import IterationStats, SchedulerStats, SpecDecodingStats

logger = logging.getLogger(__name__)

# ``*_created`` timestamps double every counter's series and no dashboard reads them.
prometheus_client.disable_created_metrics()

PREFIX = "pagellm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "repetition")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")  # the limits a new request may be refused by

# Buckets span a fast GPU (milliseconds) and a small CPU box (seconds to minutes).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                         0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
RESIDENCY_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600,
                     1200, 1800]  # a KV block's reuse gaps (ms) to its lifetime (half an hour), as vLLM's
# vLLM's histogram bucket families (``--custom-histogram-buckets``); the last two name vLLM series pagellm has not
BUCKET_FAMILIES = ("request_latency", "time_to_first_token", "inter_token_latency", "iteration_tokens",
                   "request_tokens", "kv_cache_residency", "request_params_n", "request_num_preemptions")


def check_buckets(value: Any) -> dict[str, list[float]]:
    """``--custom-histogram-buckets``' mapping, checked: known families, each a non-empty list of strictly
    increasing, positive, finite bounds (ValueError naming what to fix); families of vLLM series pagellm has not are
    taken with a warning."""
    if not isinstance(value, dict):
        raise ValueError(f"custom histogram buckets must be a JSON object of family: [bounds], got {value!r}")
    for family, bounds in value.items():
        if family not in BUCKET_FAMILIES:
            raise ValueError(f"custom histogram buckets: unknown family {family!r}; known: "
                             f"{', '.join(BUCKET_FAMILIES)}")
        numbers = isinstance(bounds, list) and bounds and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and b > 0 for b in bounds)
        if not numbers or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"custom histogram buckets[{family!r}]: give a non-empty list of positive, finite, "
                             f"strictly increasing bounds, got {bounds!r}")
    unused = [family for family in value if family in BUCKET_FAMILIES[6:]]
    if unused:
        logger.warning("custom histogram buckets: pagellm has no series of the families %s; their bounds change "
                       "nothing", ", ".join(unused))
    return {family: [float(b) for b in bounds] for family, bounds in value.items()}


def token_count_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (the context length)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(value)
        scale *= 10


class PrometheusSink:
    """Stats sink feeding Prometheus series (see the module docstring)."""

    def __init__(self, model_name: str, cache_config: Any = None, max_model_len: int = 4096,
                 num_blocks: int = 0, registry: CollectorRegistry | None = None, engine_series: bool = True,
                 buckets: dict[str, list[float]] | None = None) -> None:
        import pagellm

        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = {"model_name": model_name}
        self._labels = labels
        self._buckets = buckets or {}  # bucket family → bounds that replace its defaults (--custom-histogram-buckets)
        if engine_series:  # False (stats off): only the info series, rather than engine series stuck at zero
            self._make_gauges(labels)
            self._make_counters(labels)
            self._make_histograms(labels, max_model_len)
        info = self._gauge("build_info", "pagellm build: version and Python", ["version", "python"])
        info.labels(version=pagellm.__version__, python=platform.python_version(), **labels).set(1)
        if cache_config is not None:
            self._cache_info(cache_config, num_blocks)

    # ------------------------------------------------------------------------------------------- series
    def _gauge(self, name: str, doc: str, extra: Sequence[str] = (), mode: str = "mostrecent") -> Gauge:
        return Gauge(PREFIX + name, doc, ["model_name", *extra], registry=self.registry, multiprocess_mode=mode)

    def _counter(self, name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
        return Counter(PREFIX + name, doc, ["model_name", *extra], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: list[float], family: str) -> Histogram:
        return Histogram(PREFIX + name, doc, ["model_name"], buckets=self._buckets.get(family, buckets),
                         registry=self.registry)

    def _make_gauges(self, labels: dict[str, str]) -> None:
        self.running = self._gauge("num_requests_running", "Requests in the running batch").labels(**labels)
        self.waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled").labels(**labels)
        self.kv_usage = self._gauge("kv_cache_usage_perc",
                                    "Fraction of KV-cache blocks in use (0 to 1)").labels(**labels)
        self.cores = (  # data parallelism: each engine core's, labelled by its index
            self._gauge("engine_core_num_requests_running", "One data-parallel engine core's running requests",
                        ["engine"]),
            self._gauge("engine_core_num_requests_waiting", "One data-parallel engine core's waiting requests",
                        ["engine"]),
            self._gauge("engine_core_kv_cache_usage_perc", "One data-parallel engine core's fraction of its KV-cache "
                        "blocks in use (0 to 1)", ["engine"]))

    def _make_counters(self, labels: dict[str, str]) -> None:
        c = self._counter
        self.preemptions = c("num_preemptions", "Requests preempted (recomputed later)").labels(**labels)
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of requests that produced a first token "
                                               "(prefix-cache hits included)").labels(**labels)
        self.generation_tokens = c("generation_tokens", "Output tokens returned").labels(**labels)
        success = c("request_success", "Requests that finished, by finish reason", ["finished_reason"])
        self.success = {reason: success.labels(finished_reason=reason, **labels) for reason in FINISH_REASONS}
        self.prefix_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache").labels(**labels)
        self.prefix_hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache").labels(**labels)
        self.evictions = c("kv_cache_evictions", "KV blocks whose cached contents were evicted").labels(**labels)
        self.aborted = c("num_aborted_requests", "Requests aborted before finishing").labels(**labels)
        rejected = c("admission_rejections", "Requests refused (HTTP 503) by a queue limit, by the limit", ["reason"])
        self.rejected = {reason: rejected.labels(reason=reason, **labels) for reason in ADMISSION_REASONS}
        self.spec_drafts = c("spec_decode_num_drafts", "Draft proposals verified").labels(**labels)
        self.spec_draft_tokens = c("spec_decode_num_draft_tokens", "Draft tokens verified").labels(**labels)
        self.spec_accepted = c("spec_decode_num_accepted_tokens", "Draft tokens accepted").labels(**labels)
        self.spec_per_pos = c("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position",
                              ["position"])

    def _make_histograms(self, labels: dict[str, str], max_model_len: int) -> None:
        h = self._histogram
        counts = token_count_buckets(max_model_len)
        ttft, itl, latency = (TTFT_BUCKETS, "time_to_first_token"), (TOKEN_LATENCY_BUCKETS, "inter_token_latency"), \
            (REQUEST_LATENCY_BUCKETS, "request_latency")
        self.ttft = h("time_to_first_token_seconds", "Arrival to first token", *ttft).labels(**labels)
        self.itl = h("inter_token_latency_seconds", "Gap between a request's successive outputs", *itl).labels(**labels)
        self.tpot = h("request_time_per_output_token_seconds", "Per request: decode time / (output tokens - 1)",
                      *itl).labels(**labels)
        self.e2e = h("e2e_request_latency_seconds", "Arrival to last token", *latency).labels(**labels)
        self.queue = h("request_queue_time_seconds", "Time waiting before first scheduled", *latency).labels(**labels)
        self.prefill = h("request_prefill_time_seconds", "First scheduled to first token", *latency).labels(**labels)
        self.decode = h("request_decode_time_seconds", "First token to last token", *latency).labels(**labels)
        self.req_prompt = h("request_prompt_tokens", "Prompt length of finished requests", counts,
                            "request_tokens").labels(**labels)
        self.req_generation = h("request_generation_tokens", "Output length of finished requests", counts,
                                "request_tokens").labels(**labels)
        self.iteration_tokens = h("iteration_tokens_total", "Tokens computed per engine step",
                                  ITERATION_TOKEN_BUCKETS, "iteration_tokens").labels(**labels)
        residency = (RESIDENCY_BUCKETS, "kv_cache_residency")  # --kv-cache-metrics' (kv/residency.py)
        self.kv_lifetime = h("kv_block_lifetime_seconds", "A sampled KV block's allocation to its eviction",
                             *residency).labels(**labels)
        self.kv_idle = h("kv_block_idle_before_evict_seconds", "A sampled KV block's last use to its eviction",
                         *residency).labels(**labels)
        self.kv_reuse_gap = h("kv_block_reuse_gap_seconds", "Gaps between a sampled KV block's prefix-cache hits",
                              *residency).labels(**labels)

    def _cache_info(self, cache_config: Any, num_blocks: int) -> None:
        info = self._gauge("cache_config_info", "KV-cache configuration",
                           ["block_size", "num_blocks", "enable_prefix_caching", "kv_cache_memory", "cache_dtype"])
        info.labels(block_size=str(cache_config.block_size), num_blocks=str(num_blocks),
                    enable_prefix_caching=str(cache_config.enable_prefix_caching).lower(),
                    kv_cache_memory=str(cache_config.kv_cache_memory), cache_dtype=cache_config.kv_cache_dtype,
                    **self._labels).set(1)

    # ------------------------------------------------------------------------------------------- recording
    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats | None) -> None:
        if scheduler is not None:
            self._record_scheduler(scheduler)
        if iteration is not None:
            self._record_iteration(iteration)

    def _record_scheduler(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        for index, core in enumerate(stats.engine_cores):
            for gauge, value in zip(self.cores, (core.num_running_reqs, core.num_waiting_reqs, core.kv_cache_usage)):
                gauge.labels(engine=str(index), **self._labels).set(value)
        self.preemptions.inc(stats.num_preemptions)
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        self.evictions.inc(stats.kv_cache_evictions)
        if stats.num_scheduled_tokens:  # a between-steps snapshot (``get_stats``) ran no step
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        if stats.spec_decoding is not None:
            self._record_spec(stats.spec_decoding)
        for histogram, values in ((self.kv_lifetime, stats.kv_block_lifetimes), (self.kv_idle, stats.kv_block_idle),
                                  (self.kv_reuse_gap, stats.kv_block_reuse_gaps)):
            for value in values:
                histogram.observe(value)

    def _record_spec(self, spec: SpecDecodingStats) -> None:
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted.inc(spec.num_accepted_tokens)
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            self.spec_per_pos.labels(position=str(position), **self._labels).inc(count)

    def _record_iteration(self, it: IterationStats) -> None:
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        self.aborted.inc(it.num_aborted)
        for reason, count in it.admission_rejections.items():
            self.rejected[reason].inc(count)
        for value in it.time_to_first_tokens:
            self.ttft.observe(value)
        for value in it.inter_token_latencies:
            self.itl.observe(value)
        for done in it.finished:
            self.success[done.finish_reason].inc()
            self.e2e.observe(done.e2e_latency)
            self.queue.observe(done.queue_time)
            self.prefill.observe(done.prefill_time)
            self.decode.observe(done.decode_time)
            self.req_prompt.observe(done.stats.num_prompt_tokens)
            self.req_generation.observe(done.stats.num_generation_tokens)
            tpot = done.time_per_output_token
            if tpot is not None:
                self.tpot.observe(tpot)

    # ------------------------------------------------------------------------------------------- export
    def render(self) -> bytes:
        return render(self.registry)

    def shutdown(self) -> None:
        pass


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition of ``registry``, or of every process's values in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        return generate_latest(merged)
    return generate_latest(registry)
