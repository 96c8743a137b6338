"""The packed GEMM as of two git revisions, shape by shape, each built the same way and called the same way.

``small_gemm.py --packed-rev`` sets a revision's kernel beside this tree's, but the two are called differently (a
bare ctypes call against ``gemm.packed_linear``'s Python), which at a few rows biases the comparison by 5-20 %
even between identical sources. Here both sides are built from git by ``small_gemm.packed_at`` and called alike,
repetitions alternate which side goes first, and every output pair is checked bit for bit before timing. Each shape
is one matrix with random weights (hot in the caches after the first call): this measures the kernel, not DRAM.

    .venv/bin/python benchmarks/gemm_ab.py --a 038dfe9 --b HEAD [--m 1 4 32 256 2048] [--reps 21]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from small_gemm import SHAPES, packed_at  # noqa: E402  (benchmarks/)

from pagellm.ops import gemm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="git revision of side a")
    parser.add_argument("--b", default="HEAD", help="git revision of side b (default HEAD)")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 32, 256, 2048])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    args = parser.parse_args()
    if not gemm.available():
        sys.exit("the packed GEMM does not run on this CPU")
    sides = {args.a: packed_at(args.a), args.b: packed_at(args.b)}
    layers, head, _ = SHAPES[args.shapes]
    shapes = [*layers, *([head] if head else [])]
    torch.manual_seed(0)
    print(f"packed GEMM ({gemm.path()}), {torch.get_num_threads()} threads; GFLOP/s, medians of {args.reps}; "
          f"'b/a' > 1: {args.b} is faster")
    for m in args.m:
        for k, n in shapes:
            rates = compare(sides, m, k, n, args.reps)
            a, b = (rates[name] for name in sides)
            print(f"M {m:5d}  {k:5d} -> {n:5d}:  {args.a} {a:7.0f}  {args.b} {b:7.0f}  b/a {b / a:5.2f}")


def compare(sides: dict, m: int, k: int, n: int, reps: int) -> dict[str, float]:
    """GFLOP/s of each side on one (m, k) x (k, n) product, after checking that both give the same bits."""
    weight = (torch.randn(n, k) * 0.05).bfloat16()
    x = torch.randn(m, k).bfloat16()
    packed = gemm.pack(weight)
    outputs = [fn(x, packed, n) for fn in sides.values()]
    if not torch.equal(outputs[0], outputs[1]):
        sys.exit(f"the two revisions give different outputs at M={m}, {k} -> {n}")
    times: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides.items())
    for rep in range(reps):
        for name, fn in order if rep % 2 else order[::-1]:
            start = time.perf_counter()
            fn(x, packed, n)
            times[name].append(time.perf_counter() - start)
    return {name: 2 * m * n * k / statistics.median(t) / 1e9 for name, t in times.items()}


if __name__ == "__main__":
    main()
