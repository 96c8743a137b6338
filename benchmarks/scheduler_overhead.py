"""Scheduler overhead per step: pagellm's ``schedule()`` + ``update_from_output()`` with a fake model output, at 64,
256 and 1024 running requests, and vLLM's own v1 scheduler on the same synthetic trace when .peers/vllm exists.

The trace (benchmarks/peers/sched_trace.py): shared block-aligned prefixes (prefix caching on) + unique suffixes,
staggered output lengths, the system kept at N requests, a 2048-token budget: each step mixes decodes with
prefill chunks. The two scheduler calls are timed per step (building the fake output is not). The step's
arrivals (building each ``Request`` and ``add_request``) are timed apart and reported as µs per step: that is
where both engines hash a prompt's blocks (vLLM's ``Request`` hashes them when built, pagellm's ``add_request``),
so the step columns compare the same work and the arrivals column shows the hashing on each side.
vLLM's scheduler runs in a subprocess with the .peers/vllm interpreter (benchmarks/peers/vllm_scheduler_bench.py).

    .venv/bin/python benchmarks/scheduler_overhead.py [--num-running 64 256 1024] [--steps 300] [--json FILE]
        [--vllm-python .peers/vllm/bin/python]   # vLLM's interpreter (from a worktree: the main checkout's)
        [--profile [N]]   # cProfile the timed calls (pagellm only), print the N costliest functions
        [--baseline-rev REV]   # pagellm as of git revision REV beside this tree's, in one process (below)

``--baseline-rev REV`` answers "did my change make the scheduler faster?" on a noisy machine: the ``pagellm``
package as of REV is exported (``git archive``) under the name ``pagellm_base`` (its imports renamed, its native
fast path built from its own source) and both schedulers replay the same trace in one process, one step each in
turn (which goes first alternates), so both see the same spells of the machine. It prints each one's figures and
the ratio of their medians; vLLM is not run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import json
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "peers"), str(HERE.parent)]
import sched_trace as trace  # noqa: E402

from pagellm.config import CacheConfig, SchedulerConfig  # noqa: E402
from pagellm.request import Request  # noqa: E402
from pagellm.sampling_params import SamplingParams  # noqa: E402
from pagellm.sched.output import ModelRunnerOutput  # noqa: E402
from pagellm.sched.scheduler import Scheduler  # noqa: E402

VLLM_PYTHON = HERE.parent / ".peers" / "vllm" / "bin" / "python"


def fake_output(scheduler: Scheduler, sched_out) -> ModelRunnerOutput:
    """One token for each request whose step reaches its last token, none for a prompt chunk (the runner's rule)."""
    before = sched_out.cached_reqs.num_computed_tokens + [r.num_computed_tokens for r in sched_out.new_reqs]
    counts = [int(start + n >= scheduler.requests[rid].num_tokens)
              for rid, start, n in zip(sched_out.req_ids, before, sched_out.num_scheduled_tokens)]
    return ModelRunnerOutput(list(sched_out.req_ids), counts, [trace.SAMPLED_TOKEN] * sum(counts))


def run_pagellm(num_running: int, warmup: int, steps: int, profiler: cProfile.Profile | None = None) -> dict:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=trace.TOKEN_BUDGET),
                          CacheConfig(block_size=trace.BLOCK_SIZE, enable_prefix_caching=True),
                          trace.num_blocks(num_running), max_model_len=2048)
    next_id, times, adds, running, tokens = 0, [], [], [], []
    gc.collect()
    for step in range(warmup + steps):
        add_time = 0.0
        while scheduler.num_unfinished_requests < num_running:
            prompt = trace.prompt(next_id)
            t = time.perf_counter()
            params = SamplingParams(max_tokens=trace.output_len(next_id), ignore_eos=True)
            scheduler.add_request(Request(f"r{next_id}", prompt, params, arrival_time=time.time()))
            add_time += time.perf_counter() - t
            next_id += 1
        profiling = profiler is not None and step >= warmup
        if profiling:
            profiler.enable()
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        if profiling:
            profiler.disable()
        runner_out = fake_output(scheduler, out)
        if profiling:
            profiler.enable()
        t2 = time.perf_counter()
        scheduler.update_from_output(out, runner_out)
        t3 = time.perf_counter()
        if profiling:
            profiler.disable()
        if step >= warmup:
            times.append((t1 - t0) + (t3 - t2))
            adds.append(add_time)
            running.append(len(out.req_ids))
            tokens.append(out.total_num_scheduled_tokens)
    us = sorted(t * 1e6 for t in times)
    return {"system": "pagellm", "num_running": num_running, "steps": steps, "mean_us": statistics.mean(us),
            "p50_us": us[len(us) // 2], "p95_us": us[int(len(us) * 0.95)],
            "arrivals_us_per_step": statistics.mean(adds) * 1e6,
            "mean_scheduled_reqs": statistics.mean(running), "mean_scheduled_tokens": statistics.mean(tokens),
            "requests_started": next_id}


def package_at(rev: str) -> str:
    """Export ``pagellm/`` as of git revision ``rev`` as the package ``pagellm_base`` (on sys.path); its name."""
    root = Path(tempfile.mkdtemp(prefix="pagellm_base_"))
    archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", rev, "pagellm"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    package = root / "pagellm"
    for path in package.rglob("*.py"):
        text = re.sub(r"\b(from|import) pagellm\b", r"\1 pagellm_base", path.read_text())
        path.write_text(text)
    package.rename(root / "pagellm_base")
    sys.path.insert(0, str(root))
    return "pagellm_base"


def _side(package: str, num_running: int) -> SimpleNamespace:
    """A scheduler of ``package`` (``pagellm`` or an exported ``pagellm_base``) set up for the trace."""
    def load(name: str):
        return importlib.import_module(f"{package}.{name}")

    config = load("config")
    scheduler = load("sched.scheduler").Scheduler(
        config.SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=trace.TOKEN_BUDGET),
        config.CacheConfig(block_size=trace.BLOCK_SIZE, enable_prefix_caching=True), trace.num_blocks(num_running),
        max_model_len=2048)
    return SimpleNamespace(scheduler=scheduler, request=load("request").Request,
                           params=load("sampling_params").SamplingParams,
                           output=load("sched.output").ModelRunnerOutput, next_id=0, times=[])


