"""4-bit weight GEMM (``--quantization w4a8_int4``) over weights quantized and packed once at load time
(``csrc/packed_gemm_w4a8.cpp``), with ``reference_linear`` as its plain-PyTorch twin and test oracle.

A weight ``W`` [N, K] is cut into groups of 32 inputs per output column, each with a float16 scale ``d = (max -
min) / 15`` and minimum ``m = min``, and becomes 4-bit ``q = round((W - m) / d)`` in [0, 15], so ``W ≈ d · q + m``:
llama.cpp's Q4_1, about 5 bits a weight (4.5 for the values, 1 for the two float16 numbers of each 32) against the
int8 kernel's 8 and bfloat16's 16. Each call quantizes its activation rows to int8 as the int8 kernel does (one
scale per row, ``gemm_w8a8.quantize_rows``), multiplies each group exactly in int32 with AVX-512 VNNI (the nibbles
unsigned, the activations signed), and sums the groups in float32: ``f += P_g · d_g``, ``f += m_g · S_g`` with
``S_g`` the group's sum of ``q(x)``, then ``y = f · s_x + bias`` in bfloat16. On a CPU decoding reads weights, so a
batch's step reads about 5/8 of the int8 kernel's bytes and 5/16 of bfloat16's.

``pack(q, d, m)`` lays ``q`` out as panels of 16 output columns; per panel and group five 64-byte lines: four of
nibbles (line ``l``, byte ``4c + i``: input ``8l + i`` of column ``c`` low, ``8l + 4 + i`` high), then the 16 ``d``
and the 16 ``m`` as float16; K is padded with zeros to whole groups, N to whole panels. A quantized layer's
Parameter holds the flat int8 tensor, with ``packed_shape`` = (N, K) and ``weight_format`` = ``"w4a8_int4"``
(``ops.gemm.linear`` dispatches on them).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from pagellm.native_build import build
from pagellm.ops import gemm_w8a8
from pagellm.ops.build import HEADERS, entry_address

SOURCE = Path(__file__).parent / "csrc" / "packed_gemm_w4a8.cpp"
FORMAT = "w4a8_int4"
PANEL, GROUP, LINES = 16, 32, 4
GROUP_BYTES = (LINES + 1) * 64

runs_here = gemm_w8a8.runs_here  # the same instructions (AVX-512 VNNI and BW; float16 loads are AVX-512F)


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    lib = gemm_w8a8.load(build_job(), "w4a8", "4-bit GEMM kernel")
    if lib is not None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.pagellm_pack_groups_w4a8.argtypes = [p, i, i, p, p, p]
        lib.pagellm_pack_groups_w4a8.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _lib() is not None


def build_job() -> functools.partial:
    """The kernel's compile (a no-op where this machine kind has it), for start-up's background compiles."""
    return functools.partial(build, SOURCE, gemm_w8a8.FLAGS, f"{SOURCE.stem}.so", [HEADERS])


def entry_addresses() -> tuple[int, int]:
    """The kernel's C entries for the native decoder stack and the experts, the GEMM's and the gate/up one's with
    SiLU·mul (the signatures of the bfloat16 kernel's)."""
    lib = _lib()
    assert lib is not None, "4-bit GEMM kernel is not available on this machine"
    return entry_address(lib.pagellm_packed_linear_w4a8), entry_address(lib.pagellm_packed_linear_silu_mul_w4a8)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, d, m)``: uint8 ``[N, K']`` in [0, 15] (K' = K padded to whole groups) and float16 ``[N, K' / 32]``
    scales and minima, with ``W ≈ d · q + m`` per group (a constant group: ``d`` 0, ``q`` 0)."""
    n, k = weight.shape
    w = F.pad(weight.float(), (0, -k % GROUP)).view(n, -1, GROUP)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    d, m = ((hi - lo) / 15.0).half(), lo.half()
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise ValueError("a weight's group range overflows float16; this weight cannot take w4a8_int4")
    step = torch.where(d > 0, d.float(), 1.0)
    q = torch.round((w - m.float()[..., None]) / step[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.view(n, -1), d, m


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The kernel's flat int8 operand for ``(q, d, m) = quantize(W)`` (see the module docstring)."""
    n, k = q.shape
    groups = k // GROUP
    if q.dtype != torch.uint8 or k % GROUP or d.shape != (n, groups) or m.shape != (n, groups):
        raise ValueError(f"pack takes uint8 [N, 32·G] and float16 [N, G] twice, got {q.dtype} {tuple(q.shape)}, "
                         f"{tuple(d.shape)}, {tuple(m.shape)}")
    pad = -n % PANEL
    panels = (n + pad) // PANEL
    v = F.pad(q, (0, 0, 0, pad)).view(panels, PANEL, groups, LINES, 2, 4)
    nibbles = v[..., 0, :] | (v[..., 1, :] << 4)  # [panel, column, group, line, i]
    lines = nibbles.permute(0, 2, 3, 1, 4).reshape(panels, groups, LINES * 64)

    def scale_line(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t.half(), (0, 0, 0, pad)).view(panels, PANEL, groups).transpose(1, 2).contiguous() \
            .view(torch.uint8)

    return torch.cat([lines, scale_line(d), scale_line(m)], dim=2).reshape(-1).view(torch.int8)


def quantize_pack(weight: torch.Tensor) -> torch.Tensor:
    """``pack(*quantize(weight))`` of a bfloat16 ``[N, K]`` weight, byte for byte, in one native pass (a model's
    load quantizes every decoder weight: about 9 ns a weight through torch's ops, 0.4 ns here)."""
    lib = _lib()
    assert lib is not None, "4-bit GEMM kernel is not available on this machine"
    n, k = weight.shape
    return gemm_w8a8.call_quantize_pack(lib.pagellm_quantize_pack_w4a8, weight,
                                        -(-n // PANEL) * -(-k // GROUP) * GROUP_BYTES,
                                        "a weight is not finite, or a group's range overflows float16; this weight "
                                        "cannot take w4a8_int4")


def pack_groups(values: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``pack(q, d, m)`` byte for byte, in one native pass, of a 4-bit checkpoint's integers ``q`` given as the
    bfloat16 values [N, K] of the weight that holds them, with float16 ``d`` and ``m`` [N, K' / 32] (K' = K padded to
    whole groups)."""
    lib = _lib()
    assert lib is not None, "4-bit GEMM kernel is not available on this machine"
    n, k = values.shape
    groups = -(-k // GROUP)
    if values.dtype != torch.bfloat16 or d.shape != (n, groups) or m.shape != (n, groups) or \
            d.dtype != torch.float16 or m.dtype != torch.float16:
        raise ValueError(f"pack_groups takes bfloat16 [N, K] and float16 [N, K / 32] twice, got {values.dtype} "
                         f"{tuple(values.shape)}, {d.dtype} {tuple(d.shape)}, {m.dtype} {tuple(m.shape)}")
    w, d, m = values.contiguous(), d.contiguous(), m.contiguous()
    out = torch.empty(-(-n // PANEL) * groups * GROUP_BYTES, dtype=torch.int8)
    if lib.pagellm_pack_groups_w4a8(w.data_ptr(), n, k, d.data_ptr(), m.data_ptr(), out.data_ptr()):
        raise ValueError("a 4-bit weight's value is not a whole number in [0, 15]")
    return out


def unpack(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, d, m)`` of a packed operand of ``n`` outputs and ``k`` inputs (``q`` over whole groups)."""
    panels, groups = -(-n // PANEL), -(-k // GROUP)
    body = packed.view(torch.uint8).view(panels, groups, LINES + 1, 64)
    nibbles = body[:, :, :LINES].reshape(panels, groups, LINES, PANEL, 4).permute(0, 3, 1, 2, 4)
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=4).reshape(panels * PANEL, groups * GROUP)
    scales = body[:, :, LINES].contiguous().view(torch.float16).view(panels, groups, 2, PANEL)
    d, m = (scales[:, :, i].permute(0, 2, 1).reshape(panels * PANEL, groups) for i in (0, 1))
    return q[:n].contiguous(), d[:n].contiguous(), m[:n].contiguous()


def rows(packed: torch.Tensor, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The bfloat16 rows ``d · q + m`` of ``ids`` (shape ``ids.shape + (k,)``) of a packed operand."""
    flat = ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"row ids must lie in [0, {n})")
    return dequantize(packed, n, k)[flat].view(*ids.shape, k)


def dequantize(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The bfloat16 ``d · q + m`` [n, k] of a packed operand (for consumers of a plain weight)."""
    q, d, m = unpack(packed, n, k)
    w = q.float().view(n, -1, GROUP) * d.float()[..., None] + m.float()[..., None]
    return w.view(n, -1)[:, :k].to(torch.bfloat16)


def reference_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's result in plain PyTorch, bit for bit: bfloat16 rows ``x`` [M, K], ``(q, d, m) = quantize(W)``."""
    xq, sx = gemm_w8a8.quantize_rows(x)
    rows, groups = xq.shape[0], q.shape[1] // GROUP
    xg = F.pad(xq, (0, q.shape[1] - xq.shape[1])).view(rows, groups, GROUP).double()
    dots = torch.einsum("rgk,ngk->rng", xg, q.view(q.shape[0], groups, GROUP).double()).float()  # exact integers
    sums = xg.sum(dim=2).float()
    f = torch.zeros(rows, q.shape[0])
    for g in range(groups):  # in the kernel's order, each op rounded
        f = f + dots[:, :, g] * d[:, g].float()
        f = f + m[:, g].float()[None, :] * sums[:, g:g + 1]
    y = f * sx[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y ≈ F.linear(x, W, bias)`` in bfloat16 for rows ``x`` [..., K] through the kernel (``packed = pack(...)``)."""
    lib = _lib()
    assert lib is not None, "4-bit GEMM kernel is not available on this machine"
    return gemm_w8a8.call_linear(lib.pagellm_packed_linear_w4a8, x, packed, n, bias)


def packed_linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, n2: int) -> torch.Tensor | None:
    """``silu(g) * u`` of ``[g | u] = packed_linear(x, packed, n2)`` for bfloat16 rows ``x`` [m, K] and a packed
    gate/up weight (gate rows, then up rows) in one pass, bit for bit ``fused.silu_and_mul`` of that product; ``None``
    where the gate width is not whole panels of 16 (the caller makes the two calls)."""
    lib = _lib()
    assert lib is not None, "4-bit GEMM kernel is not available on this machine"
    return gemm_w8a8.call_linear_silu_mul(lib.pagellm_packed_linear_silu_mul_w4a8, x, packed, n2)


def quantize_parameter(param: torch.nn.Parameter, groups: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Quantize and pack a bfloat16 ``[N, K]`` weight Parameter in place (see the module docstring); or, where it
    holds a 4-bit checkpoint's integers (``model/weight_only.py``, ``model/gguf_blocks.py``), pack them with their
    groups' ``(d, m)`` (``pack_groups``)."""
    if not available():
        raise RuntimeError("quantization w4a8_int4 needs the 4-bit GEMM kernel, which needs a CPU with AVX-512 VNNI "
                           "and a C++ compiler; this machine has not both")
    if param.dtype != torch.bfloat16 or param.dim() != 2:
        raise ValueError(f"w4a8_int4 quantizes 2-D bfloat16 weights, got {param.dtype} {tuple(param.shape)}")
    n, k = param.shape
    param.data = quantize_pack(param.data) if groups is None else pack_groups(param.data, *groups)
    param.packed_shape = (n, k)  # type: ignore[attr-defined]
    param.weight_format = FORMAT  # type: ignore[attr-defined]
