"""The gRPC API against the HTTP API on one server: the same streamed requests (random token prompts, fixed output
lengths) through ``pagellm.v1.Engine/Generate`` and through ``POST /v1/completions`` with ``stream: true``, rounds
alternated. Prints output tokens/s, mean TTFT and mean inter-token latency of each, and the client process's CPU
seconds per request (what decoding each protocol costs a client).

    .venv/bin/python benchmarks/grpc_vs_http.py [--model PATH] [--num-prompts 64] [--concurrency 16]
        [--input-len 128] [--output-len 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

from pathlib import Path

import aiohttp
import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import free_port, wait_ready  # noqa: E402  (the side-by-side harness's server helpers)

from pagellm.server.grpc import pagellm_pb2 as pb  # noqa: E402
from pagellm.server.grpc import pagellm_pb2_grpc as pb_grpc  # noqa: E402


async def _http(base: str, prompts: list[list[int]], output_len: int, concurrency: int) -> list[tuple[float, list]]:
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def one(prompt: list[int]) -> tuple[float, list]:
            body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0, "stream": True}
            async with gate:
                start, times = time.perf_counter(), []
                async with session.post(f"{base}/v1/completions", json=body) as reply:
                    async for line in reply.content:
                        if line.startswith(b"data: {"):
                            times.append(time.perf_counter())
                            json.loads(line[6:])
                return start, times
        return await asyncio.gather(*(one(p) for p in prompts))


async def _grpc(address: str, prompts: list[list[int]], output_len: int, concurrency: int) -> list[tuple[float, list]]:
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EngineStub(channel)

        async def one(prompt: list[int]) -> tuple[float, list]:
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
                max_tokens=output_len, ignore_eos=True, temperature=0))
            async with gate:
                start, times = time.perf_counter(), []
                async for _ in stub.Generate(request):
                    times.append(time.perf_counter())
                return start, times
        return await asyncio.gather(*(one(p) for p in prompts))


def _report(name: str, results: list[tuple[float, list]], wall: float, cpu: float, output_len: int) -> None:
    ttft = sum(times[0] - start for start, times in results) / len(results)
    gaps = [(times[-1] - times[0]) / (output_len - 1) for _, times in results]
    print(f"{name:5s} {len(results) * output_len / wall:9.1f} out tok/s  TTFT {ttft * 1000:7.1f} ms  "
          f"ITL {sum(gaps) / len(gaps) * 1000:6.2f} ms  client CPU {cpu / len(results) * 1000:6.2f} ms/request")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    http_port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "pagellm.cli", "serve", *([args.model] if args.model else []), "--port",
           str(http_port), "--grpc-port", str(grpc_port), "--disable-log-stats"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_ready(base, server, 300)
        rng = random.Random(0)
        for round_ in range(args.rounds):
            for name in ("http", "grpc"):
                prompts = [[rng.randrange(100, 10_000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
                cpu, start = os.times(), time.perf_counter()
                if name == "http":
                    results = asyncio.run(_http(base, prompts, args.output_len, args.concurrency))
                else:
                    results = asyncio.run(_grpc(f"127.0.0.1:{grpc_port}", prompts, args.output_len, args.concurrency))
                wall, end = time.perf_counter() - start, os.times()
                _report(name, results, wall, (end.user - cpu.user) + (end.system - cpu.system), args.output_len)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
