"""The kernel suites' build fixture: the kernels as this machine builds them, and their AVX2-only build."""

from __future__ import annotations

import pytest

from pagellm.ops import build


@pytest.fixture(params=["native", "avx2"])
def kernel_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kernels as this machine builds them (``-march=native``), and, where that build is AVX-512, the AVX2-only
    build swapped in, so the AVX2 paths are checked on every CPU that can run them. The test module names the swap:
    ``AVX2_BUILD = (module, attribute, the loader of the AVX2 build)``."""
    if request.param == "avx2":
        flags = set(build.cpu_flags().split())
        if "avx512f" not in flags or not {"avx2", "fma"} <= flags:
            pytest.skip("this machine's own build is the AVX2 one (native), or the CPU has no AVX2 + FMA")
        monkeypatch.setattr(*request.module.AVX2_BUILD)
    return request.param
