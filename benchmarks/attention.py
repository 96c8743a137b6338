"""Attention kernels alone: one layer's attention call (K/V write + attend) per step shape, this tree against
another checkout of pagellm (e.g. main), runs alternated in the same session.

Shapes are SmolLM2-135M's (9 query heads, 3 kv heads, head_dim 64, blocks of 16): decodes, speculative
verification (chains of k + 1 tokens and a Medusa-style tree), fresh prompts and prompt chunks after a
prefix-cache hit. Each figure is the median over ``--repeats`` calls of the public backend interface
(``get_backend(name).build`` once per step, ``forward`` timed), so any pagellm checkout can run it:

    PYTHONPATH=. .venv/bin/python benchmarks/attention.py --baseline /tmp/attn_base [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
TREE = [3, 2, 1]


def scenarios() -> dict[str, list[tuple[int, int, bool]]]:
    """name → rows of (query tokens, context length after the step, is a tree)."""
    tree_nodes = sum(int(__import__("math").prod(TREE[:d + 1])) for d in range(len(TREE)))
    return {
        "decode b1 ctx256": [(1, 256, False)],
        "decode b32 ctx256": [(1, 256, False)] * 32,
        "chain k=4 b1 ctx200": [(5, 200, False)],
        "chain k=4 b8 ctx200": [(5, 200, False)] * 8,
        "chain k=4 b32 ctx200": [(5, 200, False)] * 32,
        "tree 15 b1 ctx200": [(tree_nodes + 1, 200, True)],
        "tree 15 b8 ctx200": [(tree_nodes + 1, 200, True)] * 8,
        "prompt 4x512": [(512, 512, False)] * 4,
        "prompt 16x128": [(128, 128, False)] * 16,
        "chunk 4x256 after 256 cached": [(256, 512, False)] * 4,
        "prompt 1x2048": [(2048, 2048, False)],
        "prompt 1x4096": [(4096, 4096, False)],
        "chunk 1x2048 after 2048 cached": [(2048, 4096, False)],
    }


def run(dtype_name: str, backend_name: str, repeats: int) -> dict[str, float]:
    import numpy as np
    import torch

    from pagellm.attention.base import CommonAttentionInputs, get_backend
    from pagellm.spec.tree import row_mask, static_tree

    dtype = getattr(torch, dtype_name)
    backend = get_backend(backend_name)
    parents = static_tree(TREE)
    results = {}
    for name, rows in scenarios().items():
        gen = torch.Generator().manual_seed(0)
        blocks = [-(-ctx // BLOCK) for _, ctx, _ in rows]
        table = np.zeros((len(rows), max(blocks)), dtype=np.int64)
        order = torch.randperm(sum(blocks) + 1, generator=gen).numpy()
        at = 0
        for r, n in enumerate(blocks):
            table[r, :n] = order[at:at + n]
            at += n
        cache = torch.randn(2, sum(blocks) + 1, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        slots = [int(table[r, p // BLOCK]) * BLOCK + p % BLOCK
                 for r, (n, ctx, _) in enumerate(rows) for p in range(ctx - n, ctx)]
        total = len(slots)
        q = torch.randn(total, HEADS, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        qsl = np.concatenate([[0], np.cumsum([n for n, _, _ in rows])]).astype(np.int64)
        trees = {r: row_mask(n, parents) for r, (n, _, tree) in enumerate(rows) if tree}
        common = CommonAttentionInputs(qsl, np.array([c for _, c, _ in rows], dtype=np.int64), table,
                                       torch.tensor(slots, dtype=torch.int64), BLOCK, trees or None)
        metadata = backend.build(common)
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 2):
                start = time.perf_counter()
                backend.forward(q, k, v, cache, metadata, HEAD_DIM ** -0.5)
                times.append(time.perf_counter() - start)
        results[name] = 1000 * statistics.median(times[2:])
    return results


def child(tree: str, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, __file__, "--child", "--dtype", args.dtype, "--backend", args.backend,
                          "--repeats", str(args.repeats)], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, help="another pagellm checkout to compare against")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="cpu_paged")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="alternated runs of each tree")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.dtype, args.backend, args.repeats)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this tree": here, **({"baseline": args.baseline} if args.baseline else {})}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, path in trees.items():
            samples[name].append(child(path, args))
    medians = {name: {s: statistics.median(r[s] for r in runs) for s in runs[0]} for name, runs in samples.items()}
    print(f"{args.backend}, {args.dtype}, ms per layer call (median of {args.rounds} alternated runs x "
          f"{args.repeats} calls)")
    print(f"{'step':<32}{'this tree':>11}" + (f"{'baseline':>11}{'speed-up':>10}" if args.baseline else ""))
    for scenario, ms in medians["this tree"].items():
        line = f"{scenario:<32}{ms:>11.3f}"
        if args.baseline:
            base = medians["baseline"][scenario]
            line += f"{base:>11.3f}{base / ms:>9.2f}x"
        print(line)


if __name__ == "__main__":
    main()
