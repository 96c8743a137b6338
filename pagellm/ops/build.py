"""Compile a C++ kernel source into a shared library once per machine kind and source version, and load it.

The kernels here use a plain C ABI (pointers and sizes, no torch headers), so a build takes about a second
instead of the ~20 s a ``torch.utils.cpp_extension`` build spends on torch's headers; that keeps a cold
``pagellm serve`` start short. Builds are cached by ``pagellm/native_build.py`` (keyed by the CPU's feature flags,
the compiler flags and the sources).

The libraries link ``libgomp.so.1``; torch is imported first (every caller imports it), so the dynamic linker
reuses torch's own OpenMP runtime and the kernels share torch's thread pool instead of starting a second one.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before any kernel library; see the module docstring)

from pagellm.native_build import build, built, cpu_flags  # noqa: F401  (cpu_flags: re-exported for the kernels)

CXX_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c++17"]
# The build an AVX2-only CPU (AMD Zen 2/3, older Intel) makes of the same sources: x86-64-v3 is AVX2 + FMA without
# AVX-512. The tests also build it on AVX-512 machines, so the AVX2 paths are checked whatever CPU runs them.
AVX2_CXX_FLAGS = ["-march=x86-64-v3" if flag == "-march=native" else flag for flag in CXX_FLAGS]
HEADERS = Path(__file__).parent / "csrc"  # shared headers (simd_exp.h), on every kernel's include path


def build_library(source: Path) -> Path:
    """The compiled library file for ``source`` (built now if this machine kind has no build of this version)."""
    return build(source, CXX_FLAGS, f"{source.stem}.so", [HEADERS])


def library_built(source: Path) -> bool:
    """Whether ``build_library(source)`` has no compile to wait for."""
    return built(source, CXX_FLAGS, f"{source.stem}.so", [HEADERS])


def build_avx2_library(source: Path) -> Path:
    """The library for ``source`` as an AVX2-only CPU builds it (``AVX2_CXX_FLAGS``), on any CPU that runs AVX2."""
    return build(source, AVX2_CXX_FLAGS, f"{source.stem}.so", [HEADERS])


def load_library(source: Path) -> ctypes.CDLL:
    """The compiled library for ``source``, loaded (``build_library``, then ``dlopen``)."""
    return ctypes.CDLL(str(build_library(source)))


def entry_address(fn: ctypes._CFuncPtr) -> int:  # type: ignore[name-defined]
    """The address of a loaded library's C entry point, for a kernel that calls another library's kernels."""
    return ctypes.cast(fn, ctypes.c_void_p).value  # type: ignore[return-value]
