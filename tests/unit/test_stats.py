"""Stats without a model: the scheduler's per-step stats and request timings, and each stats sink on hand-made
stats (log line, dashboard history, Prometheus series incl. multiprocess aggregation, trace spans)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from sched_fakes import make_request, make_scheduler, step

from pagellm.config import CacheConfig
from pagellm.metrics.history import StatsHistory, percentile
from pagellm.metrics.log import LogStatsSink
from pagellm.metrics.prometheus import PrometheusSink
from pagellm.metrics.stats import (IterationStats, RequestStats, RequestTimes, SchedulerStats,
                                   SpecDecodingStats)
from pagellm.sampling_params import SamplingParams


# ----------------------------------------------------------------------------------------------- scheduler
def test_core_times_come_once_with_the_first_tokens():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("A", range(500, 540), max_tokens=3))  # 40 tokens: 3 chunked steps to token 1
    outputs = [step(sched)[1] for _ in range(5)]
    assert [len(o) for o in outputs] == [0, 0, 1, 1, 1]
    times = outputs[2][0].times
    assert isinstance(times, RequestTimes) and times.queued <= times.scheduled <= times.first_token
    assert outputs[3][0].times is None and outputs[4][0].times is None


def test_step_stats_add_up_to_preemptions_and_evictions():
    sched = make_scheduler(num_blocks=5, max_num_seqs=4)
    requests = [make_request(r, range(600 + 30 * i, 624 + 30 * i), max_tokens=30) for i, r in enumerate("ABC")]
    for request in requests:
        sched.add_request(request)
    totals = SchedulerStats()
    while sched.has_unfinished_requests():
        step(sched)
        stats = sched.make_stats()
        totals.num_preemptions += stats.num_preemptions
        totals.kv_cache_evictions += stats.kv_cache_evictions
        totals.num_generation_tokens += stats.num_generation_tokens
    assert totals.num_preemptions == sum(r.num_preemptions for r in requests) > 0
    assert totals.kv_cache_evictions == sched.kv.pool.num_evictions > 0
    assert totals.num_generation_tokens == 90


# ----------------------------------------------------------------------------------------------- helpers
def finished_request(e2e: float = 2.0, tokens: int = 5, reason: str = "length") -> IterationStats:
    stats = RequestStats(100.0, 12, SamplingParams(temperature=0.5, max_tokens=tokens), "req-1")
    stats.core_times = RequestTimes(100.1, 100.3, 100.5)
    stats.first_token_time, stats.last_token_time, stats.num_generation_tokens = 100.6, 100.0 + e2e, tokens
    it = IterationStats(100.0 + e2e, num_prompt_tokens=12, num_generation_tokens=tokens)
    it.time_to_first_tokens.append(0.6)
    it.inter_token_latencies.extend([0.25] * (tokens - 1))
    it.observe_finished("req-1-0", reason, stats, 100.0 + e2e)
    return it


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------------------------------------- log line
def test_log_line_every_interval_while_busy_and_quiet_when_idle():
    clock, lines = FakeClock(), []
    sink = LogStatsSink(5.0, clock, lambda fmt, *args: lines.append(fmt % args))
    busy = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25, prefix_cache_queries=100,
                          prefix_cache_hits=40, num_preemptions=2)
    sink.record(busy, IterationStats(num_prompt_tokens=100, num_generation_tokens=10))
    clock.now += 4.0
    sink.record(SchedulerStats(num_running_reqs=3), IterationStats(num_generation_tokens=10))
    assert lines == []
    clock.now += 1.0
    sink.record(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5), IterationStats(num_generation_tokens=20))
    assert lines == ["Engine: prompt 20.0 tok/s, generation 8.0 tok/s | running 2, waiting 0 | KV cache 50.0% | "
                     "prefix-cache hit rate 40.0% | preemptions 2"]
    clock.now += 60.0  # idle: nothing recorded, nothing logged; the next window starts at its first event
    spec = SpecDecodingStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6)
    sink.record(SchedulerStats(num_running_reqs=1, spec_decoding=spec), IterationStats(num_generation_tokens=5))
    clock.now += 5.0
    sink.record(SchedulerStats(), IterationStats(num_generation_tokens=5))
    assert lines[1] == ("Engine: prompt 0.0 tok/s, generation 2.0 tok/s | running 0, waiting 0 | KV cache 0.0% | "
                        "prefix-cache hit rate - | preemptions 0 | spec decode: acceptance 50.0%, 1.50 accepted "
                        "tokens per draft")
    clock.now += 10.0
    sink.record(SchedulerStats(), IterationStats())  # an idle step (nothing running, no tokens): no line
    assert len(lines) == 2
    sink.record(SchedulerStats(num_running_reqs=1), IterationStats(num_generation_tokens=30))
    clock.now += 2.0
    sink.record(SchedulerStats(), IterationStats(num_generation_tokens=10))  # a 2-second burst, then idle
    clock.now += 30.0
    sink.record(SchedulerStats(num_running_reqs=1), IterationStats(num_generation_tokens=1))
    assert lines[2].startswith("Engine: prompt 0.0 tok/s, generation 20.0 tok/s | running 0")
    assert len(lines) == 3


# ----------------------------------------------------------------------------------------------- history
def test_history_points_per_second():
    clock = FakeClock(2000.2)
    history = StatsHistory(window_s=10, rate_window_s=2, latency_window_s=3, clock=clock)
    history.record(SchedulerStats(num_running_reqs=4, kv_cache_usage=0.5, prefix_cache_queries=10,
                                  prefix_cache_hits=5), IterationStats(num_prompt_tokens=10, num_generation_tokens=3))
    clock.now = 2001.5
    history.record(SchedulerStats(num_running_reqs=1, prefix_cache_queries=10), finished_request())
    clock.now = 2003.0
    snap = history.snapshot(5)["series"]
    assert snap["time"] == [1999, 2000, 2001, 2002, 2003]
    assert snap["generation_tokens_per_s"] == [0, 3, 5, 0, 0]
    assert snap["running"] == [0, 4, 1, 1, 1]  # gauges hold their last value
    assert snap["prefix_cache_hit_rate"] == [None, 0.5, 0.25, 0.0, None]
    assert snap["ttft_p50"] == [None, None, 0.6, 0.6, 0.6]
    assert abs(snap["tpot_p95"][2] - 0.35) < 1e-9  # (2.0 - 0.6) / 4
    assert snap["finished"] == [0, 0, 1, 0, 0] and history.total_finished == 1
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 95) == 4.0


# ----------------------------------------------------------------------------------------------- Prometheus
def _samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_prometheus_sink_exact_values():
    sink = PrometheusSink("m", CacheConfig(), max_model_len=512, num_blocks=100)
    spec = SpecDecodingStats(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3,
                             num_accepted_tokens_per_pos=[2, 1, 0])
    sink.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.75, prefix_cache_queries=64,
                               prefix_cache_hits=32, num_preemptions=1, kv_cache_evictions=4,
                               num_scheduled_tokens=40, spec_decoding=spec), finished_request())
    sink.record(None, IterationStats(num_aborted=2))
    s = _samples(sink.render().decode())
    expected = {
        "pagellm:num_requests_running": 3, "pagellm:num_requests_waiting": 2, "pagellm:kv_cache_usage_perc": 0.75,
        "pagellm:prefix_cache_queries_total": 64, "pagellm:prefix_cache_hits_total": 32,
        "pagellm:num_preemptions_total": 1, "pagellm:kv_cache_evictions_total": 4,
        "pagellm:prompt_tokens_total": 12, "pagellm:generation_tokens_total": 5,
        "pagellm:num_aborted_requests_total": 2, "pagellm:spec_decode_num_drafts_total": 2,
        "pagellm:spec_decode_num_draft_tokens_total": 6, "pagellm:spec_decode_num_accepted_tokens_total": 3,
        "pagellm:iteration_tokens_total_sum": 40, "pagellm:inter_token_latency_seconds_count": 4,
        "pagellm:e2e_request_latency_seconds_sum": 2.0, "pagellm:request_prompt_tokens_sum": 12,
        "pagellm:request_generation_tokens_sum": 5,
    }
    for name, value in expected.items():
        assert s[(name, ())] == value, name
    assert s[("pagellm:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("pagellm:request_success_total", (("finished_reason", "stop"),))] == 0
    per_pos = {dict(k[1])["position"]: v for k, v in s.items()
               if k[0] == "pagellm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 2, "1": 1, "2": 0}
    assert abs(s[("pagellm:request_queue_time_seconds_sum", ())] - 0.2) < 1e-9
    assert abs(s[("pagellm:request_prefill_time_seconds_sum", ())] - 0.2) < 1e-9
    assert abs(s[("pagellm:request_decode_time_seconds_sum", ())] - 1.4) < 1e-9
    assert abs(s[("pagellm:request_time_per_output_token_seconds_sum", ())] - 0.35) < 1e-9
    # A second sink in the same process has its own registry: no clash, its own zeros.
    assert _samples(PrometheusSink("m").render().decode())[("pagellm:prompt_tokens_total", ())] == 0
    # Stats off: only the info series.
    off = _samples(PrometheusSink("m", CacheConfig(), engine_series=False).render().decode())
    assert {name for name, _ in off} == {"pagellm:build_info", "pagellm:cache_config_info"}


_WORKER = textwrap.dedent("""
    from pagellm.metrics.prometheus import PrometheusSink
    from pagellm.metrics.stats import IterationStats, SchedulerStats
    sink = PrometheusSink("m")
    sink.record(SchedulerStats(num_running_reqs={running}), IterationStats(num_generation_tokens={tokens}))
