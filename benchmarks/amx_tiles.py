"""What one core's AMX unit reaches here, by where the tile operands come from, and the packed GEMM's own structure
on two threads: the ceilings ``pagellm/ops/csrc/packed_gemm_amx.h`` is measured against (docs/performance.md,
Round 11). Compiles ``benchmarks/amx_tiles.cpp`` with the machine's C++ compiler into a temporary folder and runs it;
says so and stops on a CPU without AMX-BF16.

    .venv/bin/python benchmarks/amx_tiles.py [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_suffix(".cpp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="threads of the kernel-structure cases")
    args = parser.parse_args()
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if "amx_bf16" not in flags:
        print("this CPU has no AMX-BF16: nothing to measure")
        return
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "amx_tiles"
        subprocess.run(["c++", "-O2", "-march=native", "-fopenmp", str(SOURCE), "-o", str(binary)], check=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        sys.exit(subprocess.run([str(binary)], env=env).returncode)


if __name__ == "__main__":
    main()
