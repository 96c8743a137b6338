"""bfloat16 GEMM on a model's shapes: ``F.linear`` (oneDNN), the previous small-M kernel and the packed kernel
(``pagellm/ops/gemm.py``), one run, interleaved repetitions, medians.

For each batch size M it runs the linear layers of ``--layers`` decoder layers (SmolLM2-135M, the default: 30
layers of fused qkv 576→960, o 576→576, fused gate/up 576→3072, down 1536→576; distinct matrices, so at small M
the weights come from DRAM as in a real step) and then the LM head (576→49,152), and prints milliseconds,
effective weight bandwidth (GB/s), arithmetic rate (GFLOP/s) and the packed kernel's speed-up over the others.
``--shapes llama3-8b`` runs one Llama-3-8B layer (4096→6144, 4096→4096, 4096→28672, 14336→4096) instead, without
the LM head. The previous kernel (``pagellm/ops/csrc/small_gemm.cpp``, a dot-product formulation with horizontal
reductions, dispatched at M ≤ 8) is built from git (``--old-rev``) and run up to ``--old-max-m`` rows.
``--packed-rev REV`` also builds the packed kernel as of REV (same packed layout) and runs it beside this tree's,
interleaved, with the ratio of the two: a change to the kernel measured in one process. On a CPU with AMX the
packed kernel runs on AMX tiles, and its AVX-512 path runs beside it as ``avx512`` (the same library, switched per
call with ``gemm.use_amx``). On a CPU with AVX-512 VNNI the W8A8 int8 GEMM (``--quantization w8a8_int8``,
``pagellm/ops/gemm_w8a8.py``) runs beside them as ``w8a8``, on the same matrices quantized (GB/s counts bf16 bytes);
on a CPU with AMX-INT8 that is its AMX tile path, and its VNNI tiles run beside it as ``w8a8-vnni``.
``--gate-up`` times only the layers' gate/up matrices followed by SiLU·mul, as the decoder stack runs its MLP: the
two calls (the GEMM, then ``fused.silu_and_mul``) against the one pass (``packed_linear_silu_mul``, gate and up
panels paired in one tile, where the kernel has it), bfloat16 and int8.

    .venv/bin/python benchmarks/small_gemm.py [--m 1 2 4 ... 2048] [--reps 7] [--threads N] [--old-rev 0f51e58]
        [--old-max-m 64] [--packed-rev REV] [--shapes smollm2|llama3-8b] [--layers N] [--gate-up]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's pagellm

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pagellm.ops import fused, gemm, gemm_w8a8  # noqa: E402
from pagellm.ops.build import load_library  # noqa: E402

SHAPES = {  # (in, out) of one decoder layer's matrices, LM head (in, out) or None, default layer count
    "smollm2": ([(576, 960), (576, 576), (576, 3072), (1536, 576)], (576, 49152), 30),
    "llama3-8b": ([(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)], None, 1),
}


def library_at(rev: str, path: str) -> ctypes.CDLL:
    """The kernel library built from ``path`` (relative to the checkout) as of git revision ``rev``, with the
    headers beside it as of that revision (a quoted include finds them before the shared folder on the path)."""
    def show(name: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{name}"], check=True, capture_output=True,
                              text=True).stdout

    folder = Path(tempfile.mkdtemp())
    listing = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, f"{Path(path).parent}/"],
                             check=True, capture_output=True, text=True).stdout.split()
    for header in (name for name in listing if name.endswith(".h")):
        (folder / Path(header).name).write_text(show(header))
    copy = folder / Path(path).name
    copy.write_text(show(path))
    return load_library(copy)


def old_kernel(rev: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The small-M kernel as of ``rev`` (built from ``git show``), or ``None`` where git or the build fails."""
    try:
        fn = library_at(rev, "pagellm/ops/csrc/small_gemm.cpp").pagellm_linear_bf16
    except (OSError, subprocess.CalledProcessError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p]

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
        fn(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], None, y.data_ptr())
        return y
    return run


