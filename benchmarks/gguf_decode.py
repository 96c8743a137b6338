"""A GGUF's blocks decoded at load: each block type's native pass against gguf's own numpy ``dequantize`` (the
fallback while the library is not built), a float16 matrix copied into bfloat16 natively against torch's ``copy_``,
and, with ``--gguf``, a whole file's load (its stream, and the model's ``load_weights`` from it).

    PAGELLM_NUM_THREADS=2 .venv/bin/python benchmarks/gguf_decode.py [--rows 8192 --inputs 2048]
        [--baseline-rev REV] [--gguf FILE ...] [--rounds 3]

Each block type decodes the same random blocks (random bytes under float16 scales of a weight's size), into bfloat16
and into float32, the best of five calls. ``--baseline-rev REV`` also times that revision's ``csrc/fused.cpp`` on the
types it had (its first four entries, Q4_0, Q4_1, Q4_K and Q8_0, are numbered as now), built here. ``--gguf``: each
file's stream and its load in bfloat16, ``--rounds`` times in fresh processes (after one that converts it and fills
the cache), alternating with ``--baseline-rev``'s tree where given, which keeps its own cache (a converter change
would otherwise have each tree convert the file again after the other).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from startup import export  # noqa: E402

from pagellm import envs  # noqa: E402
from pagellm.ops import build, fused  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OLD_KINDS = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")  # the types (and numbering) of Round 32's entry
# Where each block type keeps its float16 numbers: bytes [start, end) of the block.
HALVES = {"Q4_0": (0, 2), "Q4_1": (0, 4), "Q4_K": (0, 4), "Q8_0": (0, 2), "Q5_0": (0, 2), "Q5_1": (0, 4),
          "Q5_K": (0, 4), "Q6_K": (208, 210), "Q2_K": (80, 84), "Q3_K": (108, 110), "IQ4_NL": (0, 2), "IQ4_XS": (0, 2)}


def random_blocks(kind: str, rows: int, inputs: int, rng: np.random.Generator) -> torch.Tensor:
    if kind in ("F16", "BF16"):
        w = rng.standard_normal((rows, inputs)).astype(np.float32) * 0.05
        raw = w.astype(np.float16) if kind == "F16" else (w.view(np.uint32) >> 16).astype(np.uint16)
        return torch.from_numpy(raw.view(np.uint8).reshape(rows, -1))
    values, size = fused.GGUF_BLOCKS[kind]
    blocks = rng.integers(0, 256, size=(rows, inputs // values, size), dtype=np.uint8)
    start, end = HALVES[kind]
    halves = rng.uniform(1e-4, 1e-2, size=(rows, inputs // values, (end - start) // 2)).astype(np.float16)
    blocks[..., start:end] = halves.view(np.uint8)
    return torch.from_numpy(blocks.reshape(rows, -1))


def best_ms(fn, reps: int = 5) -> float:  # noqa: ANN001
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def baseline_lib(rev: str) -> ctypes.CDLL:
    """``rev``'s ``csrc/fused.cpp`` (with that revision's headers), built here with the kernels' flags."""
    folder = export(rev, Path(tempfile.mkdtemp(prefix="fused-"))) / "pagellm" / "ops" / "csrc"
    return fused.bind(ctypes.CDLL(str(build.build(folder / "fused.cpp", build.CXX_FLAGS, "fused.so", [folder]))))


def decode_table(rows: int, inputs: int, old: ctypes.CDLL | None) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    lib = fused._lib()
    rng = np.random.default_rng(0)
    print(f"decoding one {rows} x {inputs} matrix ({rows * inputs / 1e6:.1f} M values), best of 5:")
    print(f"{'type':>8} {'into':>9} {'native':>10} {'baseline':>10} {'gguf numpy':>11}")
    for kind in fused.GGUF_BLOCKS:
        raw = random_blocks(kind, rows, inputs, rng)
        reference = best_ms(lambda: dequantize(raw.numpy(), GGMLQuantizationType[kind]), reps=1)
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.empty(rows, inputs, dtype=dtype)
            index = list(fused.GGUF_BLOCKS).index(kind)
            times = [best_ms(lambda: each.pagellm_dequantize_gguf(raw.data_ptr(), rows, raw.shape[1], index,
                                                                   out.data_ptr(), dtype == torch.bfloat16))
                     if each is not None else None for each in (lib, old if kind in OLD_KINDS else None)]
            cells = [f"{t:8.1f} ms" if t is not None else f"{'-':>11}" for t in times]
            print(f"{kind:>8} {str(dtype).removeprefix('torch.'):>9} {cells[0]:>10} {cells[1]:>10} "
                  f"{reference:8.0f} ms")
    src = torch.randn(rows, inputs).half()
    dst = torch.empty(rows, inputs, dtype=torch.bfloat16)
    native = best_ms(lambda: fused.copy_float16(dst, src))
    torch_copy = best_ms(lambda: dst.copy_(src))
    print(f"float16 into bfloat16 in place: fused.copy_float16 {native:.1f} ms, torch copy_ {torch_copy:.1f} ms")


