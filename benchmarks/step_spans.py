"""Where a real engine step's time goes, part by part, without the profiler's own cost.

The engine marks each step's parts with ``metrics/profiler.span`` (schedule, prepare_inputs, forward,
compute_logits, sample, propose, update_from_output). This script swaps those spans for wall-clock timers and
runs an in-process ``LLM`` on ``--batch`` random prompts of ``--prompt-len`` tokens, ``--output-len`` tokens each
(temperature 1.0, EOS ignored), ``--rounds`` times after one warm-up, and prints each part's p50 and mean per step
and its share of the step. Unlike a loop that calls one part again and again (caches warm), every part runs where
the engine runs it: right after the forward pass has streamed the weights through the caches, which is what the
host-side parts (scheduling, input building, sampling set-up) pay for here.

    PAGELLM_NUM_THREADS=2 .venv/bin/python benchmarks/step_spans.py [--batch 1] [--prompt-len 128]
        [--output-len 128] [--rounds 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time
from typing import Iterator

import pagellm.engine.core as engine_core
import pagellm.worker.model_runner as model_runner
from pagellm import LLM, SamplingParams

_times: dict[str, list[float]] = collections.defaultdict(list)


@contextlib.contextmanager
def _timed(name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        _times[name].append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    engine_core.span = model_runner.span = _timed  # type: ignore[assignment]  # the modules' own names for it
    llm = LLM(None, dtype=args.dtype, kv_cache_memory=1 << 30)
    params = SamplingParams(max_tokens=args.output_len, temperature=1.0, ignore_eos=True)
    prompts = [[100 + (7 * i + j) % 40000 for j in range(args.prompt_len)] for i in range(args.batch)]
    llm.generate(prompts, params, use_tqdm=False)
    _times.clear()
    start = time.perf_counter()
    for _ in range(args.rounds):
        llm.reset_prefix_cache()
        llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = len(_times["forward"])
    print(f"batch {args.batch}: {steps} steps, {wall / steps * 1e6:.0f} µs per step (wall, whole generate)")
    print(f"{'part':>20} {'p50 µs':>9} {'mean µs':>9} {'share':>7}")
    for name, values in _times.items():
        mean = sum(values) / steps
        print(f"{name:>20} {statistics.median(values) * 1e6:>9.0f} {mean * 1e6:>9.0f} {mean / (wall / steps):>7.1%}")


if __name__ == "__main__":
    main()
