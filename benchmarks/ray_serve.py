"""``pagellm ray-serve`` (one replica behind Ray Serve's proxy) against ``pagellm serve`` on the same model, workload
and CPUs: each started in turn (time to ready recorded), loaded with ``pagellm bench serve`` (random prompts,
streamed, a fixed concurrency), stopped; rounds alternated. Prints output tokens/s, TTFT p50/p95 and TPOT p50 of
each and the ratios: what Serve's proxy and router cost a replica.

    PAGELLM_NUM_THREADS=2 .venv/bin/python benchmarks/ray_serve.py [--model PATH] [--dtype bfloat16]
        [--num-prompts 128] [--concurrency 16] [--input-len 128] [--output-len 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import free_port, wait_ready  # noqa: E402  (the side-by-side harness's server helpers)

NAME = "SmolLM2-135M-Instruct"


def _start(system: str, port: int, model: list[str], dtype: str) -> subprocess.Popen:
    common = [*model, "--port", str(port), "--served-model-name", NAME, "--dtype", dtype, "--disable-log-stats"]
    if system == "serve":
        cmd = [sys.executable, "-m", "pagellm.cli", "serve", *common]
    else:  # one replica with every CPU, as the plain server has
        cmd = [sys.executable, "-m", "pagellm.cli", "ray-serve", *common, "--num-replicas", "1",
               "--replica-cpus", str(len(os.sched_getaffinity(0)))]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})


def _bench(port: int, args: argparse.Namespace, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "pagellm.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                    "--model", NAME, "--dataset", "random", "--num-prompts", str(args.num_prompts), "--input-len",
                    str(args.input_len), "--output-len", str(args.output_len), "--max-concurrency",
                    str(args.concurrency), "--ignore-eos", "--no-progress", "--result-json", str(out)],
                   check=True, capture_output=True)
    return json.loads(out.read_text())["runs"][0]["metrics"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    model = [args.model] if args.model else []
    results: dict[str, list[dict]] = {"serve": [], "ray-serve": []}
    for round_ in range(args.rounds):
        for system in results:
            port = free_port()
            proc = _start(system, port, model, args.dtype)
            try:
                ready = wait_ready(f"http://127.0.0.1:{port}", proc, 300)
                metrics = _bench(port, args, folder / f"{system}-{round_}.json")
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(120)
            results[system].append({**metrics, "ready_s": ready})
            print(f"round {round_ + 1} {system:9s} {metrics['output_throughput']:7.1f} out tok/s  TTFT p50 "
                  f"{metrics['p50_ttft_ms']:7.1f} p95 {metrics['p95_ttft_ms']:7.1f} ms  TPOT p50 "
                  f"{metrics['p50_tpot_ms']:6.2f} ms  ready in {ready:5.1f} s  failed {metrics['failed']}", flush=True)
    for key, label in (("output_throughput", "output tok/s"), ("p95_ttft_ms", "TTFT p95"), ("p50_tpot_ms", "TPOT p50")):
        ours = sum(r[key] for r in results["ray-serve"]) / args.rounds
        base = sum(r[key] for r in results["serve"]) / args.rounds
        print(f"ray-serve / serve {label}: {ours / base:.2f}x (means of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
