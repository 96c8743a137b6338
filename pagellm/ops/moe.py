"""A mixture-of-experts layer's routed experts in one native call (``csrc/moe.cpp``).

The library calls the packed GEMM (``gemm.py``, or the int8 one of ``gemm_w8a8.py``) and the fused SiLU·mul
(``fused.py``) through the addresses of their C entry points, in exactly the sequence of the Python loop of
``model/layers/moe.py`` (``SparseMoeBlock.routed``), so its output equals that loop's bit for bit; the loop is its
plain-PyTorch twin and test oracle. ``Experts`` holds one layer's weight addresses (made once) and takes per call
the hidden states and the routing the caller sorted by expert. ``available()`` says whether the library runs here.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagellm.ops import fused, gemm, gemm_w8a8
from pagellm.ops.build import load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "moe.cpp"
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Kernels(ctypes.Structure):  # csrc MoeKernels
    _fields_ = [(name, _P) for name in ("linear", "silu_and_mul", "linear_silu_mul")]


@functools.lru_cache(maxsize=None)
def _kernels(weight_format: str) -> _Kernels:
    gemm_lib, fused_lib = gemm._lib(), fused._lib()
    assert gemm_lib is not None and fused_lib is not None
    silu = ctypes.cast(fused_lib.pagellm_silu_and_mul_bf16, ctypes.c_void_p).value
    if weight_format == gemm_w8a8.FORMAT:
        linear, linear_silu_mul = gemm_w8a8.entry_addresses()
        return _Kernels(linear, silu, linear_silu_mul)
    return _Kernels(ctypes.cast(gemm_lib.pagellm_packed_linear_bf16, ctypes.c_void_p).value, silu,
                    ctypes.cast(gemm_lib.pagellm_packed_linear_silu_mul_bf16, ctypes.c_void_p).value)


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    if gemm._lib() is None or fused._lib() is None:
        return None
    try:
        lib = load_library(SOURCE)
    except (RuntimeError, OSError) as exc:
        logger.warning("native mixture-of-experts kernel unavailable (%s); using the Python loop", exc)
        return None
    lib.pagellm_moe_experts_bf16.argtypes = [ctypes.POINTER(_Kernels), _P, _P, _I, _I, _I, _P, _I, _I, _P, _P, _P,
                                             _P]
    lib.pagellm_moe_experts_bf16.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _lib() is not None


class Experts:
    """One layer's experts bound to the native call: ``gate_up[e]`` packed ``[2·inter, hidden]`` and ``down[e]``
    packed ``[hidden, inter]``, all of one format (``gemm.weight_format``: ``bf16`` or ``w8a8_int8``)."""

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor]) -> None:
        loaded = _lib()
        assert loaded is not None, "native mixture-of-experts kernel is not available on this machine"
        formats = {gemm.weight_format(w) for w in (*gate_up, *down)}
        if len(formats) != 1 or None in formats:
            raise ValueError("the native experts take packed weights, all of one format")
        self.weight_format = formats.pop()
        self.hidden, self.inter = gemm.packed_shape(down[0])  # type: ignore[misc]
        self._fn, self._kernels = loaded.pagellm_moe_experts_bf16, ctypes.byref(_kernels(self.weight_format))
        self._keep = [*gate_up, *down]
        self._gate_up = (ctypes.c_void_p * len(gate_up))(*(w.data_ptr() for w in gate_up))
        self._down = (ctypes.c_void_p * len(down))(*(w.data_ptr() for w in down))
        self.num_experts = len(gate_up)

    def __call__(self, x: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        """``out[t] = Σ scale · expert(x[t])`` over the pairs of token ``t``: bfloat16 ``x`` [tokens, hidden] (unit
        column stride); int64 ``rows`` and float32 ``scales`` grouped by expert, ``counts`` [experts] int64 of them
        each."""
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == self.hidden
        assert rows.dtype == counts.dtype == torch.int64 and scales.dtype == torch.float32
        assert rows.is_contiguous() and scales.is_contiguous() and counts.is_contiguous()
        assert counts.shape[0] == self.num_experts and rows.shape == scales.shape == (int(counts.sum()),)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if self._fn(self._kernels, self._gate_up, self._down, self.num_experts, self.hidden, self.inter,
                    x.data_ptr(), x.shape[0], x.stride(0), rows.data_ptr(), scales.data_ptr(), counts.data_ptr(),
                    out.data_ptr()):
            raise IndexError(f"expert rows must name tokens in [0, {x.shape[0]})")
        return out
