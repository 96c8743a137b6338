"""Offline throughput: pagellm vs transformers ``generate()`` on the same model, prompts and machine, one run
(``make bench``). A thin wrapper over ``pagellm bench throughput`` (pagellm/bench/throughput.py) that loops over
dtypes and prints the ratio.

Workload (as vLLM's throughput benchmark): N prompts of random token ids, fixed input and output lengths, EOS
ignored, temperature 1.0. transformers runs static batches (default 32). Usage:

    .venv/bin/python benchmarks/throughput.py [--dtypes bfloat16 float32] [--num-prompts 256] [--hf-num-prompts 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagellm

from pagellm.bench import datasets  # noqa: E402
from pagellm.bench.throughput import run_pagellm, run_transformers  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--hf-num-prompts", type=int, default=64, help="transformers is slow: a subset of whole "
                        "static batches measures its steady rate (0 skips it)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=4 << 30,
                        help="bytes; 4 GiB holds the whole float32 workload without preemption")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    requests = datasets.random_requests(datasets.DatasetOptions(args.num_prompts, args.input_len, args.output_len))
    engine_args = {"max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory}
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    results = []
    for dtype in args.dtypes:
        ours = run_pagellm(None, requests, 1.0, {**engine_args, "dtype": dtype})
        results.append({**ours, "dtype": dtype})
        print(json.dumps(results[-1]), flush=True)
        if args.hf_num_prompts:
            ref = run_transformers(None, requests[:args.hf_num_prompts], 1.0, dtype, args.hf_batch_size)
            results.append(ref)
            print(json.dumps(ref), flush=True)
            print(f"{dtype}: pagellm {ours['output_throughput']:.1f} out tok/s, transformers "
                  f"{ref['output_throughput']:.1f} out tok/s, ratio "
                  f"{ours['output_throughput'] / ref['output_throughput']:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
