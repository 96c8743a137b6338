"""What stats cost: serving throughput with stats and tracing off vs on, measured in the same run, plus the
per-step cost of the stats sinks alone.

Two ``pagellm serve`` processes on the same model (one ``--disable-log-stats``, one with Prometheus, the log line,
the dashboard history and OTLP tracing to a local discarding receiver) take turns under the serving benchmark's
workload (random prompts as in ``benchmarks/serving.py``, non-streamed completions, EOS ignored), alternating off/on for
``--rounds`` rounds so machine noise hits both alike; the median of each is compared. Then the sinks are timed in
process on a synthetic step of ``--concurrency`` requests. Usage:

    .venv/bin/python benchmarks/metrics_overhead.py [--model DIR] [--rounds 3] [--concurrency 32] [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serving import make_prompts  # noqa: E402


async def run_level(base_url: str, model: str, prompts: list[list[int]], output_len: int,
                    concurrency: int) -> dict:
    """``concurrency`` requests in flight until all ``prompts`` are done (non-streamed: a random model's text may
    hold characters that split SSE lines); output tokens/s from the responses' usage."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    tokens = 0

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            body = {"model": model, "prompt": queue.get_nowait(), "max_tokens": output_len, "temperature": 1.0,
                    "ignore_eos": True}
            response = await http.post("/v1/completions", json=body)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"concurrency": concurrency, "requests": len(prompts), "seconds": round(elapsed, 3),
            "output_tok_s": round(tokens / elapsed, 1)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_discarding_receiver() -> tuple[object, int]:
    """An OTLP/gRPC trace receiver that accepts and drops spans (tracing on, no real collector)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Drop(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Drop(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def start_server(model: str | None, extra: list[str], args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagellm.cli", "serve", *([model] if model else []), "--port", str(port),
           "--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server {' '.join(extra)} did not start")


def serving_comparison(args: argparse.Namespace) -> dict:
    receiver, port = start_discarding_receiver()
    off, off_url = start_server(args.model, ["--disable-log-stats"], args)
    on, on_url = start_server(args.model, ["--otlp-traces-endpoint", f"http://127.0.0.1:{port}"], args)
    try:
        model = httpx.get(f"{off_url}/v1/models").json()["data"][0]["id"]
        results: dict[str, list[float]] = {"off": [], "on": []}
        for round_ in range(args.rounds):
            for name, url in (("off", off_url), ("on", on_url)):
                # Fresh random prompts per run: neither server gets prefix-cache hits from an earlier round.
                prompts = make_prompts(args.num_prompts, args.input_len, args.vocab_size, seed=1000 * round_ +
                                       (name == "on"))
                level = asyncio.run(run_level(url, model, prompts, args.output_len, args.concurrency))
                results[name].append(level["output_tok_s"])
                print(json.dumps({"round": round_, "stats": name, **level}), flush=True)
        metrics_text = httpx.get(f"{on_url}/metrics").text
        assert "pagellm:request_success_total" in metrics_text
    finally:
        for proc in (off, on):
            proc.terminate()
            proc.wait(60)
        receiver.stop(grace=None)
    off_med, on_med = statistics.median(results["off"]), statistics.median(results["on"])
    return {"off_tok_s": results["off"], "on_tok_s": results["on"], "off_median": off_med, "on_median": on_med,
            "on_vs_off": on_med / off_med}


def sink_cost(concurrency: int, steps: int = 5000) -> dict:
    """Microseconds per engine step spent in the sinks, on a synthetic step of ``concurrency`` decoding requests
    (one of them finishing each step)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pagellm.config import CacheConfig
    from pagellm.metrics.history import StatsHistory
    from pagellm.metrics.log import LogStatsSink
    from pagellm.metrics.prometheus import PrometheusSink
    from pagellm.metrics.sink import FanoutSink, NullStatsSink
    from pagellm.metrics.stats import IterationStats, RequestStats, RequestTimes, SchedulerStats
    from pagellm.metrics.tracing import TracingSink
    from pagellm.sampling_params import SamplingParams

    def one_step(now: float) -> tuple[SchedulerStats, IterationStats]:
        it = IterationStats(now, num_generation_tokens=concurrency)
        it.inter_token_latencies.extend([0.03] * concurrency)
        stats = RequestStats(now - 5, 128, SamplingParams(max_tokens=128), "cmpl-x")
        stats.core_times = RequestTimes(now - 5, now - 4.9, now - 4.5)
        stats.first_token_time, stats.last_token_time, stats.num_generation_tokens = now - 4.4, now, 128
        it.observe_finished("cmpl-x-0", "length", stats, now)
        return SchedulerStats(concurrency, 0, 0.4, num_scheduled_tokens=concurrency), it

    tracing = TracingSink("bench", exporter=InMemorySpanExporter())
    sinks = {"null": NullStatsSink(),
             "all": FanoutSink([PrometheusSink("bench", CacheConfig(), 2048, 1000), LogStatsSink(),
                                StatsHistory(), tracing])}
    out = {}
    for name, sink in sinks.items():
        work = [one_step(time.time()) for _ in range(steps)]
        start = time.perf_counter()
        for sched, it in work:
            sink.record(sched, it)
        out[f"{name}_us_per_step"] = (time.perf_counter() - start) / steps * 1e6
    tracing.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the built-in SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--skip-serving", action="store_true", help="only time the sinks")
    args = parser.parse_args()
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "1000")
    cost = sink_cost(args.concurrency)
    print(json.dumps(cost), flush=True)
    if not args.skip_serving:
        result = serving_comparison(args)
        print(json.dumps(result), flush=True)
        print(f"stats+tracing on vs off: {result['on_median']:.1f} vs {result['off_median']:.1f} out tok/s "
              f"(median of {args.rounds}) = {100 * (result['on_vs_off'] - 1):+.1f}%; sinks cost "
              f"{cost['all_us_per_step']:.0f} us per step of {args.concurrency} requests", flush=True)


if __name__ == "__main__":
    main()
