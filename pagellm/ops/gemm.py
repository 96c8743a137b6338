"""bfloat16 GEMM over weights packed once at load time (``csrc/packed_gemm.cpp``), with ``F.linear`` as its twin.

``pack(weight)`` re-lays a bfloat16 ``[N, K]`` matrix as panels of 16 output columns with K in pairs,
``[ceil(N/16), ceil(K/2), 16, 2]`` (zero padding), the operand layout of AVX-512 BF16 broadcast dot products: the
kernel then streams each thread's contiguous run of panels at DRAM speed at small M and keeps register tiles of
float32 accumulators with no horizontal reductions at large M. ``packed_linear(x, packed, n, bias)`` is
``F.linear(x, W, bias)`` for any number of rows; it accumulates in float32 and rounds once to bfloat16, so it
differs from ``F.linear`` on the plain weight only by rounding. Each output's summation order depends on K alone,
so a row's result is bit for bit the same whatever the batch around it and the thread count. ``rows`` /
``unpack`` read plain rows back out of a packed matrix (the embedding lookup of a tied LM head, consumers that
need the plain weight). Weights quantized for ``--quantization w8a8_int8`` (``gemm_w8a8.py``) take the same calls:
``linear``, ``plain`` and ``weight_format`` dispatch on how a weight is packed. A 4-bit weight packed with its
inputs in an order of their own (an act-order GPTQ checkpoint's, ``input_order``) takes its rows' inputs in that
order: ``linear`` gathers them first, and ``plain`` puts its columns back.

The kernel needs AVX-512 BF16, or AVX2 + FMA (``csrc/packed_gemm_avx2.h``: each half line widens to float32 and the
products are float32 FMAs, for AMD Zen 2/3 and older Intel CPUs), and a C++ compiler; ``available()`` says whether
it runs here. Where it does not, nothing is packed and every layer keeps ``F.linear`` on the plain weight. On CPUs
with AMX-BF16 it multiplies on AMX tiles (``csrc/packed_gemm_amx.h``: the packed layout is already AMX's B
operand), about 3x the AVX-512 rate at 32 rows and 5-8x from 256 on; ``PAGELLM_GEMM_AMX=0`` keeps the AVX-512
path. A process keeps one path (``use_amx``, called once at load), since the two sum inside a K step in different
orders and rows must not depend on the batch; ``amx()`` says which one runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from pagellm import envs
from pagellm.ops import gemm_mxfp4, gemm_w4a8, gemm_w4a16, gemm_w8a8
from pagellm.ops.build import cpu_flags, load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "packed_gemm.cpp"
PANEL = 16  # output columns per panel (csrc/packed_gemm.cpp kPanel)
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    """The native library, or ``None`` where it cannot run (no AVX-512 BF16, no compiler)."""
    if not runs_here():
        return None
    try:
        lib = load_library(SOURCE)
    except (RuntimeError, OSError) as exc:
        logger.warning("packed bfloat16 GEMM kernel unavailable (%s); using F.linear", exc)
        return None
    return bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures of a build of ``csrc/packed_gemm.cpp`` and set its AMX switch (``PAGELLM_GEMM_AMX``);
    returns ``lib``. ``_lib`` binds this machine's build; the tests also bind an AVX2-only build of the same source."""
    lib.pagellm_packed_linear_bf16.argtypes = [_P, _I, _I, _I, _P, _I, _P, _P, _I]
    lib.pagellm_packed_linear_bf16.restype = None
    lib.pagellm_packed_rows_bf16.argtypes = [_P, _I, _I, _P, _I, _P]
    lib.pagellm_packed_rows_bf16.restype = ctypes.c_int
    lib.pagellm_packed_linear_silu_mul_bf16.argtypes = [_P, _I, _I, _I, _P, _I, _P, _I]
    lib.pagellm_packed_linear_silu_mul_bf16.restype = ctypes.c_int
    lib.pagellm_pack_bf16.argtypes = [_P, _I, _I, _P]
    lib.pagellm_pack_bf16.restype = None
    lib.pagellm_packed_gemm_use_amx.argtypes = [ctypes.c_int]
    lib.pagellm_packed_gemm_use_amx.restype = ctypes.c_int
    lib.pagellm_packed_gemm_vector_path.argtypes = []
    lib.pagellm_packed_gemm_vector_path.restype = ctypes.c_char_p
    lib.pagellm_packed_gemm_use_amx(int(envs.gemm_amx()))
    return lib


