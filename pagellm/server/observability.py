"""Stats, metrics, traces and the dashboard for ``pagellm serve``: which sinks run and the routes that read them.

Contract:
- ``build_observability(model_name, config, runtime, log_stats, otlp_traces_endpoint)`` decides the engine's stats
  sink: Prometheus series, the periodic log line and the dashboard's history when ``log_stats`` (the default;
  ``--disable-log-stats`` turns all three off, vLLM's meaning), plus one span per request when an OTLP endpoint is
  given. Nothing is fed when everything is off (the null sink).
- ``install(app, obs)`` adds ``GET /metrics`` (Prometheus text; build and cache-config info are always there,
  engine series only while stats are on), the dashboard (``GET /dashboard``, ``/dashboard/data``, vendored static
  files) and, with tracing on, the middleware that reads each request's W3C ``traceparent``. None of these routes
  need the API key (like ``/health``), so scrapers and load balancers need no secret.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from fastapi import FastAPI, Response

from pagellm.config import EngineConfig
from pagellm.metrics import prometheus
from pagellm.metrics.history import StatsHistory
from pagellm.metrics.log import LogStatsSink
from pagellm.metrics.sink import StatsSink, combine


@dataclass
class Observability:
    model_name: str
    sink: StatsSink                  # what the engine feeds
    prometheus: prometheus.PrometheusSink
    history: StatsHistory
    log_stats: bool
    tracing: Any = None              # the TracingSink when traces are exported


def build_observability(model_name: str, config: EngineConfig, runtime: Any, log_stats: bool = True,
                        otlp_traces_endpoint: Optional[str] = None, log_interval_s: float = 5.0,
                        buckets: Optional[dict[str, list[float]]] = None) -> Observability:
    prom = prometheus.PrometheusSink(model_name, config.cache_config, runtime.max_model_len, runtime.num_blocks,
                                     engine_series=log_stats, buckets=buckets)
    history = StatsHistory()
    sinks: list[StatsSink] = [prom, LogStatsSink(log_interval_s), history] if log_stats else []
    tracing = None
    if otlp_traces_endpoint:
        from pagellm.metrics.tracing import TracingSink

        tracing = TracingSink(model_name, otlp_traces_endpoint)
        sinks.append(tracing)
    return Observability(model_name, combine(sinks), prom, history, log_stats, tracing)


def install(app: FastAPI, obs: Observability) -> None:
    from pagellm.server.dashboard import install_dashboard

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(obs.prometheus.render(), media_type=prometheus.CONTENT_TYPE)

    install_dashboard(app, obs)
    if obs.tracing is not None:
        from pagellm.metrics.tracing import TraceContextMiddleware

        app.add_middleware(TraceContextMiddleware)