def packed_gemm_at(rev: str) -> ctypes.CDLL:
    """The packed GEMM library as of git revision ``rev``, on the path (AMX or AVX-512) this tree's kernel takes."""
    lib = library_at(rev, "pagellm/ops/csrc/packed_gemm.cpp")
    if hasattr(lib, "pagellm_packed_gemm_use_amx"):
        lib.pagellm_packed_gemm_use_amx(int(gemm.amx()))
    return lib


def packed_at(rev: str) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """``gemm.packed_linear`` with the packed kernel's source as of git revision ``rev``."""
    fn = packed_gemm_at(rev).pagellm_packed_linear_bf16
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

    def run(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), packed.data_ptr(), n, None, y.data_ptr(), n)
        return y
    return run


def methods(plain: list[torch.Tensor], old: Callable | None,
            packed_rev: Callable | None = None) -> dict[str, Callable[[dict], None]]:
    """Each method as a function of the inputs by K that runs every matrix once."""
    packed = [(gemm.pack(w), w.shape[0], w.shape[1]) for w in plain]
    out = {
        "F.linear": lambda xs: [F.linear(xs[w.shape[1]], w) for w in plain],
        "packed": lambda xs: [gemm.packed_linear(xs[k], p, n) for p, n, k in packed],
    }
    if old is not None:
        out["old"] = lambda xs: [old(xs[w.shape[1]], w) for w in plain]
    if packed_rev is not None:
        out["packed@rev"] = lambda xs: [packed_rev(xs[k], p, n) for p, n, k in packed]
    if gemm.amx():
        out["avx512"] = lambda xs: _off_amx(gemm.use_amx,
                                            lambda: [gemm.packed_linear(xs[k], p, n) for p, n, k in packed])
    if gemm_w8a8.available():
        int8 = [(gemm_w8a8.pack(*gemm_w8a8.quantize(w)), w.shape[0], w.shape[1]) for w in plain]
        out["w8a8"] = lambda xs: [gemm_w8a8.packed_linear(xs[k], p, n) for p, n, k in int8]
        if gemm_w8a8.amx():
            out["w8a8-vnni"] = lambda xs: _off_amx(gemm_w8a8.use_amx,
                                                   lambda: [gemm_w8a8.packed_linear(xs[k], p, n) for p, n, k in int8])
    return out


def gate_up_methods(gate_ups: list[torch.Tensor]) -> dict[str, Callable[[dict], None]]:
    """Gate/up GEMM + SiLU·mul over every matrix: two calls and one pass, bfloat16 and (where it runs) int8."""
    n2 = gate_ups[0].shape[0]
    packed = [gemm.pack(w) for w in gate_ups]
    out = {"bf16 two calls": lambda xs: [fused.silu_and_mul(gemm.packed_linear(xs, p, n2)) for p in packed],
           "bf16 one pass": lambda xs: [gemm.packed_linear_silu_mul(xs, p, n2) for p in packed]}
    if gemm_w8a8.available():
        int8 = [gemm_w8a8.pack(*gemm_w8a8.quantize(w)) for w in gate_ups]
        out["w8a8 two calls"] = lambda xs: [fused.silu_and_mul(gemm_w8a8.packed_linear(xs, p, n2)) for p in int8]
        out["w8a8 one pass"] = lambda xs: [gemm_w8a8.packed_linear_silu_mul(xs, p, n2) for p in int8]
    return out


def gate_up_row(m: int, med: dict[str, float]) -> str:
    cells = [f"gate/up  {m:5d}"] + [f"{name} {t * 1e3:8.2f} ms" for name, t in med.items()]
    ratios = [f"{kind} one pass ×{med[kind + ' two calls'] / med[kind + ' one pass']:.3f} the two calls' speed"
              for kind in ("bf16", "w8a8") if kind + " one pass" in med]
    return " | ".join(cells + [", ".join(ratios)])


def _off_amx(use_amx: Callable[[bool], bool], run: Callable[[], object]) -> None:
    """``run`` with a kernel's AMX tiles switched off (``use_amx``: ``gemm.use_amx`` for the packed bfloat16 kernel's
    AVX-512 path, ``gemm_w8a8.use_amx`` for the int8 kernel's VNNI tiles), then back on."""
    use_amx(False)
    try:
        run()
    finally:
        use_amx(True)


