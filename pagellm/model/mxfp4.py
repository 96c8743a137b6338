"""MXFP4 checkpoints (the OCP microscaling format gpt-oss's are published in), read as their float equivalents.

gpt-oss keeps its experts' matrices in MXFP4 (``quantization_config.quant_method: mxfp4``): for a matrix ``X`` of
``[experts, out, in]``, ``X_blocks`` holds uint8 ``[experts, out, in / 32, 16]`` (two FP4 E2M1 values a byte, the
low nibble first) and ``X_scales`` uint8 ``[experts, out, in / 32]`` (one power of two per 32 values, E8M0: the
exponent biased by 127). ``weights`` pairs them as they stream from the files and yields each matrix dequantized
under the name and in the layout of the float checkpoint transformers would save (``X``, ``[experts, in, out]``),
the values exactly (an E2M1 value times a power of two is a bfloat16). The layers it leaves out (attention, the
router, the embeddings) are stored in bfloat16 and pass through.

In bfloat16, where the 4-bit kernel runs, the experts stay in 4 bits instead (``keep``: ``X`` comes as its codes,
``X_groups`` as each 32 inputs' ``(2^(e - 127), 0)``, which ``ops/gemm_mxfp4.py`` packs for its MXFP4 GEMM: the
checkpoint's values exactly, 5 bits a weight); elsewhere they come as values, and run as bfloat16 ones do (or
quantized again by ``--quantization``).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from pagellm.model.weight_only import GroupsDoNotFit
from pagellm.ops import gemm_mxfp4
from pagellm.ops.gemm_mxfp4 import E2M1

SCHEME = "mxfp4"
_BLOCKS, _SCALES = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[..., groups, 16]`` uint8 codes and ``[..., groups]`` uint8 exponents → ``[..., groups * 32]`` values."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or \
            blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks [..., groups, 16] and scales [..., groups] of uint8 expected; got "
                         f"{tuple(blocks.shape)} {blocks.dtype} and {tuple(scales.shape)} {scales.dtype}")
    table = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.ldexp(table[codes(blocks).long()], scales.to(torch.int32).sub(127).unsqueeze(-1))
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * 32).to(dtype)


def codes(blocks: torch.Tensor) -> torch.Tensor:
    """``[..., groups, 16]`` bytes → ``[..., groups, 32]`` E2M1 codes (uint8), the low nibble first."""
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32)


def kept(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pair as ``X`` (its codes ``[..., out, in]``) and ``X_groups`` (``[..., out, in / 32, 2]`` float32: each 32
    inputs' scale and a zero minimum); GroupsDoNotFit where a scale is no float16 (the kernel keeps ``d`` so)."""
    try:
        d = gemm_mxfp4.scales(scales).float()
    except ValueError as exc:
        raise GroupsDoNotFit(str(exc)) from None
    return codes(blocks).flatten(-2), torch.stack([d, torch.zeros_like(d)], dim=-1)


def weights(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
            keep: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """An MXFP4 checkpoint's tensors with each ``X_blocks`` / ``X_scales`` pair made ``X``: dequantized (in
    ``dtype``, bfloat16 by default) and transposed to ``[experts, in, out]``, as transformers lays the float
    checkpoint out, or with ``keep`` its codes in that layout and ``X_groups`` (``kept``); every other tensor as
    stored."""
    waiting: dict[str, torch.Tensor] = {}  # a pair's half that came first, by its name with the suffix
    for name, tensor in tensors:
        if not name.endswith((_BLOCKS, _SCALES)):
            yield name, tensor
            continue
        other = name[:-len(_BLOCKS)] + (_SCALES if name.endswith(_BLOCKS) else _BLOCKS)
        if other not in waiting:
            waiting[name] = tensor
            continue
        blocks, scales = (tensor, waiting.pop(other)) if name.endswith(_BLOCKS) else (waiting.pop(other), tensor)
        if keep:
            values, groups = kept(blocks, scales)
            yield name[:-len(_BLOCKS)], values.transpose(-1, -2)
            yield name[:-len(_BLOCKS)] + "_groups", groups
        else:
            yield name[:-len(_BLOCKS)], dequantize(blocks, scales, dtype or torch.bfloat16).transpose(-1, -2)
    if waiting:
        raise ValueError(f"MXFP4 checkpoint tensors without their other half: {', '.join(sorted(waiting))}")
