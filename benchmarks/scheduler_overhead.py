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
        [--kv-events]   # this tree's with KV cache events recorded and encoded beside it without, likewise
        [--prefix-caching-hash-algo ALGO]   # and with vLLM's block hashes (kv/hash_algos.py), likewise

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

import msgspec

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "peers"), str(HERE.parent)]
import sched_trace as trace  # noqa: E402

VLLM_PYTHON = HERE.parent / ".peers" / "vllm" / "bin" / "python"


class Side:
    """One scheduler of ``package`` (this tree's ``pagellm``, or an exported ``pagellm_base``) on the trace."""

    def __init__(self, package: str, num_running: int, kv_events: bool = False, hash_algo: str | None = None) -> None:
        """``kv_events``: record KV cache events, taken and encoded to msgpack in each timed step, as the engine
        core does before publishing them; ``hash_algo``: hash blocks as vLLM does (``prefix_caching_hash_algo``)."""
        def load(name: str):
            return importlib.import_module(f"{package}.{name}")

        config = load("config")
        self.events = load("kv.events").KVEventRecorder(trace.BLOCK_SIZE) if kv_events else None
        self.encoder = msgspec.msgpack.Encoder()
        self.scheduler = load("sched.scheduler").Scheduler(
            config.SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=trace.TOKEN_BUDGET),
            config.CacheConfig(block_size=trace.BLOCK_SIZE, enable_prefix_caching=True,
                               **({"prefix_caching_hash_algo": hash_algo} if hash_algo else {})),
            trace.num_blocks(num_running), max_model_len=2048, **({"kv_events": self.events} if kv_events else {}))
        self.request, self.params = load("request").Request, load("sampling_params").SamplingParams
        self.output = load("sched.output").ModelRunnerOutput
        self.num_running, self.next_id = num_running, 0
        self.times: list[float] = []

    def fake_output(self, sched_out):
        """One token for each request whose step reaches its last token, none for a prompt chunk (the runner's
        rule)."""
        before = sched_out.cached_reqs.num_computed_tokens + [r.num_computed_tokens for r in sched_out.new_reqs]
        counts = [int(start + n >= self.scheduler.requests[rid].num_tokens)
                  for rid, start, n in zip(sched_out.req_ids, before, sched_out.num_scheduled_tokens)]
        return self.output(list(sched_out.req_ids), counts, [trace.SAMPLED_TOKEN] * sum(counts))

    def step(self, profiler: cProfile.Profile | None = None):
        """Top the system up to ``num_running`` requests, then one step; returns (seconds in the two scheduler
        calls, seconds of arrivals, the step's SchedulerOutput). ``profiler`` sees the two calls only."""
        scheduler, add_time = self.scheduler, 0.0
        while scheduler.num_unfinished_requests < self.num_running:
            prompt, i = trace.prompt(self.next_id), self.next_id
            t = time.perf_counter()
            params = self.params(max_tokens=trace.output_len(i), ignore_eos=True)
            scheduler.add_request(self.request(f"r{i}", prompt, params, arrival_time=time.time()))
            add_time += time.perf_counter() - t
            self.next_id += 1
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        runner_out = self.fake_output(out)
        if profiler is not None:
            profiler.enable()
        t2 = time.perf_counter()
        scheduler.update_from_output(out, runner_out)
        if self.events is not None:
            batch = self.events.take()
            if batch is not None:
                self.encoder.encode(batch)
        t3 = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        return (t1 - t0) + (t3 - t2), add_time, out