def runs_here() -> bool:
    """Whether this CPU has the instructions a path of the kernel is written in (AVX-512 BF16, or AVX2 + FMA)."""
    flags = set(cpu_flags().split())
    return "avx512_bf16" in flags or {"avx2", "fma"} <= flags


def available() -> bool:
    return _lib() is not None


def path() -> str:
    """Which of the kernel's paths runs in this process: ``"AMX"``, ``"AVX-512 BF16"``, ``"AVX2"``, or ``"off"``."""
    lib = _lib()
    if lib is None:
        return "off"
    return "AMX" if amx() else lib.pagellm_packed_gemm_vector_path().decode()


def use_amx(want: bool) -> bool:
    """Switch the kernel to its AMX tile path (where compiled in and granted) or its AVX-512 one; returns whether
    AMX is on. For tests and A/B runs: a serving process keeps the path chosen at load (``PAGELLM_GEMM_AMX``)."""
    lib = _lib()
    return lib is not None and bool(lib.pagellm_packed_gemm_use_amx(int(want)))


def amx() -> bool:
    """Whether the packed GEMM runs on AMX tiles in this process."""
    lib = _lib()
    if lib is None:
        return False
    return bool(lib.pagellm_packed_gemm_use_amx(-1))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The packed copy of a bfloat16 ``[N, K]`` weight: ``[ceil(N/16), ceil(K/2), 16, 2]``, zero padded (in one
    native pass where the kernel's library loads, else ``pack_torch``'s permute; the same bytes)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"pack takes a 2-D bfloat16 weight, got {weight.dtype} of shape {tuple(weight.shape)}")
    lib = _lib()
    if lib is None:
        return pack_torch(weight)
    n, k = weight.shape
    out = torch.empty((-(-n // PANEL), (k + 1) // 2, PANEL, 2), dtype=torch.bfloat16)
    lib.pagellm_pack_bf16(weight.contiguous().data_ptr(), n, k, out.data_ptr())
    return out


def pack_torch(weight: torch.Tensor) -> torch.Tensor:
    """``pack`` as a torch permute: its twin, and its path where the native library does not load."""
    n, k = weight.shape
    n_pad, k_pad = -n % PANEL, k & 1
    padded = F.pad(weight, (0, k_pad, 0, n_pad)) if n_pad or k_pad else weight
    return padded.view((n + n_pad) // PANEL, PANEL, (k + k_pad) // 2, 2).permute(0, 2, 1, 3).contiguous()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for bfloat16 ``x`` [..., K] and ``packed = pack(W)`` with ``W`` [n, K]."""
    lib = _lib()
    assert lib is not None, "packed GEMM kernel is not available on this machine"
    k = x.shape[-1]
    assert packed.shape[1] == (k + 1) >> 1 and packed.shape[0] * PANEL - n in range(PANEL), "packed weight misfit"
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    if rows.stride(-1) != 1 or rows.dtype != torch.bfloat16:
        rows = rows.to(torch.bfloat16).contiguous()
    m = rows.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16)
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.stride(0) != 1):
        bias = bias.to(torch.bfloat16).contiguous()
    lib.pagellm_packed_linear_bf16(rows.data_ptr(), m, k, rows.stride(0), packed.data_ptr(), n,
                                   None if bias is None else bias.data_ptr(), y.data_ptr(), n)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def packed_linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, n2: int) -> torch.Tensor | None:
    """``silu(g) * u`` of ``[g | u] = F.linear(x, W)`` for bfloat16 rows ``x`` [m, K] and ``packed = pack(W)`` with
    ``W`` [n2, K] (gate rows, then up rows), in one pass: bit for bit ``fused.silu_and_mul(packed_linear(...))``.
    ``None`` where the fused pass does not run (the AVX2 build, or a gate width that is not whole panels)."""
    lib = _lib()
    assert lib is not None, "packed GEMM kernel is not available on this machine"
    assert x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(-1) == 1 and packed.shape[1] == (x.shape[1] + 1) >> 1
    y = torch.empty((x.shape[0], n2 // 2), dtype=torch.bfloat16)
    done = lib.pagellm_packed_linear_silu_mul_bf16(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                                                   packed.data_ptr(), n2, y.data_ptr(), n2 // 2)
    return y if done == 0 else None


def rows(packed: torch.Tensor, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Plain rows ``W[ids]`` (shape ``ids.shape + (k,)``) of a packed ``[n, k]`` matrix: the embedding lookup."""
    lib = _lib()
    assert lib is not None, "packed GEMM kernel is not available on this machine"
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty((flat.shape[0], k), dtype=torch.bfloat16)
    if lib.pagellm_packed_rows_bf16(packed.data_ptr(), n, k, flat.data_ptr(), flat.shape[0], out.data_ptr()):
        raise IndexError(f"row ids must lie in [0, {n})")
    return out.view(*ids.shape, k)


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The plain ``[n, k]`` matrix of a packed one (a new tensor)."""
    panels, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(panels * PANEL, pairs * 2)[:n, :k].contiguous()


# ---------------------------------------------------------------------------------------- packed parameters
# A layer's weight Parameter is packed in place after loading (``pack_parameter``): its data becomes ``pack(W)``
# and it records the plain shape as ``packed_shape``. A tied embedding and LM head share one Parameter, so both
# see the one packed matrix. A quantized weight (``gemm_w8a8`` or ``gemm_w4a8``'s ``quantize_parameter``) records
# ``packed_shape`` too, and its ``weight_format``. The functions below take every kind of weight.

# The quantized weight formats and their kernels' modules (each with ``packed_linear``, ``packed_linear_silu_mul``,
# ``dequantize``, ``rows``, ``entry_addresses``, ``quantize_parameter`` and ``available``).
# (``gemm_mxfp4``'s is an MXFP4 checkpoint's own, never computed from float weights.)
QUANTIZED = {gemm_w8a8.FORMAT: gemm_w8a8, gemm_w4a8.FORMAT: gemm_w4a8, gemm_w4a16.FORMAT: gemm_w4a16,
             gemm_mxfp4.FORMAT: gemm_mxfp4}
# the formats of the 4-bit packed weights (gemm_w4a8's layout)
FOUR_BIT = (gemm_w4a8.FORMAT, gemm_w4a16.FORMAT, gemm_mxfp4.FORMAT)


def packed_shape(weight: torch.Tensor) -> tuple[int, int] | None:
    """``(N, K)`` of a packed or quantized weight Parameter, ``None`` for a plain one."""
    return getattr(weight, "packed_shape", None)


def weight_format(weight: torch.Tensor) -> str | None:
    """``"bf16"`` for a weight packed for the bfloat16 kernel, its format (a key of ``QUANTIZED``) for a quantized
    one, ``None`` for a plain one."""
    return None if packed_shape(weight) is None else getattr(weight, "weight_format", "bf16")


def pack_parameter(param: torch.nn.Parameter) -> bool:
    """Pack a bfloat16 ``[N, K]`` Parameter in place where the kernel runs; ``False`` (left plain) otherwise."""
    if packed_shape(param) is not None:
        return True  # already packed (a tied weight reached twice)
    if param.dtype != torch.bfloat16 or param.dim() != 2 or not available():
        return False
    n, k = param.shape
    param.data = pack(param.data)
    param.packed_shape = (n, k)  # type: ignore[attr-defined]
    return True


def input_order(weight: torch.Tensor) -> torch.Tensor | None:
    """The order int64 [K] in which a packed weight takes its inputs (its column ``j`` is the plain weight's column
    ``order[j]``), or ``None``: in order."""
    return getattr(weight, "input_order", None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for a plain weight ``W`` or a packed one (then through the native kernel)."""
    shape = packed_shape(weight)
    if shape is None:
        return F.linear(x, weight, bias)
    if x.dtype == torch.bfloat16:
        kernel = QUANTIZED.get(weight_format(weight))  # type: ignore[arg-type]
        order = input_order(weight)
        rows = x if order is None else x.index_select(-1, order)
        return (kernel.packed_linear if kernel else packed_linear)(rows, weight, shape[0], bias)
    return F.linear(x, plain(weight).to(x.dtype), bias)


def plain(weight: torch.Tensor) -> torch.Tensor:
    """The plain ``[N, K]`` weight: the tensor itself, or a new unpacked (dequantized) copy of a packed one, its
    columns in the inputs' order."""
    shape = packed_shape(weight)
    if shape is None:
        return weight
    kernel = QUANTIZED.get(weight_format(weight))  # type: ignore[arg-type]
    w = kernel.dequantize(weight, *shape) if kernel else unpack(weight, *shape)
    order = input_order(weight)
    if order is None:
        return w
    out = torch.empty_like(w)
    out[:, order] = w
    return out


def weight_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, W)`` for a plain or packed weight."""
    shape = packed_shape(weight)
    if shape is None:
        return F.embedding(ids, weight)
    kernel = QUANTIZED.get(weight_format(weight))  # type: ignore[arg-type]
    return (kernel.rows if kernel else rows)(weight, ids, *shape)
