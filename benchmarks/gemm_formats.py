"""One linear layer's time in each weight format, shape by shape, in one run: the packed bfloat16 GEMM (the baseline
of every ratio), int8 (``w8a8_int8``), 4-bit with int8 activations (``w4a8_int4``) and 4-bit with bfloat16 ones
(``w4a16_int4``), each over the same random weight. Each weight is repeated, so it stays in the caches once the
first call brought it: this measures the kernels, not DRAM (a decoding step over a model larger than the caches reads
its weights from memory, where 4 bits read 5/16 of bfloat16's bytes).

    PAGELLM_NUM_THREADS=2 .venv/bin/python benchmarks/gemm_formats.py [--m 1 8 32] [--reps 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm.ops import gemm  # noqa: E402

SHAPES = [(16384, 2048), (2048, 8192), (1536, 576), (576, 1536)]  # a 1B Llama's gate/up and down, SmolLM2's


def _time(fn, reps: int) -> float:  # noqa: ANN001
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 32], help="rows of x")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    formats = ["bf16"] + [f for f in gemm.QUANTIZED if gemm.QUANTIZED[f].available()]
    print(f"{'N x K':>12} {'M':>4} " + " ".join(f"{f:>20}" for f in formats))
    for n, k in SHAPES:
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        params = {}
        for fmt in formats:
            params[fmt] = torch.nn.Parameter(w.clone(), requires_grad=False)
            gemm.pack_parameter(params[fmt]) if fmt == "bf16" else gemm.QUANTIZED[fmt].quantize_parameter(params[fmt])
        for m in args.m:
            x = torch.randn(m, k).to(torch.bfloat16)
            times = {fmt: _time(lambda p=p: gemm.linear(x, p), args.reps) for fmt, p in params.items()}
            cells = " ".join(f"{times[f]:>9.3f} ms ({times[f] / times['bf16']:.2f}×)" for f in formats)
            print(f"{n:>6}x{k:<5} {m:>4} {cells}", flush=True)


if __name__ == "__main__":
    main()
