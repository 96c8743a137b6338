"""Time from ``pagellm serve`` to ready (``/health`` and ``/v1/models`` answer 200), warm and cold.

Warm: the converted weights and built kernels already in the cache (``~/.cache/pagellm``; the first warm round
fills it if needed, and is not counted). Cold: a fresh, empty ``PAGELLM_CACHE_DIR`` each round, so the GGUF is
converted and every C++ kernel is built. Rounds alternate warm and cold; the server is stopped with SIGTERM after
each. Issue 4's targets: <= 10 s warm, <= 30 s cold.

    .venv/bin/python benchmarks/startup.py [--rounds 3] [--threads 2] [--model MODEL]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from compare import free_port, wait_ready  # noqa: E402
from peers import systems  # noqa: E402


def time_to_ready(args: argparse.Namespace, cache_dir: str | None) -> float:
    port = free_port()
    argv = [sys.executable, "-m", "pagellm.cli", "serve", *([args.model] if args.model else []), "--dtype",
            args.dtype, "--port", str(port), "--kv-cache-memory", str(systems.KV_GIB << 30), "--disable-log-stats"]
    env = {**os.environ, "PAGELLM_NUM_THREADS": str(args.threads)}
    if cache_dir is not None:
        env["PAGELLM_CACHE_DIR"] = cache_dir
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, cwd=systems.REPO)
    try:
        return wait_ready(f"http://127.0.0.1:{port}", proc, timeout=300)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default=None, help="default: the built-in model")
    args = parser.parse_args()
    time_to_ready(args, None)  # fills the default cache, so that warm rounds are warm
    warm, cold = [], []
    for _ in range(args.rounds):
        warm.append(time_to_ready(args, None))
        with tempfile.TemporaryDirectory() as cache_dir:
            cold.append(time_to_ready(args, cache_dir))
    for name, times in (("warm", warm), ("cold", cold)):
        print(f"{name}: median {statistics.median(times):.1f} s  (rounds: {', '.join(f'{t:.1f}' for t in times)})")


if __name__ == "__main__":
    main()
