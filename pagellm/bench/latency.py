"""``pagellm bench latency``: in-process latency of one batch (batch 1 and small batches), per token.

For each batch size, ``--num-iters`` batches of fresh random prompts (so no prefix-cache hits) run to exactly
``--output-len`` tokens (EOS ignored), after ``--num-warmup`` unmeasured ones. The same is timed with one output
token to isolate the prefill. Reports end-to-end latency (mean, p50, p95, p99), prefill latency and the decode
time per output token: (mean latency − mean prefill latency) / (output len − 1). ``--profile`` (with
``--profiler-dir``) runs one more batch per batch size, after the timed ones, inside a torch profile.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagellm.bench import datasets
from pagellm.bench.metrics import summarize


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pagellm.engine_args import add_engine_args

    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: built-in SmolLM2)")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-warmup", "--num-iters-warmup", dest="num_warmup", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="random token ids are drawn below this (default: the model's vocabulary)")
    parser.add_argument("--dataset-seed", type=int, default=0, help="prompt seed")
    parser.add_argument("--result-json", "--output-json", dest="result_json", default=None,
                        help="write the result here")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed batches, profile one more per batch size (needs --profiler-dir)")
    add_engine_args(parser)


def _time_batches(llm: Any, batch_size: int, max_tokens: int, iters: int, args: argparse.Namespace,
                  seed: int) -> list[float]:
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    times = []
    for i in range(iters):
        opts = datasets.DatasetOptions(num_prompts=batch_size, input_len=args.input_len, output_len=max_tokens,
                                       vocab_size=args.vocab_size or datasets.model_vocab_size(args.model),
                                       seed=seed + i)
        prompts = [r.prompt for r in datasets.random_requests(opts)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return times


def measure(llm: Any, batch_size: int, args: argparse.Namespace) -> dict[str, Any]:
    if args.output_len < 2:
        raise ValueError("--output-len must be at least 2 to separate decode from prefill")
    base = args.dataset_seed + 100_003 * batch_size
    _time_batches(llm, batch_size, args.output_len, args.num_warmup, args, base)
    full = _time_batches(llm, batch_size, args.output_len, args.num_iters, args, base + 1000)
    prefill = _time_batches(llm, batch_size, 1, args.num_iters, args, base + 2000)
    mean_full, mean_prefill = sum(full) / len(full), sum(prefill) / len(prefill)
    per_token = (mean_full - mean_prefill) / (args.output_len - 1)
    result = {"batch_size": batch_size, "input_len": args.input_len, "output_len": args.output_len,
              **summarize("latency", full), **summarize("prefill", prefill),
              "decode_ms_per_token": per_token * 1e3,
              "output_throughput": batch_size * args.output_len / mean_full}
    if args.profile:
        with llm.profile() as files:
            _time_batches(llm, batch_size, args.output_len, 1, args, base + 3000)
        result["profile_files"] = files
    return result


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pagellm import LLM
    from pagellm.engine_args import engine_kwargs

    if args.num_iters < 1:
        raise ValueError("--num-iters must be at least 1")
    if args.profile and not args.profiler_dir:
        raise ValueError("--profile needs --profiler-dir DIR: where the traces go")
    llm = LLM(args.model, **engine_kwargs(args))
    return [measure(llm, batch_size, args) for batch_size in args.batch_size]


def main(args: argparse.Namespace) -> int:
    results = run(args)
    print(f"{'batch':>5} {'latency mean':>12} {'p50':>8} {'p99':>8} {'prefill':>8} {'ms/token':>9} {'out tok/s':>9}")
    for r in results:
        print(f"{r['batch_size']:>5} {r['mean_latency_ms']:>12.1f} {r['median_latency_ms']:>8.1f} "
              f"{r['p99_latency_ms']:>8.1f} {r['mean_prefill_ms']:>8.1f} {r['decode_ms_per_token']:>9.2f} "
              f"{r['output_throughput']:>9.1f}")
        for path in r.get("profile_files", []):
            print(f"      wrote {path}")
    if args.result_json:
        with open(args.result_json, "w") as fh:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "bench_main"}, "results": results},
                      fh, indent=1)
    return 0
