"""A mixture of experts' sparse layers: the native call (``ops/moe.py``) against the Python loop it replaces (its
twin, ``PAGELLM_NATIVE_DECODER=0``), alternated in one process on the loaded model, per token count.

    .venv/bin/python benchmarks/moe_native_ab.py --model /tmp/gpt-oss-20b-4layers-mxfp4.gguf --rows 1 4 16 128

(``benchmarks/gpt_oss_mxfp4.py --gguf FILE`` writes that file.) Prints each side's median milliseconds per layer
call and the loop's time over the native call's. ``PAGELLM_NUM_THREADS`` sets the threads (default 2 here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    cmd = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cmd.add_argument("--model", required=True)
    cmd.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 128])
    cmd.add_argument("--rounds", type=int, default=6)
    cmd.add_argument("--calls", type=int, default=5, help="calls of every sparse layer per timing")
    args = cmd.parse_args()
    os.environ.setdefault("PAGELLM_NUM_THREADS", "2")
    from pagellm import LLM

    llm = LLM(args.model, dtype="bfloat16", kv_cache_memory=1 << 30, max_model_len=1024)
    try:
        model = llm.engine.core.executor.worker.runner.model
        sparse = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
        hidden = model.model.norm.weight.shape[0]
        for rows in args.rows:
            x = torch.randn(rows, hidden, dtype=torch.bfloat16)
            times: dict[str, list[float]] = {"native": [], "loop": []}
            for _ in range(args.rounds):
                for side in times:
                    os.environ["PAGELLM_NATIVE_DECODER"] = "1" if side == "native" else "0"
                    for mlp in sparse:  # warm
                        mlp(x)
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        for mlp in sparse:
                            mlp(x)
                    times[side].append((time.perf_counter() - start) / args.calls / len(sparse) * 1e3)
            native, loop = statistics.median(times["native"]), statistics.median(times["loop"])
            print(f"{rows} rows: native {native:.2f} ms, Python loop {loop:.2f} ms per layer ({loop / native:.2f}x)",
                  flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
