"""A fresh ``pagellm serve`` with its idle-time KV-cache prefault (the default) against one started with
``--no-kv-cache-prefault``, alternating round by round on the same workload (``pagellm bench serve``, random prompts,
EOS ignored), so both see the same spells of the machine. Each server idles ``--settle`` seconds after it is ready
(a deployed server idles before its traffic; with 0 the load starts at once and the prefault has had only the core's
idle moments of start-up). Prints each round, each side's medians and the ratios.

    .venv/bin/python benchmarks/kv_prefault.py [--rounds 3] [--settle 15] [--concurrency 32] [--num-prompts 200]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from compare import free_port, serve_args, stop, wait_ready  # noqa: E402
from peers import systems  # noqa: E402

from pagellm.bench import serve as bench_serve  # noqa: E402

SIDES = {"prefault": [], "first use": ["--no-kv-cache-prefault"]}
FIGURES = (("output tok/s", "output_throughput"), ("TTFT p95 ms", "p95_ttft_ms"), ("TPOT p50 ms", "median_tpot_ms"),
           ("TPOT p95 ms", "p95_tpot_ms"))


def one_run(args: argparse.Namespace, ctx: systems.Context, flags: list[str]) -> dict[str, float]:
    """One fresh server as compare.py starts pagellm (plus ``flags``), its ready time and its load's figures."""
    port = free_port()
    system = systems.pagellm(ctx, port)
    system.argv += ["--disable-log-stats", *flags]
    proc = subprocess.Popen(system.argv, env=systems.environment(system), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, cwd=systems.REPO)
    try:
        ready = wait_ready(f"http://127.0.0.1:{port}", proc, 300)
        time.sleep(args.settle)
        load = serve_args(f"http://127.0.0.1:{port}", args, args.concurrency, args.num_prompts, proc.pid, system, ctx)
        metrics = bench_serve.run(load)["runs"][0]["metrics"]
    finally:
        stop(proc)
    return {"ready s": ready, **{name: metrics[key] for name, key in FIGURES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    from pagellm.model.loader import default_model_path, resolve_model_dir

    ctx = systems.Context(resolve_model_dir(None), default_model_path(), args.dtype, args.threads, args.concurrency)
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for round_ in range(args.rounds):
        for side in (list(SIDES) if round_ % 2 == 0 else list(SIDES)[::-1]):  # which goes first alternates
            runs[side].append(one_run(args, ctx, SIDES[side]))
            print(f"round {round_ + 1} {side}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[side][-1].items()),
                  flush=True)
    print(f"\nc={args.concurrency}, {args.num_prompts} prompts {args.input_len}/{args.output_len}, "
          f"settle {args.settle:g} s, {args.rounds} rounds (medians)")
    for name in runs["prefault"][0]:
        medians = {side: statistics.median(r[name] for r in runs[side]) for side in SIDES}
        print(f"{name:>13}: prefault {medians['prefault']:8.1f}   first use {medians['first use']:8.1f}   "
              f"ratio {medians['prefault'] / medians['first use']:.3f}")


if __name__ == "__main__":
    main()
