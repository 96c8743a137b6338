"""Decoding at long contexts with and without a sliding window, on the same weights in the same run: the built-in
model (or ``--model``) as a Mistral-style config with ``sliding_window`` set, against the same config with none.

For each context length, ``--batch`` prompts of that many random tokens are computed once (``max_tokens=1``, which
leaves their blocks in the prefix cache); the timed pass then asks the same prompts for ``--output-len`` tokens, so
decoding starts at once (every prompt block hits) and TPOT is decoding alone: (finished - first token) / (n - 1) per
request, the median printed. Also printed: the most KV blocks the timed pass held at once (the windowed side gives
back the blocks behind its window as requests move on), and the ratios. Sides alternate round by round.

    PAGELLM_NUM_THREADS=2 .venv/bin/python benchmarks/sliding_window.py [--window 1024] [--context 2048 8000]
        [--batch 1 4] [--output-len 64] [--rounds 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from pagellm import LLM, SamplingParams
from pagellm.model.loader import resolve_model_dir


def _variant(model_dir: Path, out: Path, window: int | None) -> Path:
    """``model_dir``'s files linked into ``out``, its config as Mistral's with ``sliding_window`` = ``window``."""
    out.mkdir()
    for item in model_dir.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def _measure(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """Median decoding TPOT (ms) of ``prompts`` whose blocks are cached already, and the most blocks held."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tpots = [(o.metrics.finished_time - o.metrics.first_token_time) / (output_len - 1) * 1e3 for o in outputs]
    pool = llm.engine.core.scheduler.kv.pool
    peak = round(max(s.kv_cache_usage for s in llm.last_stats) * pool.num_blocks)
    return statistics.median(tpots), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Llama-family directory or GGUF (default: the built-in)")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--context", type=int, nargs="+", default=[2048, 8000])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", default="3GiB")
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model)
    rng = np.random.default_rng(0)
    results: dict[tuple[str, int, int], list[tuple[float, int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"full": _variant(model_dir, Path(tmp) / "full", None),
                 f"window {args.window}": _variant(model_dir, Path(tmp) / "window", args.window)}
        for round_ in range(args.rounds):
            for side, path in sides.items():
                llm = LLM(str(path), dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                          max_model_len=max(args.context) + args.output_len)
                for context in args.context:
                    for batch in args.batch:
                        prompts = rng.integers(0, 1000, (batch, context)).tolist()
                        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # into the cache
                        tpot, peak = _measure(llm, prompts, args.output_len)
                        results.setdefault((side, context, batch), []).append((tpot, peak))
                        print(f"round {round_ + 1} {side:>12} context {context:>6} batch {batch:>3}: "
                              f"TPOT {tpot:7.2f} ms, peak {peak:>5} blocks", flush=True)
                del llm
    print(f"\n| context | batch | TPOT full (ms) | TPOT window {args.window} (ms) | ratio | peak blocks full | "
          "peak blocks window |\n|---:|---:|---:|---:|---:|---:|---:|")
    full_side, window_side = list(sides)
    for context in args.context:
        for batch in args.batch:
            full = results[(full_side, context, batch)]
            window = results[(window_side, context, batch)]
            t_full = statistics.median(t for t, _ in full)
            t_window = statistics.median(t for t, _ in window)
            print(f"| {context} | {batch} | {t_full:.2f} | {t_window:.2f} | {t_window / t_full:.2f}x | "
                  f"{max(p for _, p in full)} | {max(p for _, p in window)} |")


if __name__ == "__main__":
    main()