def run_pair(num_running: int, warmup: int, steps: int, base: str) -> list[dict]:
    """This tree's scheduler and ``base``'s on the same trace in one process, a step of each in turn."""
    sides = [_side("pagellm", num_running), _side(base, num_running)]
    gc.collect()
    for step in range(warmup + steps):
        for side in (sides if step % 2 == 0 else sides[::-1]):
            scheduler = side.scheduler
            while scheduler.num_unfinished_requests < num_running:
                i = side.next_id
                params = side.params(max_tokens=trace.output_len(i), ignore_eos=True)
                scheduler.add_request(side.request(f"r{i}", trace.prompt(i), params, arrival_time=time.time()))
                side.next_id += 1
            t0 = time.perf_counter()
            out = scheduler.schedule()
            t1 = time.perf_counter()
            before = out.cached_reqs.num_computed_tokens + [r.num_computed_tokens for r in out.new_reqs]
            counts = [int(start + n >= scheduler.requests[rid].num_tokens)
                      for rid, start, n in zip(out.req_ids, before, out.num_scheduled_tokens)]
            runner_out = side.output(list(out.req_ids), counts, [trace.SAMPLED_TOKEN] * sum(counts))
            t2 = time.perf_counter()
            scheduler.update_from_output(out, runner_out)
            t3 = time.perf_counter()
            if step >= warmup:
                side.times.append((t1 - t0) + (t3 - t2))
    results = []
    for name, side in zip(("this tree", "baseline"), sides):
        us = sorted(t * 1e6 for t in side.times)
        results.append({"system": name, "num_running": num_running, "mean_us": statistics.mean(us),
                        "p50_us": us[len(us) // 2], "p95_us": us[int(len(us) * 0.95)]})
    return results


def run_vllm(python: Path, sizes: list[int], warmup: int, steps: int) -> list[dict]:
    from pagellm.model.loader import resolve_model_dir

    cmd = [str(python), str(HERE / "peers" / "vllm_scheduler_bench.py"), str(resolve_model_dir(None)),
           "--num-running", *map(str, sizes), "--warmup", str(warmup), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM scheduler benchmark failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--no-vllm", action="store_true", help="pagellm only")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON,
                        help="the interpreter of vLLM's virtual env (default: this checkout's .peers/vllm)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--profile", type=int, nargs="?", const=25, default=None, metavar="N",
                        help="cProfile pagellm's timed calls and print the N costliest functions (implies --no-vllm;"
                             " the timings then include the profiler's overhead)")
    parser.add_argument("--baseline-rev", default=None, metavar="REV",
                        help="time pagellm as of this git revision beside this tree's, steps alternated in one "
                             "process (implies --no-vllm)")
    args = parser.parse_args()
    if args.baseline_rev:
        base = package_at(args.baseline_rev)
        print(f"{'running':>7} {'this tree p50':>13} {'mean':>8} {'p95':>8} {args.baseline_rev[:12] + ' p50':>17} "
              f"{'mean':>8} {'p95':>8} {'p50 ratio':>9}   (µs per step)")
        for n in args.num_running:
            ours, theirs = run_pair(n, args.warmup, args.steps, base)
            print(f"{n:>7} {ours['p50_us']:>13.1f} {ours['mean_us']:>8.1f} {ours['p95_us']:>8.1f} "
                  f"{theirs['p50_us']:>17.1f} {theirs['mean_us']:>8.1f} {theirs['p95_us']:>8.1f} "
                  f"{ours['p50_us'] / theirs['p50_us']:>9.3f}")
        return
    if args.profile is not None:
        for n in args.num_running:
            profiler = cProfile.Profile()
            run_pagellm(n, args.warmup, args.steps, profiler)
            print(f"--- {n} running: {args.steps} steps, sorted by own time")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        return
    ours = [run_pagellm(n, args.warmup, args.steps) for n in args.num_running]
    theirs: list[dict] = []
    if not args.no_vllm and args.vllm_python.exists():
        theirs = run_vllm(args.vllm_python, args.num_running, args.warmup, args.steps)
    elif not args.no_vllm:
        print(f"vLLM not installed ({args.vllm_python} missing; `make peers`): pagellm only")
    print_table(ours, theirs)
    if args.json:
        Path(args.json).write_text(json.dumps(ours + theirs, indent=1))


def print_table(ours: list[dict], theirs: list[dict]) -> None:
    print(f"{'running':>7} {'pagellm mean':>12} {'p50':>8} {'p95':>8} {'arrivals':>8} {'vLLM mean':>10} {'p50':>8} "
          f"{'p95':>8} {'arrivals':>8} {'ratio (p50)':>11} {'tokens/step':>11}   (µs per step)")
    for mine in ours:
        other = next((t for t in theirs if t["num_running"] == mine["num_running"]), None)
        vllm_cols = (f"{other['mean_us']:>10.0f} {other['p50_us']:>8.0f} {other['p95_us']:>8.0f} "
                     f"{other['arrivals_us_per_step']:>8.1f} {mine['p50_us'] / other['p50_us']:>11.3f}") if other \
            else f"{'–':>10} {'':>8} {'':>8} {'':>8} {'':>11}"
        print(f"{mine['num_running']:>7} {mine['mean_us']:>12.0f} {mine['p50_us']:>8.0f} {mine['p95_us']:>8.0f} "
              f"{mine['arrivals_us_per_step']:>8.1f} {vllm_cols} {mine['mean_scheduled_tokens']:>11.0f}")


if __name__ == "__main__":
    main()
