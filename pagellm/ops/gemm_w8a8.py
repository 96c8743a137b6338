"""W8A8 int8 GEMM (``--quantization w8a8_int8``) over weights quantized and packed once at load time
(``csrc/packed_gemm_w8a8.cpp``), with ``reference_linear`` as its plain-PyTorch twin and test oracle.

A weight ``W`` [N, K] becomes int8 ``Q`` with one float32 scale per output channel (symmetric: ``s_w = max|W_j| /
127``); each call quantizes its activation rows the same way, one scale per row (dynamic, per token), multiplies
the two int8 matrices exactly in int32 with AVX-512 VNNI (twice the multiply-adds per instruction of the bfloat16
kernel, half its weight bytes) and scales each output once: ``y = (q(x) · Qᵀ) · s_x · s_w + bias`` in bfloat16.
This is SGLang's ``w8a8_int8`` scheme and that of vLLM's compressed-tensors W8A8 int8 checkpoints (channel-wise
weights, dynamic per-token activations): the weights are quantized here from a bfloat16 model's, or taken as they
are from such a checkpoint (``model/compressed_tensors.py``).

``pack(q, scale)`` lays ``Q`` out as panels of 16 output columns with K in quads, ``[ceil(N/16), ceil(K/4), 16,
4]`` (zero padding), then the float32 scales and the int32 offsets ``128 · Σ_k Q`` (the kernel feeds x as unsigned
bytes, ``q(x) + 128``) of every padded column, all in one flat int8 tensor. A quantized layer's Parameter holds it,
with ``packed_shape`` = (N, K) and ``weight_format`` = ``"w8a8_int8"`` (``ops.gemm.linear`` dispatches on them).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from pagellm import envs
from pagellm.ops.build import CXX_FLAGS, HEADERS, cpu_flags, entry_address
from pagellm.native_build import build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "packed_gemm_w8a8.cpp"
FORMAT = "w8a8_int8"
PANEL, QUAD = 16, 4
# Each epilogue op rounds on its own, as the twin's torch ops do (no fused multiply-add): the same bits.
FLAGS = [*CXX_FLAGS, "-ffp-contract=off"]
_P, _I = ctypes.c_void_p, ctypes.c_int64


def runs_here() -> bool:
    """Whether this CPU has the instructions the kernel is written in (AVX-512 VNNI and BW)."""
    flags = set(cpu_flags().split())
    return {"avx512_vnni", "avx512bw"} <= flags


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    lib = load(build_job(), "w8a8", "int8 GEMM kernel")
    if lib is not None:
        lib.pagellm_packed_gemm_w8a8_use_amx.argtypes = [ctypes.c_int]
        lib.pagellm_packed_gemm_w8a8_use_amx.restype = ctypes.c_int
        lib.pagellm_packed_gemm_w8a8_use_amx(int(envs.gemm_amx()))
    return lib


def load(job: functools.partial, suffix: str, what: str) -> ctypes.CDLL | None:
    """A quantized GEMM's library (``job`` builds it) with the C signatures of its entries ``pagellm_*_{suffix}``
    declared, or ``None`` where it does not run here (``what`` names it in the warning)."""
    if not runs_here():
        return None
    try:
        lib = ctypes.CDLL(str(job()))
    except (RuntimeError, OSError) as exc:
        logger.warning("%s unavailable (%s)", what, exc)
        return None
    for name, argtypes, restype in (("packed_linear", [_P, _I, _I, _I, _P, _I, _P, _P, _I], None),
                                    ("packed_linear_silu_mul", [_P, _I, _I, _I, _P, _I, _P, _I], ctypes.c_int),
                                    ("quantize_pack", [_P, _I, _I, _P], ctypes.c_int)):
        fn = getattr(lib, f"pagellm_{name}_{suffix}")
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def available() -> bool:
    return _lib() is not None


def use_amx(want: bool) -> bool:
    """Switch the kernel to its AMX-INT8 tiles (where compiled in and granted) or its VNNI ones; returns whether AMX
    is on. Both give the same bits; for tests and A/B runs (a process otherwise keeps ``PAGELLM_GEMM_AMX``'s)."""
    lib = _lib()
    return lib is not None and bool(lib.pagellm_packed_gemm_w8a8_use_amx(int(want)))


def amx() -> bool:
    """Whether the int8 GEMM runs on AMX tiles in this process."""
    lib = _lib()
    return lib is not None and bool(lib.pagellm_packed_gemm_w8a8_use_amx(-1))


def build_job() -> functools.partial:
    """The kernel's compile (a no-op where this machine kind has it), for start-up's background compiles."""
    return functools.partial(build, SOURCE, FLAGS, f"{SOURCE.stem}.so", [HEADERS])


def entry_addresses() -> tuple[int, int]:
    """The kernel's C entries for the native decoder stack, the GEMM's and the gate/up one's with SiLU·mul (the
    signatures of the bfloat16 kernel's)."""
    lib = _lib()
    assert lib is not None, "int8 GEMM kernel is not available on this machine"
    return entry_address(lib.pagellm_packed_linear_w8a8), entry_address(lib.pagellm_packed_linear_silu_mul_w8a8)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, s_w)``: int8 ``[N, K]`` and float32 ``[N]`` with ``W ≈ Q · s_w`` per row (an all-zero row: scale 0)."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = amax / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel's flat int8 operand for ``Q`` [N, K] and ``s_w`` [N] (see the module docstring)."""
    if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
        raise ValueError(f"pack takes int8 [N, K] and float32 [N], got {q.dtype} {tuple(q.shape)}, "
                         f"{tuple(scale.shape)}")
    n, k = q.shape
    n_pad, k_pad = -n % PANEL, -k % QUAD
    padded = F.pad(q, (0, k_pad, 0, n_pad))
    panels = padded.view((n + n_pad) // PANEL, PANEL, (k + k_pad) // QUAD, QUAD).permute(0, 2, 1, 3).reshape(-1)
    scales = F.pad(scale.float(), (0, n_pad))
    offsets = F.pad(q.to(torch.int32).sum(dim=1) * 128, (0, n_pad)).to(torch.int32)
    return torch.cat([panels, scales.view(torch.int8), offsets.view(torch.int8)])


def quantize_pack(weight: torch.Tensor) -> torch.Tensor:
    """``pack(*quantize(weight))`` of a bfloat16 ``[N, K]`` weight, byte for byte, in one native pass (what a model's
    load runs for every decoder weight)."""
    lib = _lib()
    assert lib is not None, "int8 GEMM kernel is not available on this machine"
    n, k = weight.shape
    panels = -(-n // PANEL)
    return call_quantize_pack(lib.pagellm_quantize_pack_w8a8, weight,
                              panels * -(-k // QUAD) * PANEL * QUAD + 8 * panels * PANEL,
                              "a weight is not finite; this weight cannot take w8a8_int8")


def unpack(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, s_w)`` of a packed operand of ``n`` outputs and ``k`` inputs."""
    panels, quads = -(-n // PANEL), -(-k // QUAD)
    body = panels * quads * PANEL * QUAD
    q = packed[:body].view(panels, quads, PANEL, QUAD).permute(0, 2, 1, 3).reshape(panels * PANEL, quads * QUAD)
    scale = packed[body:body + 4 * panels * PANEL].view(torch.float32)
    return q[:n, :k].contiguous(), scale[:n].clone()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x quantized as the kernel does: ``(q, s_x)`` with ``q = round(x · (127 / max|x|))`` (to nearest even,
    clamped to ±127; 0 where that factor is not finite) and ``s_x = max|x| / 127`` (float32 [M])."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)  # a division (127.0 / t multiplies by 1/t)
    inv = torch.where(torch.isfinite(inv), inv, 0.0)
    q = torch.round(xf * inv[:, None]).clamp_(-127, 127)
    return q, amax / 127.0


def reference_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's result in plain PyTorch, bit for bit: bfloat16 rows ``x`` [M, K], ``(q, scale) = quantize(W)``."""
    xq, sx = quantize_rows(x)
    acc = (xq.double() @ q.double().T).to(torch.int32)  # exact: |sum| < 2^31 < 2^53
    y = (acc.float() * sx[:, None]) * scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y ≈ F.linear(x, W, bias)`` in bfloat16 for rows ``x`` [..., K] through the kernel (``packed = pack(...)``)."""
    lib = _lib()
    assert lib is not None, "int8 GEMM kernel is not available on this machine"
    return call_linear(lib.pagellm_packed_linear_w8a8, x, packed, n, bias)


def packed_linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, n2: int) -> torch.Tensor | None:
    """``silu(g) * u`` of ``[g | u] = packed_linear(x, packed, n2)`` for bfloat16 rows ``x`` [m, K] and a packed
    gate/up weight (gate rows, then up rows) in one pass, bit for bit ``fused.silu_and_mul`` of that product; ``None``
    where the gate width is not whole panels of 16 (the caller makes the two calls)."""
    lib = _lib()
    assert lib is not None, "int8 GEMM kernel is not available on this machine"
    return call_linear_silu_mul(lib.pagellm_packed_linear_silu_mul_w8a8, x, packed, n2)


def call_quantize_pack(fn, weight: torch.Tensor, size: int, refusal: str) -> torch.Tensor:  # noqa: ANN001
    """A quantized format's native quantize-and-pack C entry ``fn`` over a bfloat16 ``[N, K]`` weight, into a flat
    int8 operand of ``size`` bytes; ``ValueError(refusal)`` where the entry refuses the weight."""
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"quantize_pack takes a bfloat16 weight, got {weight.dtype}")
    w = weight.contiguous()
    out = torch.empty(size, dtype=torch.int8)
    if fn(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr()):
        raise ValueError(refusal)
    return out


def call_linear(fn, x: torch.Tensor, packed: torch.Tensor, n: int,  # noqa: ANN001
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """A quantized GEMM's C entry ``fn`` (the bfloat16 kernel's signature) over rows ``x`` [..., K]: the rows and
    bias made contiguous bfloat16, the output [..., n] bfloat16."""
    k = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    if rows.stride(-1) != 1 or rows.dtype != torch.bfloat16:
        rows = rows.to(torch.bfloat16).contiguous()
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.stride(0) != 1):
        bias = bias.to(torch.bfloat16).contiguous()
    y = torch.empty((rows.shape[0], n), dtype=torch.bfloat16)
    fn(rows.data_ptr(), rows.shape[0], k, rows.stride(0), packed.data_ptr(), n,
       None if bias is None else bias.data_ptr(), y.data_ptr(), n)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def call_linear_silu_mul(fn, x: torch.Tensor, packed: torch.Tensor, n2: int) -> torch.Tensor | None:  # noqa: ANN001
    """A quantized GEMM's gate/up C entry ``fn`` over bfloat16 rows ``x`` [m, K]: ``silu(g) * u``, or ``None`` where
    it declines (a gate width of part panels)."""
    assert x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(-1) == 1
    y = torch.empty((x.shape[0], n2 // 2), dtype=torch.bfloat16)
    done = fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), packed.data_ptr(), n2, y.data_ptr(), n2 // 2)
    return y if done == 0 else None


def quantize_parameter(param: torch.nn.Parameter, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Quantize and pack a bfloat16 ``[N, K]`` weight Parameter in place (see the module docstring); or, with
    ``quantized = (Q, s_w)`` (a quantized checkpoint's), pack those in its place."""
    if not available():
        raise RuntimeError("quantization w8a8_int8 needs the int8 GEMM kernel, which needs a CPU with AVX-512 VNNI "
                           "and a C++ compiler; this machine has not both")
    if param.dtype != torch.bfloat16 or param.dim() != 2:
        raise ValueError(f"w8a8_int8 quantizes 2-D bfloat16 weights, got {param.dtype} {tuple(param.shape)}")
    n, k = param.shape
    if quantized is None:
        param.data = quantize_pack(param.data)
    else:
        q, scale = quantized
        if q.shape != (n, k) or scale.shape != (n,):
            raise ValueError(f"int8 weight {tuple(q.shape)} and scales {tuple(scale.shape)} do not fit [{n}, {k}]")
        param.data = pack(q, scale)
    param.packed_shape = (n, k)  # type: ignore[attr-defined]
    param.weight_format = FORMAT  # type: ignore[attr-defined]


def rows(packed: torch.Tensor, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The bfloat16 rows ``Q[ids] · s_w[ids]`` (shape ``ids.shape + (k,)``) of a packed operand, ``dequantize``'s
    rows: the embedding lookup of a tied int8 LM head."""
    flat = ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"row ids must lie in [0, {n})")
    panels, quads = -(-n // PANEL), -(-k // QUAD)
    body = panels * quads * PANEL * QUAD
    q = packed[:body].view(panels, quads, PANEL, QUAD)[flat // PANEL, :, flat % PANEL]  # [ids, quads, 4]
    scale = packed[body:body + 4 * panels * PANEL].view(torch.float32)[flat]
    return (q.reshape(flat.shape[0], -1)[:, :k].float() * scale[:, None]).to(torch.bfloat16).view(*ids.shape, k)


def dequantize(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The bfloat16 ``Q · s_w`` [n, k] of a packed operand (for consumers of a plain weight)."""
    q, scale = unpack(packed, n, k)
    return (q.float() * scale[:, None]).to(torch.bfloat16)
