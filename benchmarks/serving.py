"""Online serving vs offline: output tok/s, TTFT and TPOT (p50/p95) of a live ``pagellm serve`` at several
concurrencies (``pagellm bench serve``, pagellm/bench/serve.py), and with ``--offline`` the ratio to
``LLM.generate`` on the same workload with the same number of requests in flight, one run.

Workload: random token-id prompts (default 128 in, 128 out), EOS ignored, temperature 1.0, streamed
``/v1/completions``. Usage (start the server first, e.g. ``make serve``):

    .venv/bin/python benchmarks/serving.py --base-url http://127.0.0.1:8000 [--concurrency 1 32] [--offline]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagellm

from pagellm.bench import datasets, serve  # noqa: E402
from pagellm.bench.throughput import run_pagellm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[8, 64],
                        help="requests per concurrency level (one value for all, or one per level)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--offline", action="store_true",
                        help="also run LLM.generate on the largest level's workload (stop the server's load first)")
    parser.add_argument("--offline-model", default=None, help="model for --offline (default: the built-in one)")
    parser.add_argument("--dtype", default="auto", help="dtype for --offline (match the server's)")
    parser.add_argument("--kv-cache-memory", type=int, default=2 << 30, help="bytes, for --offline")
    parser.add_argument("--seed", type=int, default=None, help="prompt seed (default: random, so a rerun against "
                        "the same server misses its prefix cache)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "little")
    counts = args.num_prompts if len(args.num_prompts) == len(args.concurrency) else \
        [args.num_prompts[0]] * len(args.concurrency)
    results = []
    for concurrency, count in zip(args.concurrency, counts):
        bench_parser = argparse.ArgumentParser()
        serve.add_cli_args(bench_parser)
        run = serve.run(bench_parser.parse_args(
            ["--base-url", args.base_url, "--max-concurrency", str(concurrency), "--num-prompts", str(count),
             "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed",
             str(seed + concurrency), "--no-progress"]))["runs"][0]
        m = run["metrics"]
        results.append({"concurrency": concurrency, "requests": m["completed"], "failed": m["failed"],
                        "output_tok_s": round(m["output_throughput"], 1),
                        "ttft_ms_p50": round(m["median_ttft_ms"], 1), "ttft_ms_p95": round(m["p95_ttft_ms"], 1),
                        "tpot_ms_p50": round(m["median_tpot_ms"], 1), "tpot_ms_p95": round(m["p95_tpot_ms"], 1)})
        print(json.dumps(results[-1]), flush=True)
    if args.offline:
        best = max(results, key=lambda r: r["output_tok_s"])
        requests = datasets.random_requests(datasets.DatasetOptions(max(counts), args.input_len, args.output_len,
                                                                    seed=seed + 1))
        offline = run_pagellm(args.offline_model, requests, 1.0, {"dtype": args.dtype, "max_num_seqs":
                              best["concurrency"], "kv_cache_memory": args.kv_cache_memory})
        results.append(offline)
        print(json.dumps(offline), flush=True)
        print(f"server at concurrency {best['concurrency']}: {best['output_tok_s']} out tok/s = "
              f"{best['output_tok_s'] / offline['output_throughput']:.2f}x LLM.generate with the same "
              f"{best['concurrency']} in flight ({offline['output_throughput']:.1f} out tok/s)", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
