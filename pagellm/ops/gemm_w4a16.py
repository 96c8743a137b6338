"""4-bit weights times bfloat16 activations (``--quantization w4a16_int4``; W4A16, the scheme of GPTQ, AWQ and
compressed-tensors' weight-only checkpoints), over the 4-bit kernel's packed weights, with ``reference_linear`` as
its plain-PyTorch twin and test oracle.

The weights are ``gemm_w4a8``'s, in the same layout: groups of 32 inputs per output column with a float16 scale
``d`` and minimum ``m``, ``W ≈ d · q + m`` (``quantize``, ``pack``, ``unpack``, ``dequantize`` and ``rows`` are that
module's). The activations are not quantized: per group the kernel (``csrc/packed_gemm_w4a8.cpp``, its W4A16
entries) takes ``P = Σ q · x`` in float32 with AVX-512 BF16 ``vdpbf16ps`` (each nibble an exact bfloat16), then
``f += P · d`` and ``f += m · S`` with ``S`` the group's sum of ``x``; ``y = f (+ bias)`` in bfloat16. That is
``x · Wᵀ`` over the dequantized weights up to float32 rounding (``reference_linear`` computes it in float32 from
``d · q + m``), with a decoding step reading the 4-bit weights' bytes: what a W4A16 checkpoint means, at 5/16 of
bfloat16's bytes, without W4A8's int8 rounding of the activations.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from pagellm.ops import gemm_w4a8, gemm_w8a8
from pagellm.ops.build import cpu_flags, entry_address
from pagellm.ops.gemm_w4a8 import (GROUP, dequantize, pack, quantize, quantize_pack, rows,  # noqa: F401
                                   unpack)  # the same weights

FORMAT = "w4a16_int4"
build_job = gemm_w4a8.build_job  # one library: the W4A16 entries are built beside the W4A8 ones


def runs_here() -> bool:
    """Whether this CPU has the kernel's instructions: the 4-bit kernel's (AVX-512 VNNI and BW) and AVX-512 BF16."""
    return gemm_w8a8.runs_here() and "avx512_bf16" in cpu_flags().split()


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    return gemm_w8a8.load(build_job(), "w4a16", "4-bit W4A16 GEMM kernel") if runs_here() else None


def available() -> bool:
    return _lib() is not None


def entry_addresses() -> tuple[int, int]:
    """The kernel's C entries for the native decoder stack and the experts (the bfloat16 kernel's signatures)."""
    lib = _lib()
    assert lib is not None, "4-bit W4A16 GEMM kernel is not available on this machine"
    return entry_address(lib.pagellm_packed_linear_w4a16), entry_address(lib.pagellm_packed_linear_silu_mul_w4a16)


def reference_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x · Wᵀ (+ bias)`` in float32 over ``W = d · q + m`` (``(q, d, m) = quantize(W)``), rounded to bfloat16:
    the kernel's result up to float32 rounding."""
    n, k = q.shape
    w = q.float().view(n, -1, GROUP) * d.float()[..., None] + m.float()[..., None]
    y = F.linear(F.pad(x.float(), (0, k - x.shape[-1])), w.view(n, k))
    return (y if bias is None else y + bias.float()).to(torch.bfloat16)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y ≈ F.linear(x, W, bias)`` in bfloat16 for rows ``x`` [..., K] through the kernel (``packed = pack(...)``)."""
    lib = _lib()
    assert lib is not None, "4-bit W4A16 GEMM kernel is not available on this machine"
    return gemm_w8a8.call_linear(lib.pagellm_packed_linear_w4a16, x, packed, n, bias)


def packed_linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, n2: int) -> torch.Tensor | None:
    """``silu(g) * u`` of ``[g | u] = packed_linear(x, packed, n2)`` in one pass, bit for bit that product followed by
    ``fused.silu_and_mul``; ``None`` where the gate width is not whole panels of 16."""
    lib = _lib()
    assert lib is not None, "4-bit W4A16 GEMM kernel is not available on this machine"
    return gemm_w8a8.call_linear_silu_mul(lib.pagellm_packed_linear_silu_mul_w4a16, x, packed, n2)


def quantize_parameter(param: torch.nn.Parameter, groups: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Quantize and pack a bfloat16 ``[N, K]`` weight Parameter in place as ``gemm_w4a8`` does (or pack the 4-bit
    checkpoint's integers it holds with their groups' ``(d, m)``), for this kernel."""
    if not available():
        raise RuntimeError("quantization w4a16_int4 needs the 4-bit GEMM kernel with AVX-512 BF16 (and VNNI) and a C++ "
                           "compiler; this machine has not all of them")
    if param.dtype != torch.bfloat16 or param.dim() != 2:
        raise ValueError(f"{FORMAT} quantizes 2-D bfloat16 weights, got {param.dtype} {tuple(param.shape)}")
    gemm_w4a8.quantize_parameter(param, groups)
    param.weight_format = FORMAT  # type: ignore[attr-defined]
