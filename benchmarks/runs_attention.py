"""Attention within runs (``attention/runs.py``): the C++ kernel beside SDPA on vision towers' and encoders' shapes.

One run of ``tokens`` patches (a tile, an image) with ``heads`` heads of ``size``, bfloat16 or float32, each token
seeing the whole run: the kernel (its flash tiles where it has them, bfloat16 heads of 64 or 128; its key-by-key
walk elsewhere) and SDPA, alternated in one process, best of ``--repeats``; and which one ``kernel_pays`` picks.

    .venv/bin/python benchmarks/runs_attention.py
    .venv/bin/python benchmarks/runs_attention.py --shape 4096x16x72 --repeats 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pagellm.attention.runs import Runs, kernel_pays  # noqa: E402

# SigLIP-B/16 at 512 (SmolVLM), CLIP-L/14 at 336 (LLaVA), Qwen2-VL's tower at 448, SigLIP-So400m at 384 and 896
# (PaliGemma, Gemma 3), a 256-token BERT-base prompt
SHAPES = ["1024x12x64", "577x16x64", "1024x16x80", "729x16x72", "4096x16x72", "256x12x64"]


def _best(call, repeats: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    cmd = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cmd.add_argument("--shape", nargs="+", default=SHAPES, help="tokens x heads x head size")
    cmd.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    cmd.add_argument("--repeats", type=int, default=3)
    args = cmd.parse_args()
    gen = torch.Generator().manual_seed(0)
    for dtype in (getattr(torch, name) for name in args.dtype):
        for shape in args.shape:
            tokens, heads, size = (int(n) for n in shape.split("x"))
            q, k, v = (torch.randn(tokens, heads, size, generator=gen).to(dtype) for _ in range(3))
            bounds = np.array([0, tokens])
            kernel, sdpa = Runs(bounds, True), Runs(bounds, False)
            kernel.attend(q, k, v), sdpa.attend(q, k, v)  # warm-up
            seconds = [_best(lambda runs=runs: runs.attend(q, k, v), args.repeats) for runs in (kernel, sdpa)]
            pick = "kernel" if kernel_pays(dtype, size) else "SDPA"
            print(f"{str(dtype).removeprefix('torch.'):>8} {shape:>11}: kernel {seconds[0] * 1e3:8.1f} ms, SDPA "
                  f"{seconds[1] * 1e3:7.1f} ms ({seconds[0] / seconds[1]:5.2f}x SDPA's time); runs take the {pick}",
                  flush=True)


if __name__ == "__main__":
    main()
