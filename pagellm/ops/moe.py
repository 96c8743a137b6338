"""A mixture-of-experts layer in one native call (``csrc/moe.cpp``): router, routing and experts.

The library calls the packed GEMM (``gemm.py``, or a quantized one of ``gemm.QUANTIZED`` for the experts) and the fused
SiLU·mul (``fused.py``) through the addresses of their C entry points. Given a routing, its experts' part makes
exactly the sequence of the Python loop of ``model/layers/moe.py`` (``SparseMoeBlock.routed_torch``), so it equals
that loop bit for bit (``Experts.__call__``); its routing equals torch's softmax and top-k up to the softmax's last
bits (``route``; the twin is ``model/layers/moe.py``'s). ``Experts.forward`` runs the whole layer, and its
``address`` is what the native decoder stack calls for the layer (``decoder_stack.py``), so the two paths agree bit
for bit. ``available()`` says whether the library runs here.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pagellm.ops import fused, gemm
from pagellm.ops.build import entry_address as _address
from pagellm.ops.build import load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "moe.cpp"
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Kernels(ctypes.Structure):  # csrc MoeKernels
    _fields_ = [(name, _P) for name in ("linear", "silu_and_mul", "linear_silu_mul", "router_linear",
                                        "clamped_swiglu")]


class _Layer(ctypes.Structure):  # csrc MoeLayer
    _fields_ = [(name, _P) for name in ("kernels", "router", "gate_up", "down")]
    _fields_ += [(name, _I) for name in ("experts", "top_k", "hidden", "inter", "renormalize",
                                         "weights_in_model_dtype")]
    _fields_ += [(name, _P) for name in ("shared_gate_up", "shared_down", "shared_gate")] + [("shared_inter", _I)]
    _fields_ += [(name, _P) for name in ("router_bias", "gate_up_bias", "down_bias")] + [("softmax_top_k", _I)]
    _fields_ += [("swiglu_limit", ctypes.c_float), ("swiglu_alpha", ctypes.c_float)]


@functools.lru_cache(maxsize=None)
def _kernels(weight_format: str) -> _Kernels:
    gemm_lib, fused_lib = gemm._lib(), fused._lib()
    assert gemm_lib is not None and fused_lib is not None
    silu, bf16_linear = _address(fused_lib.pagellm_silu_and_mul_bf16), _address(gemm_lib.pagellm_packed_linear_bf16)
    clamped = _address(fused_lib.pagellm_clamped_swiglu_bf16)
    if weight_format in gemm.QUANTIZED:
        linear, linear_silu_mul = gemm.QUANTIZED[weight_format].entry_addresses()
        return _Kernels(linear, silu, linear_silu_mul, bf16_linear, clamped)
    return _Kernels(bf16_linear, silu, _address(gemm_lib.pagellm_packed_linear_silu_mul_bf16), bf16_linear, clamped)


def forward_entry() -> int:
    """The address of ``pagellm_moe_forward_bf16`` (the native decoder stack calls it for a layer's experts)."""
    loaded = _lib()
    assert loaded is not None, "native mixture-of-experts kernel is not available on this machine"
    return _address(loaded.pagellm_moe_forward_bf16)


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    if gemm._lib() is None or fused._lib() is None:
        return None
    try:
        lib = load_library(SOURCE)
    except (RuntimeError, OSError) as exc:
        logger.warning("native mixture-of-experts kernel unavailable (%s); using the Python loop", exc)
        return None
    lib.pagellm_moe_experts_bf16.argtypes = [ctypes.POINTER(_Layer), _P, _I, _I, _P, _P, _P, _P]
    lib.pagellm_moe_experts_bf16.restype = ctypes.c_int
    lib.pagellm_moe_route_bf16.argtypes = [_P, _I, _I, _I, _I, _I, _P, _P, _P, _I]
    lib.pagellm_moe_route_bf16.restype = None
    lib.pagellm_moe_forward_bf16.argtypes = [ctypes.POINTER(_Layer), _P, _I, _I, _P]
    lib.pagellm_moe_forward_bf16.restype = None
    return lib


def available() -> bool:
    return _lib() is not None


def route(logits: torch.Tensor, top_k: int, renormalize: bool, weights_in_model_dtype: bool,
          softmax_top_k: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The native routing of bf16 router ``logits`` [tokens, experts]: (rows, scales, counts), the (token, weight)
    pairs grouped by expert as ``Experts.__call__`` takes them (for tests: ``forward`` routes inside); with
    ``softmax_top_k`` (gpt-oss's) the weights are the softmax of the chosen logits."""
    loaded = _lib()
    assert loaded is not None, "native mixture-of-experts kernel is not available on this machine"
    assert logits.dtype == torch.bfloat16 and logits.dim() == 2 and 1 <= top_k <= logits.shape[1]
    logits = logits.contiguous()
    tokens, experts = logits.shape
    rows, scales = torch.empty(tokens * top_k, dtype=torch.int64), torch.empty(tokens * top_k)
    counts = torch.empty(experts, dtype=torch.int64)
    loaded.pagellm_moe_route_bf16(logits.data_ptr(), tokens, experts, top_k, int(renormalize),
                                  int(weights_in_model_dtype), rows.data_ptr(), scales.data_ptr(), counts.data_ptr(),
                                  int(softmax_top_k))
    return rows, scales, counts


@dataclass(frozen=True)
class Biases:
    """gpt-oss's parts of a layer beyond SwiGLU experts: the router's bias, each expert's gate/up bias and down bias
    (``None`` on tensor-parallel ranks but the first), all bf16; its clamped SwiGLU (``limit``, ``alpha``); the
    softmax of the chosen logits as routing weights."""

    router: torch.Tensor | None
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor | None]
    limit: float
    alpha: float
    softmax_top_k: bool = True


class Experts:
    """One layer's experts bound to the native call: ``gate_up[e]`` packed ``[2·inter, hidden]`` and ``down[e]``
    packed ``[hidden, inter]``, all of one format (``gemm.weight_format``: ``bf16``, ``w8a8_int8``, ``w4a8_int4``,
    ``w4a16_mxfp4``, ...); with the layer's packed bf16 ``router`` [experts, hidden] and its ``top_k`` and flags, the
    whole layer (``forward``), its ``shared`` expert included where it has one (gate_up and down in the experts'
    format, its gate packed bf16 [1, hidden]), gpt-oss's biases and clamped SwiGLU where ``biases`` are given."""

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor], router: torch.Tensor | None = None,
                 top_k: int = 1, renormalize: bool = False, weights_in_model_dtype: bool = False,
                 shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 biases: Biases | None = None) -> None:
        loaded = _lib()
        assert loaded is not None, "native mixture-of-experts kernel is not available on this machine"
        formats = {gemm.weight_format(w) for w in (*gate_up, *down, *(shared[:2] if shared else ()))}
        if len(formats) != 1 or None in formats:
            raise ValueError("the native experts take packed weights, all of one format")
        if router is not None and (gemm.weight_format(router) != "bf16" or
                                   gemm.packed_shape(router)[0] != len(gate_up)):  # type: ignore[index]
            raise ValueError("the native router takes a packed bf16 [experts, hidden] weight")
        if shared is not None and gemm.weight_format(shared[2]) != "bf16":
            raise ValueError("the native shared expert's gate takes a packed bf16 [1, hidden] weight")
        if biases is not None and not all(b.dtype == torch.bfloat16 and b.is_contiguous() for b in (
                *biases.gate_up, *(b for b in biases.down if b is not None),
                *((biases.router,) if biases.router is not None else ()))):
            raise ValueError("the native experts' biases are contiguous bf16 tensors")
        self.weight_format = formats.pop()
        self.hidden, self.inter = gemm.packed_shape(down[0])  # type: ignore[misc]
        self.num_experts, self.routes = len(gate_up), router is not None
        self._keep: list = [*gate_up, *down, router, *(shared or ()), biases]  # what the layer's pointers name
        self._layer = _Layer(ctypes.addressof(_kernels(self.weight_format)), _ptr(router), self._array(gate_up),
                             self._array(down), len(gate_up), top_k, self.hidden, self.inter, int(renormalize),
                             int(weights_in_model_dtype), *(_ptr(w) for w in (shared or (None,) * 3)),
                             gemm.packed_shape(shared[1])[1] if shared else 0)  # type: ignore[index]
        if biases is not None:
            self._layer.router_bias, self._layer.softmax_top_k = _ptr(biases.router), int(biases.softmax_top_k)
            self._layer.gate_up_bias, self._layer.down_bias = self._array(biases.gate_up), self._array(biases.down)
            self._layer.swiglu_limit, self._layer.swiglu_alpha = biases.limit, biases.alpha
        self._fn, self._forward = loaded.pagellm_moe_experts_bf16, loaded.pagellm_moe_forward_bf16

    def _array(self, tensors: list) -> int:
        """The address of a C array of the tensors' data pointers (null for ``None``), kept alive with the layer."""
        array = (ctypes.c_void_p * len(tensors))(*(_ptr(t) for t in tensors))
        self._keep.append(array)
        return ctypes.addressof(array)

    @property
    def address(self) -> int:
        """The address of this layer's ``MoeLayer`` (for the native decoder stack; needs the router)."""
        assert self.routes, "bound without a router"
        return ctypes.addressof(self._layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer for bfloat16 rows ``x`` [tokens, hidden] (unit column stride): router, routing,
        experts."""
        assert self.routes, "bound without a router"
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == self.hidden
        out = torch.empty((x.shape[0], self.hidden), dtype=torch.bfloat16)
        self._forward(ctypes.byref(self._layer), x.data_ptr(), x.shape[0], x.stride(0), out.data_ptr())
        return out

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
        if self._fn(ctypes.byref(self._layer), x.data_ptr(), x.shape[0], x.stride(0), rows.data_ptr(),
                    scales.data_ptr(), counts.data_ptr(), out.data_ptr()):
            raise IndexError(f"expert rows must name tokens in [0, {x.shape[0]})")
        return out


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
