"""Fused bfloat16 element-wise ops of the Llama block (``csrc/fused.cpp``): residual add + RMSNorm, SiLU·up, and
rotary embeddings, one pass over memory and one call each instead of several torch ops; and, at load, a GGUF's
blocks to float32 or bfloat16 (``dequantize_gguf``, gguf's values bit for bit; its twin is in
``model/gguf_blocks.py``).

Each op serves bfloat16 tensors in the layouts documented below and returns ``None`` for anything else (other
dtypes, layouts, or a machine where the library does not build), so the calling layer runs its plain-PyTorch
twin, which is also the op's test oracle. float32 never takes these paths: float32 runs match transformers bit for
bit through the torch code.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagellm.ops import build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "fused.cpp"
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    try:
        lib = build.load_library(SOURCE)
    except (RuntimeError, OSError) as exc:
        logger.warning("fused element-wise kernels unavailable (%s); using torch ops", exc)
        return None
    return bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures of a build of ``csrc/fused.cpp``; returns ``lib`` (the tests also bind an AVX2-only
    build)."""
    lib.pagellm_add_rms_norm_bf16.argtypes = [_P, _P, _P, _I, _I, _F, _P, _P]
    lib.pagellm_add_layer_norm_bf16.argtypes = [_P, _P, _P, _I, _I, _F, _P, _P]
    lib.pagellm_silu_and_mul_bf16.argtypes = [_P, _I, _I, _P]
    lib.pagellm_clamped_swiglu_bf16.argtypes = [_P, _I, _I, _F, _F, _P]
    lib.pagellm_gelu_tanh_and_mul_bf16.argtypes = [_P, _I, _I, _P]
    lib.pagellm_rotary_bf16.argtypes = [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P]
    lib.pagellm_dequantize_gguf.argtypes = [_P, _I, _I, _I, _P, _I]
    lib.pagellm_simd_exp_f32.argtypes = [_P, _I, _I, _P]
    lib.pagellm_simd_exp_f32.restype = _I
    for fn in (lib.pagellm_add_rms_norm_bf16, lib.pagellm_silu_and_mul_bf16, lib.pagellm_rotary_bf16,
               lib.pagellm_dequantize_gguf, lib.pagellm_gelu_tanh_and_mul_bf16, lib.pagellm_add_layer_norm_bf16):
        fn.restype = None
    return lib


def available() -> bool:
    return _lib() is not None


def _bf16_rows(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.dim() == 2 and t.is_contiguous() for t in tensors)


