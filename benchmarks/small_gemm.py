"""Small-M bfloat16 GEMM: the native kernel (``pagellm/ops/gemm.py``) against ``F.linear`` on SmolLM2-135M's
shapes, one run, interleaved repetitions, medians.

For each batch size M it streams the linear layers of 30 decoder layers (q/k/v 576→960, o 576→576, gate/up
576→3072, down 1536→576: distinct matrices, so weights come from DRAM as in a real step) and the LM head
(576→49,152), and prints milliseconds, effective weight bandwidth and the speed-up. ``SMALL_M`` in
``pagellm/ops/gemm.py`` is the largest M where the kernel wins.

    .venv/bin/python benchmarks/small_gemm.py [--m 1 2 4 8 16 32] [--reps 9] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagellm.ops import gemm

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not gemm.available():
        raise SystemExit("the small-M GEMM kernel is not available here (needs AVX-512 BF16 and a C++ compiler)")
    layers = [[torch.randn(n, k).to(torch.bfloat16) for k, n in SHAPES] for _ in range(args.layers)]
    lm_head = torch.randn(49152, 576).to(torch.bfloat16)
    layer_bytes = sum(w.numel() * 2 for w in layers[0]) * args.layers
    print(f"{'M':>3} | {'layers F.linear':>16} {'kernel':>16} {'×':>5} | {'LM head F.linear':>16} {'kernel':>9} {'×':>5}")
    for m in args.m:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k, _ in SHAPES}
        times: dict[str, list[float]] = {"torch": [], "kernel": [], "lm_torch": [], "lm_kernel": []}
        for _ in range(args.reps):
            for name, fn in (("torch", F.linear), ("kernel", gemm.small_m_linear)):
                start = time.perf_counter()
                for layer in layers:
                    for w in layer:
                        fn(xs[w.shape[1]], w)
                times[name].append(time.perf_counter() - start)
                start = time.perf_counter()
                fn(xs[576], lm_head)
                times["lm_" + name].append(time.perf_counter() - start)
        med = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        print(f"{m:3d} | {med['torch']:7.2f} ms {layer_bytes / med['torch'] / 1e6:4.1f} GB/s "
              f"{med['kernel']:7.2f} ms {layer_bytes / med['kernel'] / 1e6:4.1f} GB/s {med['torch'] / med['kernel']:5.2f} | "
              f"{med['lm_torch']:13.2f} ms {med['lm_kernel']:6.2f} ms {med['lm_torch'] / med['lm_kernel']:5.2f}")


if __name__ == "__main__":
    main()