def measure(runs: dict[str, Callable[[dict], None]], xs: dict[int, torch.Tensor], reps: int) -> dict[str, float]:
    """Median seconds per method, repetitions interleaved across methods (one warm-up each first)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, fn in runs.items():
        fn(xs)
    for _ in range(reps):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn(xs)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def row(label: str, m: int, med: dict[str, float], weight_bytes: int, flops_per_row: int) -> str:
    cells = [f"{label:8} {m:5d}"]
    for name in ("F.linear", "old", "packed@rev", "avx512", "packed", "w8a8-vnni", "w8a8"):
        if name in med:
            t = med[name]
            cells.append(f"{name} {t * 1e3:8.2f} ms {weight_bytes / t / 1e9:5.1f} GB/s "
                         f"{m * flops_per_row / t / 1e9:6.1f} GFLOP/s")
        else:
            cells.append(f"{name} {'-':>38}")
    ratios = [f"×{med[name] / med['packed']:.2f} vs {name}" for name in ("F.linear", "old", "packed@rev", "avx512")
              if name in med]
    if "w8a8" in med:
        ratios.append(f"w8a8 ×{med['packed'] / med['w8a8']:.2f} the packed bf16's speed")
    if "w8a8-vnni" in med:
        ratios.append(f"w8a8 on AMX ×{med['w8a8-vnni'] / med['w8a8']:.2f} its VNNI tiles' speed")
    return " | ".join(cells + [", ".join(ratios)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 2048])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 30 for smollm2, 1 for 8B)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--old-rev", default="0f51e58", help="git revision holding the previous small-M kernel")
    parser.add_argument("--old-max-m", type=int, default=64, help="largest M to run the previous kernel at")
    parser.add_argument("--packed-rev", default=None, help="git revision of the packed kernel to run beside this one")
    parser.add_argument("--gate-up", action="store_true",
                        help="time the gate/up matrices with SiLU·mul only: two calls against one pass")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not gemm.available():
        raise SystemExit("the packed GEMM kernel is not available here (needs AVX-512 BF16 and a C++ compiler)")
    old = old_kernel(args.old_rev) if args.old_max_m > 0 else None
    packed_rev = packed_at(args.packed_rev) if args.packed_rev else None
    layer_shapes, head_shape, default_layers = SHAPES[args.shapes]
    layers = [torch.randn(n, k).to(torch.bfloat16) for _ in range(args.layers or default_layers)
              for k, n in layer_shapes]
    if args.gate_up:
        gate_ups = layers[2::len(layer_shapes)]  # the fused gate/up matrix of each layer
        runs = gate_up_methods(gate_ups)
        print(f"threads {torch.get_num_threads()}, packed kernel on {gemm.path()}, {len(gate_ups)} gate/up matrices "
              f"{tuple(gate_ups[0].shape)}")
        for m in args.m:
            print(gate_up_row(m, measure(runs, torch.randn(m, gate_ups[0].shape[1]).to(torch.bfloat16), args.reps)),
                  flush=True)
        return
    groups = [("layers", layers)]
    if head_shape is not None:
        groups.append(("LM head", [torch.randn(head_shape[1], head_shape[0]).to(torch.bfloat16)]))
    print(f"threads {torch.get_num_threads()}, packed kernel on {gemm.path()}, "
          f"previous kernel {'from ' + args.old_rev if old else 'not run'}"
          + (f", packed kernel also as of {args.packed_rev}" if packed_rev else ""))
    for label, weights in groups:
        all_runs = methods(weights, old, packed_rev)
        weight_bytes = sum(w.numel() * 2 for w in weights)
        flops_per_row = 2 * sum(w.numel() for w in weights)
        for m in args.m:
            runs = {name: fn for name, fn in all_runs.items() if name != "old" or m <= args.old_max_m}
            xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {w.shape[1] for w in weights}}
            print(row(label, m, measure(runs, xs, args.reps), weight_bytes, flops_per_row), flush=True)


if __name__ == "__main__":
    main()
