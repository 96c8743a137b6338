"""Decode attention with K/V coming from DRAM, as in a real step: one attention call per layer over ``--layers``
separate layer caches (so a layer's K/V is long out of the caches when its turn comes back), each request's blocks
placed at random in the pool, as a served batch's blocks end up. Prints ms per layer call and the K/V read rate,
for this tree and, with ``--baseline DIR``, another pagellm checkout, alternated round by round in fresh processes
(the kernels build from each tree's own sources).

``benchmarks/attention.py`` times the same kernels with the step's K/V hot in the caches; this one is the
memory-bound case that sets decode attention's cost at batch 32 and more. ``--query-tokens`` > 1 makes each row a
prompt chunk or speculative chain over its cached context (flash tiles from 2 tokens up, bfloat16).
``--kv-cache-dtypes auto fp8`` times each cache element type (``--kv-cache-dtype``) side by side.
``--placement engine`` lays the blocks out as an offline run's batch gets them (each row's prompt blocks in one run
of ids) instead of anywhere in the pool.

    PYTHONPATH=. .venv/bin/python benchmarks/attention_dram.py [--batch 32 256] [--ctx 192] [--rounds 2]
        [--shape 9,3,64] [--query-tokens 1] [--layers 30] [--baseline /tmp/attn_base] [--kv-cache-dtypes auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BLOCK = 16


def placed_blocks(batch: int, blocks: int, pool: int, placement: str, prompt_blocks: int, gen: Any) -> Any:
    """[batch, blocks] block ids. ``random``: each row's blocks anywhere in the pool (of ``pool`` blocks), as a long
    served mix leaves them. ``engine``: as the engine's block pool hands them out to a batch that starts together
    (an offline run): each row's prompt blocks in one run of ids, then each later block of every row in turn."""
    import numpy as np
    import torch

    if placement == "random":
        return np.stack([torch.randperm(pool, generator=gen)[:blocks].numpy() for _ in range(batch)]).astype(np.int64)
    first = min(prompt_blocks, blocks)
    table = np.empty((batch, blocks), dtype=np.int64)
    table[:, :first] = np.arange(batch * first).reshape(batch, first)
    for j in range(first, blocks):
        table[:, j] = batch * first + (j - first) * batch + np.arange(batch)
    return table


def measure(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, q_tokens: int, layers: int,
            repeats: int, kv_cache_dtype: str = "auto", placement: str = "random", prompt_blocks: int = 8) -> float:
    """Median ms per layer call of the ``cpu_paged`` backend, K/V from DRAM (this process's pagellm)."""
    import numpy as np
    import torch

    from pagellm.attention.base import CommonAttentionInputs, get_backend

    def cache_of(x: torch.Tensor) -> torch.Tensor:
        if kv_cache_dtype == "auto":
            return x
        from pagellm.attention.base import quantize_kv, resolve_kv_dtype
        return quantize_kv(x, resolve_kv_dtype(kv_cache_dtype, x.dtype))

    backend = get_backend("cpu_paged")
    gen = torch.Generator().manual_seed(0)
    blocks = -(-ctx // BLOCK)
    pool = batch * blocks * 2
    table = placed_blocks(batch, blocks, pool, placement, prompt_blocks, gen)
    caches = [cache_of(torch.randn(2, pool, BLOCK, kv_heads, head_dim, generator=gen).to(torch.bfloat16))
              for _ in range(layers)]
    slots = torch.tensor([int(table[r, p // BLOCK]) * BLOCK + p % BLOCK
                          for r in range(batch) for p in range(ctx - q_tokens, ctx)])
    tokens = batch * q_tokens
    q = torch.randn(tokens, heads, head_dim).to(torch.bfloat16)
    k = torch.randn(tokens, kv_heads, head_dim).to(torch.bfloat16)
    starts = np.arange(0, tokens + 1, q_tokens, dtype=np.int64)
    md = backend.build(CommonAttentionInputs(starts, np.full(batch, ctx, dtype=np.int64), table, slots, BLOCK, None))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 2):
            start = time.perf_counter()
            for cache in caches:
                backend.forward(q, k, k, cache, md, head_dim ** -0.5)
            times.append((time.perf_counter() - start) / layers)
    return statistics.median(times[2:]) * 1e3


def run_tree(tree: Path, args: argparse.Namespace, batch: int, kv_cache_dtype: str = "auto") -> float:
    """One measurement in a fresh process that imports ``tree``'s pagellm."""
    heads, kv_heads, head_dim = (int(x) for x in args.shape.split(","))
    here = str(Path(__file__).parent)
    code = (f"import json, sys; sys.path[:0] = [{str(tree)!r}, {here!r}]; import attention_dram as a; "
            f"print(json.dumps(a.measure({batch}, {args.ctx}, {heads}, {kv_heads}, {head_dim}, {args.query_tokens}, "
            f"{args.layers}, {args.repeats}, {kv_cache_dtype!r}, {args.placement!r}, "
            f"{-(-args.prompt_tokens // BLOCK)})))")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--ctx", type=int, default=192, help="context length of every row (tokens)")
    parser.add_argument("--shape", default="9,3,64", help="query heads, kv heads, head size (SmolLM2: 9,3,64)")
    parser.add_argument("--query-tokens", type=int, default=1, help="query tokens per row (1: decode)")
    parser.add_argument("--layers", type=int, default=30, help="layer caches the calls rotate over")
    parser.add_argument("--repeats", type=int, default=10, help="passes over the layers per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", type=Path, default=None, help="another pagellm checkout to alternate with")
    parser.add_argument("--placement", choices=["random", "engine"], default="random",
                        help="where each row's blocks lie (see placed_blocks)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="--placement engine: each row's prompt")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], help="cache element types to time")
    args = parser.parse_args()
    heads, kv_heads, head_dim = (int(x) for x in args.shape.split(","))
    trees = {"this tree": Path(__file__).resolve().parents[1]}
    if args.baseline is not None:
        trees = {"baseline": args.baseline.resolve(), **trees}
    sides = {(f"{name} {dtype}" if len(args.kv_cache_dtypes) > 1 else name): (tree, dtype)
             for name, tree in trees.items() for dtype in args.kv_cache_dtypes}
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in args.batch:
            for name, (tree, dtype) in sides.items():
                results.setdefault((name, batch), []).append(run_tree(tree, args, batch, dtype))
    for batch in args.batch:
        line = [f"batch {batch:4d} ctx {args.ctx} q {args.query_tokens}:"]
        for name, (_, dtype) in sides.items():
            kv_bytes = batch * args.ctx * kv_heads * head_dim * 2 * (2 if dtype == "auto" else 1)
            runs = results[(name, batch)]
            ms = statistics.median(runs)
            line.append(f"{name} {ms:.3f} ms/layer ({' / '.join(f'{r:.3f}' for r in runs)}), "
                        f"{kv_bytes / ms / 1e6:.1f} GB/s")
        if args.baseline is not None:
            ratio = statistics.median(results[("this tree", batch)]) / statistics.median(results[("baseline", batch)])
            line.append(f"this tree / baseline {ratio:.2f}")
        print(line[0], " | ".join(line[1:]))


if __name__ == "__main__":
    main()