""")


def test_prometheus_multiprocess_mode_adds_up_workers(tmp_path: Path, monkeypatch):
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for running, tokens in ((3, 10), (5, 7)):  # two API worker processes
        subprocess.run([sys.executable, "-c", _WORKER.format(running=running, tokens=tokens)], check=True,
                       env={**__import__("os").environ, **env})
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    from prometheus_client import CollectorRegistry

    from pagellm.metrics.prometheus import render
    s = _samples(render(CollectorRegistry()).decode())
    assert s[("pagellm:generation_tokens_total", ())] == 17
    assert s[("pagellm:num_requests_running", ())] == 5  # the most recent worker's value


# ----------------------------------------------------------------------------------------------- tracing
def test_tracing_sink_span_attributes_and_traceparent_parent():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pagellm.metrics import tracing

    seen = []

    async def app(scope, receive, send):
        seen.append(tracing.current_context())

    scope = {"type": "http", "headers": [(b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]}
    asyncio.run(tracing.TraceContextMiddleware(app)(scope, None, None))
    assert tracing.current_context() is None  # reset after the request

    exporter = InMemorySpanExporter()
    sink = tracing.TracingSink("tiny", exporter=exporter)
    it = finished_request()
    it.finished[0].stats.trace_context = seen[0]
    sink.record(None, it)
    sink.force_flush()
    (span,) = exporter.get_finished_spans()
    assert span.name == "llm_request" and span.parent.span_id == 0xb7ad6b7169203331
    assert span.context.trace_id == 0x0af7651916cd43dd8448eb211c80319c
    assert (span.start_time, span.end_time) == (100_000_000_000, 102_000_000_000)
    a = span.attributes
    assert (a["gen_ai.request.id"], a["gen_ai.request.model"], a["gen_ai.request.temperature"]) == ("req-1", "tiny", 0.5)
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (12, 5)
    assert abs(a["gen_ai.latency.time_in_queue"] - 0.2) < 1e-9 and abs(a["gen_ai.latency.time_to_first_token"] - 0.6) < 1e-9
    assert a["gen_ai.latency.e2e"] == 2.0 and tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    sink.shutdown()


def test_otlp_exporter_protocol_follows_the_standard_variable(monkeypatch):
    import pytest
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    from pagellm.metrics.tracing import make_otlp_exporter

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    assert isinstance(make_otlp_exporter("http://127.0.0.1:4317"), Grpc)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert isinstance(make_otlp_exporter("http://127.0.0.1:4318/v1/traces"), Http)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        make_otlp_exporter("http://127.0.0.1:4318")
