"""The native decoder stack's kernels as of older git revisions against this tree's, in one engine, alternated.

Builds the packed GEMM (``--gemm-rev``), the fused element-wise kernels (``--fused-rev``) and the stack itself
(``--stack-rev``) from git, each where given, and swaps them into the running stack by function pointer between
runs of ``LLM(dtype="bfloat16").generate``. Machine noise is shared by both sides and the comparison is of the
kernels, not the processes. The C signatures must match this tree's. Per round and batch size, each side serves
one short run (prefill and one decode step) and one long one; the difference over the extra tokens is the time
per decode step, and the short run's own time is printed too (prompts of 128 tokens: mostly their prefill). The LM
head (outside the stack) keeps this tree's GEMM on both sides.

    .venv/bin/python benchmarks/kernel_ab.py --gemm-rev 5cc1084 [--fused-rev R] [--stack-rev R]
        [--batch 1 32] [--tokens 96] [--rounds 6]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's pagellm

import numpy as np  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.ops import decoder_stack  # noqa: E402
from pagellm.ops.decoder_stack import DecoderStack, _address  # noqa: E402
from small_gemm import library_at, packed_gemm_at  # noqa: E402  (benchmarks/, on the path as this script's folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gemm-rev", default=None)
    parser.add_argument("--fused-rev", default=None)
    parser.add_argument("--stack-rev", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=96, help="output tokens of the long run")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if not (args.gemm_rev or args.fused_rev or args.stack_rev):
        raise SystemExit("give at least one of --gemm-rev, --fused-rev, --stack-rev")
    llm = LLM(dtype="bfloat16")
    rng = np.random.default_rng(0)

    def run(batch: int, tokens: int) -> float:
        prompts = [rng.integers(100, 40000, 128).tolist() for _ in range(batch)]
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0), use_tqdm=False)
        return time.perf_counter() - start

    run(1, 4)  # builds the stack
    loaded = decoder_stack._lib()
    stacks = [o for o in gc.get_objects() if type(o) is DecoderStack]
    if loaded is None or len(stacks) != 1:
        raise SystemExit("the native decoder stack does not serve this model here")
    lib, kernels = loaded
    stack = stacks[0]
    new = {name: getattr(kernels, name) for name in FIELDS} | {"fn": stack._fn}
    old = _old_kernels(args, lib, new)

    def use(side: dict) -> None:
        for name in FIELDS:
            setattr(kernels, name, side[name])
        stack._fn = side["fn"]

    revs = ", ".join(f"{k} {v}" for k, v in (("GEMM", args.gemm_rev), ("fused", args.fused_rev),
                                              ("stack", args.stack_rev)) if v)
    print(f"old = {revs}; new = this tree")
    for batch in args.batch:
        times: dict[str, list[float]] = {"old": [], "new": []}
        prefill: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                use(old if name == "old" else new)
                short = run(batch, 2)
                prefill[name].append(short * 1e3)
                times[name].append((run(batch, args.tokens) - short) / (args.tokens - 2) * 1e3)
        use(new)
        _report(batch, "ms per decode step", times)
        _report(batch, "ms for the prompts and two tokens", prefill)


FIELDS = ("linear", "add_rms_norm", "rotary", "silu_and_mul", "linear_silu_mul")  # the stack's kernel pointers


def _old_kernels(args: argparse.Namespace, lib, new: dict) -> dict:
    """``new`` with the kernels of the revisions given (--gemm-rev, --fused-rev, --stack-rev) in their places."""
    old = dict(new)
    if args.gemm_rev:
        old_gemm = packed_gemm_at(args.gemm_rev)
        old["linear"] = _address(old_gemm.pagellm_packed_linear_bf16)
        # a revision without the fused gate/up pass: the stack makes the two calls (null pointer)
        fused_pass = getattr(old_gemm, "pagellm_packed_linear_silu_mul_bf16", None)
        old["linear_silu_mul"] = _address(fused_pass) if fused_pass is not None else None
    if args.fused_rev:
        fused = library_at(args.fused_rev, "pagellm/ops/csrc/fused.cpp")
        for name in ("add_rms_norm", "rotary", "silu_and_mul"):
            old[name] = _address(getattr(fused, f"pagellm_{name}_bf16"))
    if args.stack_rev:
        fn = library_at(args.stack_rev, "pagellm/ops/csrc/decoder_stack.cpp").pagellm_decoder_stack_bf16
        fn.argtypes, fn.restype = lib.pagellm_decoder_stack_bf16.argtypes, lib.pagellm_decoder_stack_bf16.restype
        old["fn"] = fn
    return old


def _report(batch: int, what: str, times: dict[str, list[float]]) -> None:
    ratio = statistics.median(times["new"]) / statistics.median(times["old"])
    print(f"batch {batch:3d}: {what}, old " + " / ".join(f"{t:.2f}" for t in times["old"])
          + " | new " + " / ".join(f"{t:.2f}" for t in times["new"]) + f" | new / old (medians) {ratio:.3f}",
          flush=True)

if __name__ == "__main__":
    main()
