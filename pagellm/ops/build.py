"""Compile a C++ kernel source into a shared library once per machine kind and source version, and load it.

The kernels here use a plain C ABI (pointers and sizes, no torch headers), so a build takes about a second
instead of the ~20 s a ``torch.utils.cpp_extension`` build spends on torch's headers; that keeps a cold
``pagellm serve`` start short. Builds live under ``envs.cache_dir()/kernels/<tag>/`` where the tag hashes the
CPU's feature flags (``-march=native`` code only runs on this CPU kind), the compiler flags and the source. A build
is written to a temporary name and renamed into place, so concurrent processes never load a half-written file.

The libraries link ``libgomp.so.1``; torch is imported first (every caller imports it), so the dynamic linker
reuses torch's own OpenMP runtime and the kernels share torch's thread pool instead of starting a second one.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before any kernel library; see the module docstring)

from pagellm import envs

logger = logging.getLogger(__name__)

CXX_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c++17"]


def cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.machine()


HEADERS = Path(__file__).parent / "csrc"  # shared headers (simd_exp.h), on every kernel's include path


def build_tag(source: Path) -> str:
    """A short digest of the CPU flags, the compiler flags, the source, the shared headers and the headers next to
    the source, to key builds by."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted({*HEADERS.glob("*.h"), *source.parent.glob("*.h")}):
        digest.update(header.read_bytes())
    return hashlib.sha256(f"{cpu_flags()}|{' '.join(CXX_FLAGS)}|{digest.hexdigest()}".encode()).hexdigest()[:12]


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    return cxx


def load_library(source: Path) -> ctypes.CDLL:
    """The compiled library for ``source`` (built now if this machine kind has no build of this version)."""
    out_dir = envs.cache_dir() / "kernels" / build_tag(source)
    target = out_dir / f"{source.stem}.so"
    if not target.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".so.tmp", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            subprocess.run([compiler(), *CXX_FLAGS, f"-I{HEADERS}", str(source), "-o", str(partial)], check=True,
                           capture_output=True, text=True)
            os.replace(partial, target)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"building {source.name} failed:\n{exc.stderr[-2000:]}") from exc
        finally:
            partial.unlink(missing_ok=True)
        logger.info("built %s in %.1fs", target, time.perf_counter() - start)
    return ctypes.CDLL(str(target))
