"""Time from ``pagellm serve`` to ready (``/health`` and ``/v1/models`` answer 200), warm and cold.

Warm: the converted weights and built kernels already in the cache (``~/.cache/pagellm``; the first warm round
fills it if needed, and is not counted). Cold: a fresh, empty ``PAGELLM_CACHE_DIR`` each round, so the GGUF is
converted and every C++ kernel is built. Rounds alternate warm and cold; the server is stopped with SIGTERM after
each. Issue 4's targets: <= 10 s warm, <= 30 s cold. A cold round also reports the size of the model's conversion
(a GGUF's converted directory). ``--kernels-built`` copies this machine's kernel builds into each cold round's cache,
so a cold round times the model's conversion without the compiles.

    .venv/bin/python benchmarks/startup.py [--rounds 3] [--threads 2] [--model MODEL] [--baseline-rev REV]

``--baseline-rev REV`` also starts ``pagellm`` as of git revision REV (``git archive`` of ``pagellm/`` into a
temporary folder, run from there), alternating with this tree round by round (which goes first alternates), and
prints each one's medians and their ratio: a start-up change measured against its base in the same spells. Its
warm rounds keep their own cache (this machine's kernel builds copied in), so that neither tree's conversion is
removed as stale by the other's (a converter change) and a warm round never converts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from compare import free_port, wait_ready  # noqa: E402
from peers import systems  # noqa: E402

from pagellm import envs  # noqa: E402


def time_to_ready(args: argparse.Namespace, cache_dir: str | None, tree: Path = systems.REPO) -> float:
    """Seconds from ``pagellm serve`` (the package under ``tree``) to ready."""
    port = free_port()
    argv = [sys.executable, "-m", "pagellm.cli", "serve", *([args.model] if args.model else []), "--dtype",
            args.dtype, "--port", str(port), "--kv-cache-memory", str(systems.KV_GIB << 30), "--disable-log-stats"]
    env = {**os.environ, "PAGELLM_NUM_THREADS": str(args.threads)}
    if cache_dir is not None:
        env["PAGELLM_CACHE_DIR"] = cache_dir
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, cwd=tree)
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
    parser.add_argument("--baseline-rev", default=None, help="also start pagellm as of this git revision")
    parser.add_argument("--kernels-built", action="store_true",
                        help="cold rounds start with this machine's kernel builds (the conversion is all they do)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as exported, tempfile.TemporaryDirectory() as baseline_cache:
        trees = {"this tree": systems.REPO}
        warm_caches: dict[str, str | None] = {"this tree": None}  # None: the default cache
        if args.baseline_rev:
            trees[args.baseline_rev] = export(args.baseline_rev, Path(exported))
            warm_caches[args.baseline_rev] = baseline_cache
            shutil.copytree(envs.cache_dir() / "kernels", Path(baseline_cache) / "kernels")
        times = {(name, kind): [] for name in trees for kind in ("warm", "cold")}
        converted: dict[str, int] = {}  # the cold rounds' converted model directory (a GGUF's), in bytes
        for name, tree in trees.items():
            time_to_ready(args, warm_caches[name], tree)  # fills the tree's cache, so that warm rounds are warm
        for round_ in range(args.rounds):
            for name, tree in (list(trees.items()) if round_ % 2 == 0 else list(trees.items())[::-1]):
                times[name, "warm"].append(time_to_ready(args, warm_caches[name], tree))
                with tempfile.TemporaryDirectory() as cache_dir:
                    if args.kernels_built:  # the conversion alone: this machine's kernel builds copied in
                        shutil.copytree(envs.cache_dir() / "kernels", Path(cache_dir) / "kernels")
                    times[name, "cold"].append(time_to_ready(args, cache_dir, tree))
                    converted[name] = sum(f.stat().st_size for f in Path(cache_dir, "converted").rglob("*")
                                          if f.is_file())
    for kind in ("warm", "cold"):
        for name in trees:
            runs = times[name, kind]
            label = f"{kind}" if len(trees) == 1 else f"{kind} ({name})"
            print(f"{label}: median {statistics.median(runs):.1f} s  (rounds: {', '.join(f'{t:.1f}' for t in runs)})")
        if args.baseline_rev:
            ratio = statistics.median(times["this tree", kind]) / statistics.median(times[args.baseline_rev, kind])
            print(f"{kind}: this tree / {args.baseline_rev} = {ratio:.2f}")
    for name, size in converted.items():
        print(f"converted model on disk{'' if len(trees) == 1 else f' ({name})'}: {size / 1e9:.2f} GB")


def export(rev: str, root: Path) -> Path:
    """``pagellm/`` as of git revision ``rev``, extracted under ``root`` (which is then the tree to run from)."""
    archive = subprocess.run(["git", "-C", str(systems.REPO), "archive", rev, "pagellm"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


if __name__ == "__main__":
    main()
