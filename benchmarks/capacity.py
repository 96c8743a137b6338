"""How much load each system carries within a latency SLO: pagellm and its peers under the same request-rate ramp.

Each system (pagellm, and vLLM / llama.cpp where installed, as ``compare.py`` starts them) is started fresh, idles
``--settle`` seconds, and serves one ``pagellm bench serve`` run whose offered rate ramps linearly from
``--start-rps`` to ``--end-rps`` over ``--num-prompts`` random requests (128 in / 128 out by default, EOS ignored, no
concurrency cap), with the SLOs of ``--goodput`` (default ``ttft:2000 tpot:100``). Printed per system and round: the
offered rate at which the first request (in send order) missed an SLO, the goodput (requests within every SLO per
second) and the output tok/s; then the medians and pagellm's ratio to each peer. Systems alternate within each
round, so the machine's spells fall on all of them.

    .venv/bin/python benchmarks/capacity.py [--systems pagellm vllm] [--rounds 2] [--start-rps 0.5]
        [--end-rps 8] [--num-prompts 200] [--goodput ttft:2000 tpot:100] [--settle 15]
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

FIGURES = (("first SLO miss (req/s)", "first_slo_miss_rps"), ("goodput (req/s)", "request_goodput"),
           ("output tok/s", "output_throughput"))


def one_run(name: str, args: argparse.Namespace, ctx: systems.Context) -> dict[str, float]:
    """A fresh ``name`` server under the ramp: its figures (the first miss is the end rate when none missed)."""
    port = free_port()
    system = systems.BUILDERS[name](ctx, port)
    proc = subprocess.Popen(system.argv, env=systems.environment(system), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, cwd=systems.REPO)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, args.ready_timeout)
        time.sleep(args.settle)
        load = serve_args(f"http://127.0.0.1:{port}", args, 0, args.num_prompts, proc.pid, system, ctx)
        load.ramp_up_strategy, load.ramp_up_start_rps, load.ramp_up_end_rps = "linear", args.start_rps, args.end_rps
        load.goodput = args.goodput
        metrics = bench_serve.run(load)["runs"][0]["metrics"]
    finally:
        stop(proc)
    miss = metrics["first_slo_miss_rps"]
    return {key: args.end_rps if key == "first_slo_miss_rps" and miss is None else metrics[key] for _, key in FIGURES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=["pagellm", "vllm"], choices=["pagellm", "vllm", "llama.cpp"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--start-rps", type=float, default=0.5)
    parser.add_argument("--end-rps", type=float, default=8.0)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:100"], metavar="NAME:MS")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args()
    from pagellm.model.loader import default_model_path, hf_model_dir

    ctx = systems.Context(hf_model_dir(None), default_model_path(), args.dtype, args.threads, 64)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in args.systems}
    for round_ in range(args.rounds):
        order = args.systems if round_ % 2 == 0 else args.systems[::-1]  # which goes first alternates
        for name in order:
            runs[name].append(one_run(name, args, ctx))
            print(f"round {round_ + 1} {name}: " + ", ".join(f"{label} {runs[name][-1][key]:.2f}"
                                                             for label, key in FIGURES), flush=True)
    print(f"\nlinear ramp {args.start_rps:g} → {args.end_rps:g} req/s over {args.num_prompts} requests "
          f"{args.input_len}/{args.output_len}, SLOs {' '.join(args.goodput)}, {args.rounds} rounds (medians)")
    for label, key in FIGURES:
        medians = {name: statistics.median(r[key] for r in runs[name]) for name in args.systems}
        ratios = "".join(f"   pagellm / {name} {medians['pagellm'] / medians[name]:.2f}x" for name in args.systems
                         if name != "pagellm" and "pagellm" in medians and medians[name])
        print(f"{label:>24}: " + "   ".join(f"{name} {value:.2f}" for name, value in medians.items()) + ratios)


if __name__ == "__main__":
    main()
