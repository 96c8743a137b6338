"""Multi-turn sessions against pagellm under several sets of engine flags (and environment variables), alternating
round by round so that every side sees the same spells of the machine: ``--sessions`` sessions at once, each of
``--turns`` turns. A session's first prompt is a document of its own (random token ids); each later prompt is the
previous one, its reply (re-encoded) and a new question, so every prompt begins with the ids of the one before and
a prefix cache that kept them serves them. ``--think-ms`` pauses each session before its later turns (a user
reading and typing), so other sessions' turns arrive in between. Each side gets a fresh ``pagellm serve`` (as
compare.py starts it, on the built-in model in bfloat16), idles ``--settle`` seconds, then runs the sessions with
greedy, EOS-ignored, streamed /v1/completions requests.

Per run: output tok/s over the whole load, TTFT p50 of first turns, TTFT p50/p95 of later turns, and the prefix
cache's hit rate over the load (``pagellm:prefix_cache_hits`` / ``queries`` from ``/metrics``). Then each side's
medians over the rounds and its ratio to the first side.

    .venv/bin/python benchmarks/multi_turn.py --side one= --side dp2="--data-parallel-size 2" \\
        --side dp2-load="--data-parallel-size 2" --env dp2-load=PAGELLM_DP_PREFIX_AFFINITY=0 [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from compare import free_port, stop, wait_ready  # noqa: E402
from flags_ab import alternate, parse_env, parse_sides, print_medians  # noqa: E402
from peers import systems  # noqa: E402

from pagellm.bench import client  # noqa: E402
from pagellm.bench.datasets import FIRST_ORDINARY_ID, BenchRequest  # noqa: E402
from pagellm.bench.metrics import percentile  # noqa: E402
from pagellm.tokenizer import Tokenizer  # noqa: E402


def prefix_counters(base_url: str) -> tuple[float, float]:
    """``(hits, queries)`` of the prefix cache, in tokens, from ``/metrics``."""
    found = {"pagellm:prefix_cache_hits_total": 0.0, "pagellm:prefix_cache_queries_total": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
    return found["pagellm:prefix_cache_hits_total"], found["pagellm:prefix_cache_queries_total"]


async def session(server: client.Server, opts: client.ClientOptions, args: argparse.Namespace, tokenizer: Tokenizer,
                  rng: random.Random) -> list[client.RequestResult]:
    def words(count: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_ID, tokenizer.vocab_size) for _ in range(count)]

    ids, results = words(args.document_len), []
    for turn in range(args.turns):
        if turn and args.think_ms:  # the user reads the reply and types: other sessions' turns come meanwhile
            await asyncio.sleep(rng.expovariate(1000 / args.think_ms))
        ids = ids + words(args.question_len)
        result = await client.send(server, BenchRequest(ids, args.output_len, len(ids)), opts)
        if not result.success:
            raise RuntimeError(f"a request failed: {result.error}")
        results.append(result)
        ids = ids + tokenizer.encode(result.text, add_special_tokens=False)
    return results


async def load(base_url: str, args: argparse.Namespace, tokenizer: Tokenizer) -> tuple[list[list[client.RequestResult]],
                                                                                       float]:
    rngs = [random.Random(1000 + i) for i in range(args.sessions)]  # the same sessions on every side
    async with client.connect(base_url, max_connections=0) as server:
        opts = client.ClientOptions(model=await client.first_model(server), temperature=0.0)
        start = time.perf_counter()
        sessions = await asyncio.gather(*(session(server, opts, args, tokenizer, rng) for rng in rngs))
        return sessions, time.perf_counter() - start


def served(args: argparse.Namespace, ctx: systems.Context, tokenizer: Tokenizer, flags: list[str],
           env: dict[str, str]) -> dict[str, float]:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    system = systems.pagellm(ctx, port)
    system.argv += flags  # stats on: the prefix counters come from /metrics
    proc = subprocess.Popen(system.argv, env={**systems.environment(system), **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, cwd=systems.REPO)
    try:
        ready = wait_ready(base_url, proc, 300)
        time.sleep(args.settle)
        hits0, queries0 = prefix_counters(base_url)
        sessions, wall = asyncio.run(load(base_url, args, tokenizer))
        hits1, queries1 = prefix_counters(base_url)
    finally:
        stop(proc)
    first = [s[0].ttft for s in sessions]
    later = [r.ttft for s in sessions for r in s[1:]]
    return {"ready s": ready, "output tok/s": sum(r.output_len for s in sessions for r in s) / wall,
            "TTFT p50 turn 1 ms": 1000 * statistics.median(first),
            "TTFT p50 later ms": 1000 * percentile(later, 50), "TTFT p95 later ms": 1000 * percentile(later, 95),
            "prefix hit %": 100 * (hits1 - hits0) / max(1.0, queries1 - queries0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", action="append", required=True, metavar="NAME=FLAGS",
                        help="a side: its name and its extra engine flags (repeat; the first is the baseline)")
    parser.add_argument("--env", action="append", default=[], metavar="SIDE=VAR=VALUE",
                        help="an environment variable for one side's server (repeat)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--document-len", type=int, default=384, help="tokens of each session's first prompt")
    parser.add_argument("--question-len", type=int, default=32, help="tokens each turn adds before its reply")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--think-ms", type=float, default=0.0,
                        help="mean pause before each later turn (exponential; 0: the next turn at once)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds each server idles before its load")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sides = parse_sides(args.side)
    envs = parse_env(args.env, sides)

    from pagellm.model.loader import default_model_path, hf_model_dir

    ctx = systems.Context(hf_model_dir(None), default_model_path(), "bfloat16", args.threads, args.sessions)
    tokenizer = Tokenizer.from_dir(ctx.model_dir)
    runs = alternate(list(sides), args.rounds, lambda side: served(args, ctx, tokenizer, sides[side], envs[side]))
    print_medians(runs, f"{args.sessions} sessions x {args.turns} turns, document {args.document_len}, questions "
                  f"{args.question_len}, replies {args.output_len} tokens, think {args.think_ms:g} ms, "
                  f"{args.threads} threads, {args.rounds} rounds")


if __name__ == "__main__":
    main()
