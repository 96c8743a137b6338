"""pagellm under two (or more) sets of engine flags, alternating round by round on one workload so that every side
sees the same spells of the machine: served (a fresh ``pagellm serve`` per run as compare.py starts it, idling
``--settle`` seconds, then ``pagellm bench serve``, random prompts, EOS ignored) and/or offline (``pagellm bench
throughput`` in a fresh process). Prints each run, each side's medians and each side's ratio to the first.

    .venv/bin/python benchmarks/flags_ab.py --side auto= --side fp8="--kv-cache-dtype fp8" [--mode serve offline]
        [--rounds 3] [--settle 15] [--concurrency 32] [--num-prompts 200] [--offline-num-prompts 256]
    .venv/bin/python benchmarks/flags_ab.py --side small= --side huge= --env huge=PAGELLM_KV_HUGE_PAGES=1
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from compare import free_port, pagellm_offline, serve_args, stop, wait_ready  # noqa: E402
from peers import systems  # noqa: E402

from pagellm.bench import serve as bench_serve  # noqa: E402

SERVE_FIGURES = (("output tok/s", "output_throughput"), ("TTFT p50 ms", "median_ttft_ms"),
                 ("TTFT p95 ms", "p95_ttft_ms"), ("TPOT p50 ms", "median_tpot_ms"), ("TPOT p95 ms", "p95_tpot_ms"))


def served(args: argparse.Namespace, ctx: systems.Context, flags: list[str],
           env: dict[str, str]) -> dict[str, float]:
    """One fresh server as compare.py starts pagellm (plus ``flags``, ``env``), its ready time and its load's
    figures."""
    port = free_port()
    system = systems.pagellm(ctx, port)
    system.argv += ["--disable-log-stats", *flags]
    proc = subprocess.Popen(system.argv, env={**systems.environment(system), **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, cwd=systems.REPO)
    try:
        ready = wait_ready(f"http://127.0.0.1:{port}", proc, 300)
        time.sleep(args.settle)
        load = serve_args(f"http://127.0.0.1:{port}", args, args.concurrency, args.num_prompts, proc.pid, system, ctx)
        metrics = bench_serve.run(load)["runs"][0]["metrics"]
    finally:
        stop(proc)
    return {"ready s": ready, **{name: metrics[key] for name, key in SERVE_FIGURES}}


def offline(args: argparse.Namespace, ctx: systems.Context, flags: list[str],
            env: dict[str, str]) -> dict[str, float]:
    """``pagellm bench throughput`` (plus ``flags``, ``env``) in a fresh process, as compare.py runs it for pagellm."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        argv, base_env = pagellm_offline(args, ctx, result, flags)
        subprocess.run(argv, env={**systems.environment(systems.System("pagellm", argv, base_env)), **env},
                       check=True,
                       stdout=subprocess.DEVNULL, cwd=systems.REPO)
        run = json.loads(result.read_text())["results"][0]
    return {"offline tok/s": run["output_throughput"]}


def parse_sides(specs: list[str]) -> dict[str, list[str]]:
    sides = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"--side wants NAME=FLAGS, got {spec!r}")
        sides[name] = shlex.split(flags)
    if len(sides) < 2:
        raise SystemExit("give at least two --side NAME=FLAGS")
    return sides


def parse_env(specs: list[str], sides: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    """``--env SIDE=VAR=VALUE`` specs as each side's environment overrides."""
    envs: dict[str, dict[str, str]] = {side: {} for side in sides}
    for spec in specs:
        side, _, assignment = spec.partition("=")
        name, sep, value = assignment.partition("=")
        if side not in sides or not sep:
            raise SystemExit(f"--env wants SIDE=VAR=VALUE for a --side, got {spec!r}")
        envs[side][name] = value
    return envs


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=15.0, help="seconds each server idles before its load")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--offline-num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="served prompts' and outputs' lengths vary uniformly by ± this fraction")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")


def run_ab(args: argparse.Namespace, sides: dict[str, list[str]], modes: list[str],
           envs: dict[str, dict[str, str]] | None = None) -> None:
    from pagellm.model.loader import default_model_path, hf_model_dir

    ctx = systems.Context(hf_model_dir(None), default_model_path(), args.dtype, args.threads, args.concurrency)

    def measure(side: str) -> dict[str, float]:
        figures: dict[str, float] = {}
        if "serve" in modes:
            figures |= served(args, ctx, sides[side], (envs or {}).get(side, {}))
        if "offline" in modes:
            figures |= offline(args, ctx, sides[side], (envs or {}).get(side, {}))
        return figures

    runs = alternate(list(sides), args.rounds, measure)
    print_medians(runs, f"{' + '.join(modes)}: c={args.concurrency}, {args.num_prompts} served / "
                  f"{args.offline_num_prompts} offline prompts {args.input_len}/{args.output_len}, settle "
                  f"{args.settle:g} s, {args.rounds} rounds")


def alternate(sides: list[str], rounds: int,
              measure: Callable[[str], dict[str, float]]) -> dict[str, list[dict[str, float]]]:
    """Each side's figures, round by round, the side that goes first alternating; each run printed as it ends."""
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for round_ in range(rounds):
        for side in (sides if round_ % 2 == 0 else sides[::-1]):
            figures = measure(side)
            runs[side].append(figures)
            print(f"round {round_ + 1} {side}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()), flush=True)
    return runs


def print_medians(runs: dict[str, list[dict[str, float]]], title: str) -> None:
    """Each figure's median per side and its ratio to the first side's."""
    first = next(iter(runs))
    print(f"\n{title} (medians; ratio to {first})")
    width = max(len(name) for name in runs[first][0])
    for name in runs[first][0]:
        medians = {side: statistics.median(r[name] for r in runs[side]) for side in runs}
        base = medians[first]
        print(f"{name:>{width}}: " + "   ".join(f"{side} {value:8.1f} ({f'{value / base:.3f}' if base else '-'})"
                                             for side, value in medians.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", action="append", required=True, metavar="NAME=FLAGS",
                        help="a side: its name and its extra engine flags (repeat; the first is the baseline)")
    parser.add_argument("--env", action="append", default=[], metavar="SIDE=VAR=VALUE",
                        help="an environment variable for one side's runs (repeat)")
    parser.add_argument("--mode", nargs="+", choices=["serve", "offline"], default=["serve"])
    add_workload_args(parser)
    args = parser.parse_args()
    sides = parse_sides(args.side)
    run_ab(args, sides, args.mode, parse_env(args.env, sides))


if __name__ == "__main__":
    main()
