"""A fresh ``pagellm serve`` with its idle-time KV-cache prefault (the default) against one started with
``--no-kv-cache-prefault``, alternating round by round on the same workload (``pagellm bench serve``, random prompts,
EOS ignored), so both see the same spells of the machine. Each server idles ``--settle`` seconds after it is ready
(a deployed server idles before its traffic; with 0 the load starts at once and the prefault has had only the core's
idle moments of start-up). Prints each round, each side's medians and the ratios (flags_ab.py with these two sides).

    .venv/bin/python benchmarks/kv_prefault.py [--rounds 3] [--settle 15] [--concurrency 32] [--num-prompts 200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from flags_ab import add_workload_args, run_ab  # noqa: E402

SIDES = {"prefault": [], "first use": ["--no-kv-cache-prefault"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    run_ab(parser.parse_args(), SIDES, ["serve"])


if __name__ == "__main__":
    main()
