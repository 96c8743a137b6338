"""Traces: ``pagellm serve --otlp-traces-endpoint`` sends one span per request to an in-process OTLP gRPC receiver,
with the ``gen_ai.*`` attributes and the caller's W3C ``traceparent`` as parent (an HTTP header, or the metadata of a
call to the gRPC API)."""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import httpx
import pytest
from metrics_utils import random_prompt
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from server_utils import ServerProcess, _free_port, wait_until

from pagellm.server.grpc import pagellm_pb2 as pb
from pagellm.server.grpc import pagellm_pb2_grpc as pb_grpc

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
GRPC_PARENT_SPAN_ID = "00f067aa0ba902b8"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (the gRPC method name)
        with self._lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    collector = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, port
    server.stop(grace=None)


def _attrs(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        raw = getattr(kv.value, kind)
        out[kv.key] = list(v.string_value for v in raw.values) if kind == "array_value" else raw
    return out


def test_one_span_per_request_with_parent_and_attributes(receiver: tuple[Receiver, int], tiny_llama: Path,
                                                         start_server: Callable[..., ServerProcess],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    collector, port = receiver
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s rather than 5 s
    grpc_port = _free_port()
    server = start_server(tiny_llama, "--served-model-name", "tiny-traced", "--grpc-port", str(grpc_port),
                          "--otlp-traces-endpoint", f"http://127.0.0.1:{port}")
    body = {"model": "tiny-traced", "prompt": random_prompt(10, seed=21), "max_tokens": 3, "ignore_eos": True,
            "temperature": 0.5, "top_p": 0.9, "seed": 7}
    traced = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60,
                        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}).json()
    plain = httpx.post(f"{server.base_url}/v1/completions", json={**body, "max_tokens": 2}, timeout=60).json()
    stub = pb_grpc.EngineStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
    list(stub.Generate(pb.GenerateRequest(text="hi", request_id="over-grpc", sampling=pb.SamplingParams(
        max_tokens=2)), metadata=(("traceparent", f"00-{TRACE_ID}-{GRPC_PARENT_SPAN_ID}-01"),)))
    wait_until(lambda: len(collector.spans) >= 3, 30, "three spans")
    assert server.stop() == 0
    assert len(collector.spans) == 3  # one per request, nothing else
    by_id = {_attrs(s)["gen_ai.request.id"]: s for s in collector.spans}
    over_grpc = by_id["over-grpc"]
    assert over_grpc.trace_id.hex() == TRACE_ID and over_grpc.parent_span_id.hex() == GRPC_PARENT_SPAN_ID
    span, root = by_id[traced["id"]], by_id[plain["id"]]
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    assert root.trace_id.hex() != TRACE_ID and root.parent_span_id == b""
    attrs = _attrs(span)
    assert attrs["gen_ai.request.model"] == "tiny-traced"
    assert attrs["gen_ai.request.temperature"] == 0.5 and attrs["gen_ai.request.top_p"] == 0.9
    assert attrs["gen_ai.request.max_tokens"] == 3 and attrs["gen_ai.request.seed"] == 7
    assert attrs["gen_ai.usage.input_tokens"] == 10 and attrs["gen_ai.usage.output_tokens"] == 3
    assert _attrs(root)["gen_ai.usage.output_tokens"] == 2
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    latency = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
    assert attrs["gen_ai.latency.e2e"] == pytest.approx(latency, abs=1e-6)
    assert 0 <= attrs["gen_ai.latency.time_in_queue"] <= attrs["gen_ai.latency.time_to_first_token"] <= latency
