"""Online serving: output tok/s, TTFT and TPOT (p50/p95) of a live ``pagellm serve`` at several concurrencies,
and the ratio to offline ``LLM.generate`` on the same workload, one run.

Workload (as vLLM's serving benchmark with random data): prompts of random token ids (default 128 in, 128 out),
EOS ignored, temperature 1.0, streamed ``/v1/completions`` with usage. Each concurrency level keeps that many
requests in flight until ``--num-prompts`` have finished. TTFT = time to the first text chunk; TPOT = (latency -
TTFT) / (output tokens - 1). Usage (start the server first, e.g. ``make serve``):

    .venv/bin/python benchmarks/serving.py --base-url http://127.0.0.1:8000 [--concurrency 1 32] [--offline]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass

import httpx


@dataclass
class Sample:
    ttft: float
    latency: float
    output_tokens: int

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / max(self.output_tokens - 1, 1)


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    # Skip the first ids (special tokens in most vocabularies) so prompts are ordinary text tokens.
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 1.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - start
    return Sample(ttft if ttft is not None else latency, latency, tokens)


async def run_level(base_url: str, model: str, prompts: list[list[int]], output_len: int,
                    concurrency: int) -> dict:
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    samples: list[Sample] = []

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            samples.append(await one_request(http, model, queue.get_nowait(), output_len))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        await one_request(http, model, prompts[0][:8], 4)  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    generated = sum(s.output_tokens for s in samples)
    return {"concurrency": concurrency, "requests": len(samples), "seconds": round(elapsed, 3),
            "output_tok_s": round(generated / elapsed, 1),
            **_percentiles("ttft_ms", [s.ttft * 1e3 for s in samples]),
            **_percentiles("tpot_ms", [s.tpot * 1e3 for s in samples])}


def _percentiles(name: str, values: list[float]) -> dict:
    if len(values) < 2:
        return {f"{name}_p50": round(values[0], 1) if values else None, f"{name}_p95": None}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {f"{name}_p50": round(statistics.median(values), 1), f"{name}_p95": round(cuts[94], 1)}


def run_offline(model: str | None, dtype: str, prompts: list[list[int]], output_len: int,
                kv_cache_memory: int, in_flight: int) -> dict:
    """``LLM.generate`` on the same prompts with at most ``in_flight`` requests running (the server's level)."""
    from pagellm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=in_flight)
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"system": "LLM.generate", "requests": len(prompts), "max_num_seqs": in_flight,
            "seconds": round(elapsed, 3),
            "output_tok_s": round(generated / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[8, 64],
                        help="requests per concurrency level (one value for all, or one per level)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=49152, help="prompt ids are drawn from [100, this)")
    parser.add_argument("--offline", action="store_true",
                        help="also run LLM.generate on the largest level's prompts (stop the server's load first)")
    parser.add_argument("--offline-model", default=None, help="model for --offline (default: the built-in one)")
    parser.add_argument("--dtype", default="auto", help="dtype for --offline (match the server's)")
    parser.add_argument("--kv-cache-memory", type=int, default=2 << 30, help="bytes, for --offline")
    parser.add_argument("--seed", type=int, default=None,
                        help="prompt seed (default: random, so a rerun against the same server misses its prefix "
                             "cache)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    counts = args.num_prompts if len(args.num_prompts) == len(args.concurrency) else \
        [args.num_prompts[0]] * len(args.concurrency)
    model = args.model or httpx.get(f"{args.base_url}/v1/models").json()["data"][0]["id"]
    results = []
    for concurrency, count in zip(args.concurrency, counts):
        prompts = make_prompts(count, args.input_len, args.vocab_size, seed=seed + concurrency)
        result = asyncio.run(run_level(args.base_url, model, prompts, args.output_len, concurrency))
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.offline:
        # The largest level's prompts: the server has them cached by now, a fresh LLM does not (fair: no hits).
        prompts = make_prompts(max(counts), args.input_len, args.vocab_size, seed=seed + max(args.concurrency))
        best = max(results, key=lambda r: r["output_tok_s"])
        offline = run_offline(args.offline_model, args.dtype, prompts, args.output_len, args.kv_cache_memory,
                              best["concurrency"])
        results.append(offline)
        print(json.dumps(offline), flush=True)
        print(f"server at concurrency {best['concurrency']}: {best['output_tok_s']} out tok/s = "
              f"{best['output_tok_s'] / offline['output_tok_s']:.2f}x LLM.generate with the same "
              f"{best['concurrency']} in flight ({offline['output_tok_s']} out tok/s)", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
