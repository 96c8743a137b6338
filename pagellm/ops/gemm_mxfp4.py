"""MXFP4 weights kept in 4 bits (gpt-oss's experts, as its checkpoints store them), times bfloat16 activations, with
``reference_linear`` as the plain-PyTorch twin and test oracle.

An MXFP4 matrix holds, per 32 inputs of an output row, 32 four-bit E2M1 codes (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6,
the sign the top bit) and one power-of-two scale ``2^(e - 127)``. That is the 4-bit kernel's layout
(``gemm_w4a8.pack``: nibbles per group of 32, a float16 ``d`` and ``m`` per group) with ``d`` the scale, exact in
float16 for ``e - 127`` in [-24, 15] (``scales`` refuses others), and ``m`` 0; the W4A16 kernel
(``csrc/packed_gemm_w4a8.cpp``) then looks each nibble up as its E2M1 value instead of its integer (its
``pagellm_packed_linear_mxfp4`` entries), so ``P = Σ e2m1(q) · x`` in float32, ``f += P · d``: ``x · Wᵀ`` over the
checkpoint's own values up to float32 rounding, at 5 bits a weight (bfloat16 copies take 16).

A model with MXFP4 layers (``model/mxfp4.py``) packs those with ``quantize_parameter(param, (d, m))``; its other
layers, stored in bfloat16, are packed for the bfloat16 kernel as they are (``quantize_parameter(param)``): this
format is a checkpoint's, not a quantization pagellm computes from float weights.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagellm.ops import gemm_w4a8, gemm_w4a16, gemm_w8a8
from pagellm.ops.build import entry_address

FORMAT = "w4a16_mxfp4"
GROUP = gemm_w4a8.GROUP
# E2M1's sixteen values, by their 4-bit code (the sign the top bit)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
build_job = gemm_w4a8.build_job  # the W4A16 library's entries
runs_here = gemm_w4a16.runs_here
available = gemm_w4a16.available
unpack, pack_groups = gemm_w4a8.unpack, gemm_w4a8.pack_groups  # the same layout


@functools.lru_cache(maxsize=1)
def _lib():  # noqa: ANN202
    """The W4A16 library, its MXFP4 entries declared with the W4A16 ones' C signatures."""
    lib = gemm_w4a16._lib()  # noqa: SLF001 (one library serves both)
    assert lib is not None, "the MXFP4 GEMM needs the 4-bit kernel with AVX-512 BF16 (and VNNI); this machine has not"
    for name in ("packed_linear", "packed_linear_silu_mul"):
        ours, theirs = getattr(lib, f"pagellm_{name}_mxfp4"), getattr(lib, f"pagellm_{name}_w4a16")
        ours.argtypes, ours.restype = theirs.argtypes, theirs.restype
    return lib


def entry_addresses() -> tuple[int, int]:
    """The kernel's C entries, with the bfloat16 kernel's signatures (for the experts' and the stack's calls)."""
    lib = _lib()
    return entry_address(lib.pagellm_packed_linear_mxfp4), entry_address(lib.pagellm_packed_linear_silu_mul_mxfp4)


def scales(exponents: torch.Tensor) -> torch.Tensor:
    """MXFP4's E8M0 exponents (uint8, ``2^(e - 127)``) as the kernel's float16 ``d``; ValueError where one is not a
    float16 exactly (``e - 127`` outside [-24, 15])."""
    shift = exponents.to(torch.int32) - 127
    if shift.numel() and (int(shift.min()) < -24 or int(shift.max()) > 15):
        raise ValueError(f"an MXFP4 scale 2^{int(shift.min())}..2^{int(shift.max())} is not exact in float16 "
                         "(2^-24..2^15); these weights cannot stay in 4 bits")
    return torch.ldexp(torch.ones_like(shift, dtype=torch.float32), shift).half()


def values(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``d · e2m1(code)`` of codes [N, 32·G] (uint8) and their groups' scales [N, G]."""
    n = codes.shape[0]
    table = torch.tensor(E2M1, dtype=torch.float32)
    return (table[codes.long()].view(n, -1, GROUP) * d.float()[..., None]).view(n, -1)


def pack(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """The kernel's operand of an MXFP4 matrix: codes [N, K] (uint8, K whole groups) and exponents [N, K / 32]."""
    d = scales(exponents)
    return pack_groups(codes.to(torch.bfloat16), d, torch.zeros_like(d))


def dequantize(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The bfloat16 weight [n, k] of a packed operand (for consumers of a plain weight): the checkpoint's values."""
    q, d, _ = unpack(packed, n, k)
    return values(q, d)[:, :k].to(torch.bfloat16)


def rows(packed: torch.Tensor, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The bfloat16 rows of ``ids`` (shape ``ids.shape + (k,)``) of a packed operand."""
    flat = ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"row ids must lie in [0, {n})")
    return dequantize(packed, n, k)[flat].view(*ids.shape, k)


def reference_linear(x: torch.Tensor, codes: torch.Tensor, exponents: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x · Wᵀ (+ bias)`` in float32 over the MXFP4 matrix's values, rounded to bfloat16: the kernel's result up to
    float32 rounding."""
    y = F.linear(x.float(), values(codes, scales(exponents)))
    return (y if bias is None else y + bias.float()).to(torch.bfloat16)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y ≈ F.linear(x, W, bias)`` in bfloat16 for rows ``x`` [..., K] through the kernel."""
    return gemm_w8a8.call_linear(_lib().pagellm_packed_linear_mxfp4, x, packed, n, bias)


def packed_linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, n2: int) -> torch.Tensor | None:
    """``silu(g) * u`` of ``[g | u] = packed_linear(x, packed, n2)`` in one pass; ``None`` where the gate width is not
    whole panels of 16."""
    return gemm_w8a8.call_linear_silu_mul(_lib().pagellm_packed_linear_silu_mul_mxfp4, x, packed, n2)


def quantize_parameter(param: torch.nn.Parameter, groups: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Pack a layer's MXFP4 codes (held as the bfloat16 values 0..15 of its weight) with their groups' ``(d, m)``
    for this kernel; a layer that came in bfloat16 (``groups`` None) is packed for the bfloat16 kernel as it is."""
    from pagellm.ops import gemm  # gemm lists this module among its formats

    if groups is None:
        gemm.pack_parameter(param)
        return
    if not available():
        raise RuntimeError("the MXFP4 GEMM needs the 4-bit kernel with AVX-512 BF16 (and VNNI) and a C++ compiler")
    n, k = param.shape
    param.data = pack_groups(param.data, *groups)
    param.packed_shape = (n, k)  # type: ignore[attr-defined]
    param.weight_format = FORMAT  # type: ignore[attr-defined]