def _percentiles(times: list[float]) -> dict:
    us = sorted(t * 1e6 for t in times)
    return {"mean_us": statistics.mean(us), "p50_us": us[len(us) // 2], "p95_us": us[int(len(us) * 0.95)]}


def run_pagellm(num_running: int, warmup: int, steps: int, profiler: cProfile.Profile | None = None) -> dict:
    side = Side("pagellm", num_running)
    times, adds, running, tokens = [], [], [], []
    gc.collect()
    for step in range(warmup + steps):
        took, add_time, out = side.step(profiler if step >= warmup else None)
        if step >= warmup:
            times.append(took)
            adds.append(add_time)
            running.append(len(out.req_ids))
            tokens.append(out.total_num_scheduled_tokens)
    return {"system": "pagellm", "num_running": num_running, "steps": steps, **_percentiles(times),
            "arrivals_us_per_step": statistics.mean(adds) * 1e6,
            "mean_scheduled_reqs": statistics.mean(running), "mean_scheduled_tokens": statistics.mean(tokens),
            "requests_started": side.next_id}


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
    for path in package.rglob("*.cpp"):  # a build of its own even where the source equals this tree's: CPython
        with path.open("a") as source:   # shares one extension file's static state between its loads
            source.write("\n// the pagellm_base copy of benchmarks/scheduler_overhead.py --baseline-rev\n")
    package.rename(root / "pagellm_base")
    sys.path.insert(0, str(root))
    return "pagellm_base"


def run_pair(num_running: int, warmup: int, steps: int, base: str, kv_events: bool = False,
             hash_algo: str | None = None) -> tuple[dict, dict]:
    """This tree's scheduler and ``base``'s on the same trace in one process, a step of each in turn (which one
    goes first alternates); ``kv_events`` / ``hash_algo``: ``base`` is this tree's too, recording KV cache events /
    hashing blocks as vLLM does. Each side's figures include its arrivals' µs per step (where prompts hash)."""
    sides = [Side("pagellm", num_running), Side(base, num_running, kv_events, hash_algo)]
    adds: list[list[float]] = [[], []]
    gc.collect()
    for step in range(warmup + steps):
        for side in (sides if step % 2 == 0 else sides[::-1]):
            took, add_time, _ = side.step()
            if step >= warmup:
                side.times.append(took)
                adds[sides.index(side)].append(add_time)
    ours, theirs = ({**_percentiles(side.times), "arrivals_us": statistics.mean(added) * 1e6}
                    for side, added in zip(sides, adds))
    return ours, theirs


def run_vllm(python: Path, sizes: list[int], warmup: int, steps: int) -> list[dict]:
    from pagellm.model.loader import hf_model_dir

    cmd = [str(python), str(HERE / "peers" / "vllm_scheduler_bench.py"), str(hf_model_dir(None)),
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
    parser.add_argument("--kv-events", action="store_true",
                        help="time this tree's scheduler with KV cache events recorded (and encoded) beside it without "
                             "them, steps alternated in one process (implies --no-vllm)")
    parser.add_argument("--prefix-caching-hash-algo", default=None, metavar="ALGO",
                        help="likewise with blocks hashed as vLLM does (sha256, sha256_cbor, xxhash, xxhash_cbor); "
                             "with --kv-events, events recorded too")
    args = parser.parse_args()
    if args.baseline_rev or args.kv_events or args.prefix_caching_hash_algo:
        return print_pairs(args)
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


def print_pairs(args: argparse.Namespace) -> None:
    base = package_at(args.baseline_rev) if args.baseline_rev else "pagellm"
    algo = args.prefix_caching_hash_algo
    label = args.baseline_rev[:12] if args.baseline_rev else " + ".join(
        (["kv events"] if args.kv_events else []) + ([algo] if algo else []))
    print(f"{'running':>7} {'this tree p50':>13} {'mean':>8} {'p95':>8} {'arrivals':>8} {label + ' p50':>17} "
          f"{'mean':>8} {'p95':>8} {'arrivals':>8} {'p50 ratio':>9}   (µs per step)")
    for n in args.num_running:
        ours, theirs = run_pair(n, args.warmup, args.steps, base, args.kv_events, algo)
        print(f"{n:>7} {ours['p50_us']:>13.1f} {ours['mean_us']:>8.1f} {ours['p95_us']:>8.1f} "
              f"{ours['arrivals_us']:>8.1f} {theirs['p50_us']:>17.1f} {theirs['mean_us']:>8.1f} "
              f"{theirs['p95_us']:>8.1f} {theirs['arrivals_us']:>8.1f} {ours['p50_us'] / theirs['p50_us']:>9.3f}")


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