# One load of a GGUF's conversion in bfloat16 (argv[1]), in a fresh process of the tree on PYTHONPATH: a model's
# load_weights from its stream first (transient, as the worker's, where the tree has it), then the stream alone.
LOAD_ONCE = """
import inspect, sys, time, torch
from pagellm.model.arch import ArchConfig
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.loader import iter_weights, load_hf_config, resolve_model_dir
model_dir = resolve_model_dir(sys.argv[1])
model = LlamaForCausalLM(ArchConfig.from_hf(load_hf_config(model_dir)), torch.bfloat16)
asked = dict(dtype=torch.bfloat16, **({"transient": True} if "transient" in inspect.signature(iter_weights).parameters
                                      else {}))
start = time.perf_counter()
model.load_weights(iter_weights(model_dir, **asked))
load = time.perf_counter() - start
start = time.perf_counter()
values = sum(tensor.numel() for _, tensor in iter_weights(model_dir, **asked))
print(f"{values / 1e9:.2f} {time.perf_counter() - start:.3f} {load:.3f}")
"""


def load_times(paths: list[str], rev: str | None, rounds: int) -> None:
    """Each file's load, round by round in fresh processes, alternating with ``rev``'s tree (``git archive`` of
    ``pagellm/``, with its own cache holding this machine's kernel builds) where given."""
    with tempfile.TemporaryDirectory() as exported, tempfile.TemporaryDirectory() as cache:
        trees = {"this tree": (REPO, None)}
        if rev:
            export(rev, Path(exported))
            shutil.copytree(envs.cache_dir() / "kernels", Path(cache) / "kernels")
            trees[rev] = (Path(exported), cache)
        for path in paths:
            for name, (tree, cache_dir) in trees.items():  # converts the file, and fills each tree's cache
                run_load(tree, cache_dir, path)
            loads: dict[str, list[float]] = {name: [] for name in trees}
            for round_ in range(rounds):
                for name, (tree, cache_dir) in list(trees.items())[:: 1 if round_ % 2 == 0 else -1]:
                    values, stream, load = run_load(tree, cache_dir, path)
                    loads[name].append(load)
                    print(f"{Path(path).name} ({name}): stream {values:.2f} G values in {stream:.2f} s, "
                          f"load_weights {load:.2f} s")
            for name, times in loads.items():
                print(f"{Path(path).name} ({name}): load_weights median {statistics.median(times):.2f} s")


def run_load(tree: Path, cache_dir: str | None, path: str) -> tuple[float, float, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)} | ({"PAGELLM_CACHE_DIR": cache_dir} if cache_dir else {})
    out = subprocess.run([sys.executable, "-c", LOAD_ONCE, path], env=env, cwd=tree, check=True,
                         capture_output=True, text=True).stdout.split()
    values, stream, load = (float(x) for x in out[-3:])
    return values, stream, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--inputs", type=int, default=2048, help="a multiple of 256")
    parser.add_argument("--baseline-rev", default=None, help="also time this revision's csrc/fused.cpp")
    parser.add_argument("--gguf", nargs="*", default=[], help="GGUF files whose load to time")
    parser.add_argument("--rounds", type=int, default=3, help="loads of each --gguf file per tree")
    args = parser.parse_args()
    if fused._lib() is None:
        raise SystemExit("the fused kernels do not build on this machine")
    decode_table(args.rows, args.inputs, baseline_lib(args.baseline_rev) if args.baseline_rev else None)
    if args.gguf:
        load_times(args.gguf, args.baseline_rev, args.rounds)


if __name__ == "__main__":
    main()