def _residual_norm(kernel: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A norm with the residual add fused in (``kernel``: its entry), over contiguous bf16 [T, n] rows, else None."""
    if not _bf16_rows(x) or (residual is not None and not _bf16_rows(residual)) or weight.dtype != torch.bfloat16:
        return None
    lib = _lib()
    if lib is None:
        return None
    out, res = torch.empty_like(x), torch.empty_like(x)
    getattr(lib, kernel)(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                         x.shape[0], x.shape[1], eps, out.data_ptr(), res.data_ptr())
    return out, res


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(weight * norm(x + residual), x + residual)`` for contiguous bf16 [T, n] rows, else ``None``."""
    return _residual_norm("pagellm_add_rms_norm_bf16", x, residual, weight, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Cohere's LayerNorm as ``add_rms_norm`` takes it: ``(weight * layer_norm(x + residual), x + residual)`` for
    contiguous bf16 [T, n] rows, else ``None``."""
    return _residual_norm("pagellm_add_layer_norm_bf16", x, residual, weight, eps)


def _gated(kernel: str, gate_up: torch.Tensor, *extra: float) -> torch.Tensor | None:
    """A gating kernel (``kernel``: its entry) over ``gate_up = [gate | up]``, a contiguous bf16 [T, 2n], into
    [T, n]; else None."""
    lib = _lib() if _bf16_rows(gate_up) else None
    if lib is None:
        return None
    half = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], half, dtype=torch.bfloat16)
    getattr(lib, kernel)(gate_up.data_ptr(), gate_up.shape[0], half, *extra, out.data_ptr())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` where ``gate_up = [gate | up]`` is a contiguous bf16 [T, 2n], else ``None``."""
    return _gated("pagellm_silu_and_mul_bf16", gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """Gemma's GeGLU, ``gelu(gate, approximate="tanh") * up`` where ``gate_up = [gate | up]`` is a contiguous bf16
    [T, 2n], else ``None``."""
    return _gated("pagellm_gelu_tanh_and_mul_bf16", gate_up)


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor | None:
    """gpt-oss's ``(clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha * g))`` with ``g = min(gate, limit)`` where
    ``gate_up = [gate | up]`` is a contiguous bf16 [T, 2n], else ``None``."""
    return _gated("pagellm_clamped_swiglu_bf16", gate_up, limit, alpha)


def _head_rows(t: torch.Tensor) -> bool:
    """[T, heads, D] with heads and D packed (rows may be strided: views into the fused qkv output)."""
    return t.dtype == torch.bfloat16 and t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotated (q, k) as new contiguous tensors ("rotate half" layout) over the first ``cos.shape[1]`` dimensions of
    each head (the rest copied), or ``None`` where the op does not apply."""
    rot_dim = cos.shape[-1]
    if not (_head_rows(q) and _head_rows(k) and _bf16_rows(cos, sin) and positions.dtype == torch.int64
            and positions.is_contiguous() and rot_dim % 2 == 0 and rot_dim <= q.shape[2]):
        return None
    lib = _lib()
    if lib is None:
        return None
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    lib.pagellm_rotary_bf16(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(), sin.data_ptr(),
                            positions.data_ptr(), q.shape[0], q.shape[1], k.shape[1], q.shape[2], rot_dim,
                            q_out.data_ptr(), k_out.data_ptr())
    return q_out, k_out


# The GGUF Q4 block types, which the 4-bit kernels take as integers and groups: block type → (inputs per block, bytes
# per block, where its nibbles start, bytes per run of nibbles: a run's low nibbles are its first inputs, its high
# nibbles the next as many). ``model/gguf_blocks.py`` decodes them in torch.
Q4_LAYOUTS = {"Q4_0": (32, 18, 2, 16), "Q4_1": (32, 20, 4, 16), "Q4_K": (256, 144, 16, 32)}
# Every block type dequantize_gguf reads, in the C entry's numbering (csrc/gguf_blocks.h's kBlockTypes): (inputs,
# bytes) per block. Their values are gguf's ``dequantize``'s.
GGUF_BLOCKS = {**{kind: layout[:2] for kind, layout in Q4_LAYOUTS.items()}, "Q8_0": (32, 34), "Q5_0": (32, 22),
               "Q5_1": (32, 24), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q2_K": (256, 84), "Q3_K": (256, 110),
               "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "F16": (1, 2), "BF16": (1, 2)}


def dequantize_gguf(raw: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32,
                    out: torch.Tensor | None = None) -> torch.Tensor | None:
    """[N, K] values of a matrix's GGUF blocks ``raw`` (uint8 [N, bytes per row]) of block type ``kind``
    (``GGUF_BLOCKS``: the 4- and 5-bit types, Q8_0, the K-quants, IQ4, float16 and bfloat16), in float32 (gguf's
    ``dequantize`` bit for bit) or rounded to bfloat16 (``dtype``), in one pass from the blocks' bytes, into ``out``
    where given (contiguous [N, K] of ``dtype``). ``None`` where the library does not build, or is not built yet: a
    cold start's load does not wait for its compile (the caller's twin runs)."""
    lib = _lib() if build.library_built(SOURCE) else None
    if lib is None:
        return None
    values, size = GGUF_BLOCKS[kind]
    rows, row_bytes = raw.shape
    if raw.dtype != torch.uint8 or row_bytes % size or dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize_gguf takes uint8 rows of whole {size}-byte {kind} blocks, into float32 or "
                         f"bfloat16, got {raw.dtype} {tuple(raw.shape)} into {dtype}")
    shape = (rows, row_bytes // size * values)
    if out is not None and (out.shape != shape or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"dequantize_gguf writes contiguous {dtype} {shape}, not {out.dtype} {tuple(out.shape)}")
    raw = raw.contiguous()
    out = torch.empty(shape, dtype=dtype) if out is None else out
    lib.pagellm_dequantize_gguf(raw.data_ptr(), rows, row_bytes, list(GGUF_BLOCKS).index(kind), out.data_ptr(),
                                dtype == torch.bfloat16)
    return out


def copy_float16(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy a float16 ``src`` into a bfloat16 ``dst`` of the same shape, both contiguous, in one native pass (torch's
    ``copy_`` takes three times as long); ``False`` where that does not apply or the library is not built yet (the
    caller copies). Rounds as torch does."""
    if not (src.dtype == torch.float16 and dst.dtype == torch.bfloat16 and src.shape == dst.shape
            and src.is_contiguous() and dst.is_contiguous() and src.dim() >= 1 and src.numel()):
        return False
    rows = src.numel() // src.shape[-1]
    return dequantize_gguf(src.view(rows, -1).view(torch.uint8), "F16", torch.bfloat16, dst.view(rows, -1)) is not None


def simd_exp(x: torch.Tensor, base2: bool = False) -> torch.Tensor | None:
    """The native kernels' vector exponentials (``csrc/simd_exp.h``) of a contiguous float32 tensor: e^x
    (``exp16``: SiLU, the decode walk's softmax) or, with ``base2``, 2^x (``exp2_16``: the flash tiles' softmax);
    None where the library is missing or was built without AVX-512. For their accuracy tests."""
    lib = _lib()
    if lib is None or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    out = torch.empty_like(x)
    return out if lib.pagellm_simd_exp_f32(x.data_ptr(), x.numel(), int(base2), out.data_ptr()) else None
