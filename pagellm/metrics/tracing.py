"""OpenTelemetry tracing: one span per finished request, exported over OTLP (gRPC or HTTP).

Contract:
- Off by default, and then free: nothing imports OpenTelemetry, no middleware runs, and ``current_context()`` (read
  once per ``generate`` call) returns None.
- On (``pagellm serve --otlp-traces-endpoint URL``): ``TraceContextMiddleware`` reads the W3C ``traceparent`` /
  ``tracestate`` headers of each HTTP request (``GrpcTraceContext``: the metadata of each gRPC call) into a context
  variable, ``AsyncLLM`` stores that parent with each
  request it starts, and ``TracingSink`` turns every request that finished (stop or length) into one SERVER span
  from its arrival to its last token, child of that parent, with ``gen_ai.*`` attributes (request id, model,
  sampling parameters, prompt/completion tokens, queue time, time to first token, end-to-end latency).
- Spans are batched and exported off the engine's thread (``BatchSpanProcessor``). The protocol is
  ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (or ``OTEL_EXPORTER_OTLP_PROTOCOL``): ``grpc`` (default; e.g.
  ``http://collector:4317``) or ``http/protobuf`` (e.g. ``http://collector:4318/v1/traces``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from contextvars import ContextVar
from typing import Any, Awaitable, Callable, Iterator, MutableMapping

from pagellm.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

logger = logging.getLogger(__name__)

_PARENT: ContextVar[Any] = ContextVar("pagellm_trace_parent", default=None)

SPAN_NAME = "llm_request"


def current_context() -> Any:
    """The OpenTelemetry parent context of the HTTP request being handled (None when tracing is off)."""
    return _PARENT.get()


class GrpcTraceContext:
    """The same for gRPC calls: ``with context.parent(metadata):`` puts a call's ``traceparent`` / ``tracestate``
    metadata in the context variable while its handler runs."""

    def __init__(self) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._propagator = TraceContextTextMapPropagator()

    @contextlib.contextmanager
    def parent(self, metadata: Any) -> Iterator[None]:
        carrier = {key: value for key, value in (metadata or ()) if key in ("traceparent", "tracestate")}
        token = _PARENT.set(self._propagator.extract(carrier))
        try:
            yield
        finally:
            _PARENT.reset(token)


class TraceContextMiddleware:
    """ASGI middleware: puts each HTTP request's W3C trace context (``traceparent``) in the context variable.

    Pure ASGI (no BaseHTTPMiddleware task hop), so the value is visible to the route and to the streaming body,
    which run in tasks that copy this context.
    """

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.app = app
        self._propagator = TraceContextTextMapPropagator()

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"traceparent", b"tracestate")}
        token = _PARENT.set(self._propagator.extract(carrier))
        try:
            await self.app(scope, receive, send)
        finally:
            _PARENT.reset(token)


def make_otlp_exporter(endpoint: str) -> Any:
    """An OTLP span exporter for ``endpoint`` in the protocol the standard OTEL_* variables ask for."""
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"OTLP protocol {protocol!r} is not supported; set OTEL_EXPORTER_OTLP_TRACES_PROTOCOL to "
                     "grpc or http/protobuf")


class TracingSink:
    """Stats sink that exports one span per finished request (see the module docstring)."""

    def __init__(self, model_name: str, endpoint: str | None = None, exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind

        import pagellm

        if exporter is None:
            if not endpoint:
                raise ValueError("tracing needs an OTLP endpoint (--otlp-traces-endpoint) or an exporter")
            exporter = make_otlp_exporter(endpoint)
        self.model_name = model_name
        self._kind = SpanKind.SERVER
        self.provider = TracerProvider(resource=Resource.create({"service.name": "pagellm",
                                                                 "service.version": pagellm.__version__}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("pagellm", pagellm.__version__)

    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats | None) -> None:
        if iteration is not None:
            for finished in iteration.finished:
                self._export(finished)

    def _export(self, done: FinishedRequestStats) -> None:
        stats = done.stats
        span = self.tracer.start_span(SPAN_NAME, context=stats.trace_context, kind=self._kind,
                                      start_time=_ns(stats.arrival_time), attributes=self._attributes(done))
        span.end(end_time=_ns(done.finished_time))

    def _attributes(self, done: FinishedRequestStats) -> dict[str, Any]:
        stats, params = done.stats, done.stats.params
        attrs: dict[str, Any] = {
            "gen_ai.system": "pagellm",
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.id": stats.caller_id or done.request_id,
            "gen_ai.request.model": self.model_name,
            "gen_ai.response.model": self.model_name,
            "gen_ai.response.finish_reasons": [done.finish_reason],
            "gen_ai.usage.input_tokens": stats.num_prompt_tokens,
            "gen_ai.usage.output_tokens": stats.num_generation_tokens,
            "gen_ai.latency.time_in_queue": done.queue_time,
            "gen_ai.latency.time_to_first_token": done.time_to_first_token,
            "gen_ai.latency.e2e": done.e2e_latency,
            "gen_ai.latency.time_in_model_prefill": done.prefill_time,
            "gen_ai.latency.time_in_model_decode": done.decode_time,
        }
        if params is not None:
            attrs.update({"gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                          "gen_ai.request.top_k": params.top_k, "gen_ai.request.n": params.n})
            if params.max_tokens is not None:
                attrs["gen_ai.request.max_tokens"] = params.max_tokens
            if params.seed is not None:
                attrs["gen_ai.request.seed"] = params.seed
        return attrs

    def force_flush(self, timeout_ms: int = 10_000) -> bool:
        return self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        self.provider.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
