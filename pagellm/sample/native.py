"""Fused temperature sampling over whole logit rows (``csrc/inverse_cdf.cpp``): the inverse-CDF draw of
``sampler.sample_inverse_cdf`` on ``softmax(logits / T)`` (first argmax where T is 0) in two passes over each row
and no float32 copies, cumulative sums or searches of the vocabulary: 12-23x less time than the torch sequence at
batches of 32 and 256 here (``benchmarks/sampling.py --kernel``).

``first_argmax_rows`` is greedy decoding's argmax in one vector pass per row, rows over the threads.

It serves rows without top-k, top-p or min-p, bfloat16 or float32, whose last dimension is contiguous; the
sampler keeps its torch path (the twin and test oracle) for everything else and where the library does not
build. The draw is the torch path's up to float rounding: a token may differ only where ``u`` × the total falls
within rounding of a boundary of the cumulative distribution.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagellm.ops.build import load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "inverse_cdf.cpp"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    try:
        lib = load_library(SOURCE)
    except (RuntimeError, OSError) as exc:
        logger.warning("fused sampling kernel unavailable (%s); using torch ops", exc)
        return None
    lib.pagellm_sample_inverse_cdf.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P]
    lib.pagellm_sample_inverse_cdf.restype = None
    lib.pagellm_first_argmax_rows.argtypes = [_P, _I, _I, _I, _I, _P]
    lib.pagellm_first_argmax_rows.restype = None
    return lib


def available() -> bool:
    return _lib() is not None


def _applies(logits: torch.Tensor) -> bool:
    """[B, V] CPU logits in bfloat16 or float32 whose last dimension is contiguous (any row stride), V < 2**31."""
    return (logits.dim() == 2 and logits.dtype in _DTYPES and logits.device.type == "cpu" and logits.stride(1) == 1
            and 0 < logits.shape[1] < 2**31)


def first_argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's first argmax as int64 [B] (what greedy decoding takes: ``logits.max(dim=-1).indices``, the
    twin, which runs on one thread and 4-8x slower at batches of 1-256 here), or ``None`` where the kernel
    does not apply. NaN is passed over (torch's max returns it instead): a row with no value above -inf gives 0."""
    if not _applies(logits):
        return None
    lib = _lib()
    if lib is None:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0]:
        lib.pagellm_first_argmax_rows(logits.data_ptr(), _DTYPES[logits.dtype], logits.shape[0], logits.shape[1],
                                      logits.stride(0), out.data_ptr())
    return out


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor | None:
    """Token ids [B] drawn from ``softmax(logits[b] / temperature[b])`` at ``uniforms[b]`` (argmax where the
    temperature is 0), or ``None`` where the kernel does not apply (dtype, layout, device, no library)."""
    if not _applies(logits):
        return None
    lib = _lib()
    if lib is None:
        return None
    temperature = temperature.to(torch.float32).contiguous()
    uniforms = uniforms.to(torch.float32).contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.pagellm_sample_inverse_cdf(logits.data_ptr(), _DTYPES[logits.dtype], logits.shape[0], logits.shape[1],
                                   logits.stride(0), temperature.data_ptr(), uniforms.data_ptr(), out.data_ptr())
    return out
