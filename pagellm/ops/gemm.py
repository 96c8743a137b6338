"""``linear(x, weight, bias)``: ``F.linear`` with a native path for bfloat16 inputs of a few rows.

At batch sizes of a few rows (decode at low concurrency) a linear layer streams its whole weight matrix for very
little arithmetic, and ``F.linear`` there reaches only a fraction of the memory bandwidth. ``csrc/small_gemm.cpp``
streams the weights with AVX-512 BF16 dot products across torch's threads instead. It serves bfloat16, 2-D,
contiguous inputs of at most ``SMALL_M`` rows; everything else (and any machine where it does not build) takes
``F.linear``, which is also its test oracle. Results are float32-accumulated and rounded once to bfloat16, so they
differ from ``F.linear``'s only by bfloat16 rounding.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from pagellm.ops.build import cpu_flags, load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "small_gemm.cpp"
SMALL_M = 8  # rows up to which the kernel beats F.linear here (benchmarks/small_gemm.py measures the crossover)


@functools.lru_cache(maxsize=1)
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The native entry point, or ``None`` where it cannot run (no AVX-512 BF16, no compiler)."""
    if "avx512_bf16" not in cpu_flags().split():
        return None
    try:
        fn = load_library(SOURCE).pagellm_linear_bf16
    except (RuntimeError, OSError) as exc:
        logger.warning("small-M GEMM kernel unavailable (%s); using F.linear", exc)
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = None
    return fn


def available() -> bool:
    return _kernel() is not None


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The native kernel itself (callers check ``available()`` and the shape rules first)."""
    fn = _kernel()
    assert fn is not None, "small-M GEMM kernel is not available on this machine"
    m, k = x.shape
    y = torch.empty(m, weight.shape[0], dtype=torch.bfloat16)
    fn(x.data_ptr(), m, k, weight.data_ptr(), weight.shape[0], bias.data_ptr() if bias is not None else None,
       y.data_ptr())
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the native kernel when ``x`` is a few contiguous bfloat16 rows."""
    if x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= SMALL_M and _kernel() is not None \
            and x.is_contiguous() and weight.is_contiguous():
        return small_m_linear(x, weight, bias)
    return F.linear(x, weight, bias)
