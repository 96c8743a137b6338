"""gpt-oss's GGUF files (llama.cpp's ``gpt-oss`` architecture), for ``model/gguf_convert.py``: each layer's experts
written back in the layout of gpt-oss's own checkpoint.

llama.cpp keeps a layer's experts as three stacked tensors, ``ffn_gate_exps`` and ``ffn_up_exps`` ``[experts, I,
H]`` and ``ffn_down_exps`` ``[experts, H, I]``, each with a bias (``[experts, I]``, ``[experts, H]``); gpt-oss's
checkpoint fuses gate and up into one ``gate_up_proj``, their outputs interleaved (gate the even ones).

Where every expert matrix is MXFP4 (llama.cpp's converter keeps the checkpoint's blocks, as in
``gpt-oss-20b-mxfp4.gguf``), they are written back as the MXFP4 checkpoint's own ``*_blocks`` and ``*_scales``
(uint8), which ``model/mxfp4.py`` reads (in bfloat16 they stay in 4 bits). A GGML MXFP4 block is 17 bytes: the E8M0
exponent, then 16 bytes whose low nibbles are the block's first 16 values and high nibbles its last 16; the
checkpoint's 16 bytes pair neighbours instead (the low nibble the even value). The exponents and the E2M1 codes are
the same numbers in both. Where any expert matrix is in another type, all of them are written in transformers' float
layout (``gate_up_proj`` ``[experts, H, 2I]``, ``down_proj`` ``[experts, I, H]``), dequantized to float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from pagellm.model.gguf_tensors import float_values

ARCH = "gpt-oss"
MXFP4 = "MXFP4"
_EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_BLOCK_BYTES = 17  # one E8M0 exponent and 32 E2M1 codes


def expert_tensor(gguf_name: str) -> tuple[int, str, str] | None:
    """``(layer, gate|up|down, weight|bias)`` of a stacked expert tensor's name, else ``None``."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _EXPERTS:
        return int(parts[1]), _EXPERTS[parts[2]], parts[3]
    return None


def all_mxfp4(tensors: dict[str, Any]) -> bool:
    """Whether the file keeps every expert matrix in MXFP4 (then the model is an MXFP4 checkpoint)."""
    kinds = {tensor.tensor_type.name for name, tensor in tensors.items()
             if (found := expert_tensor(name)) is not None and found[2] == "weight"}
    return kinds == {MXFP4}


def planned(tensors: dict[str, Any], packed: bool) -> list[tuple[int, Callable[[], list[tuple[str, np.ndarray]]]]]:
    """Each layer's experts as ``(bytes written, producer of its named arrays)``, for the converter's shards: as the
    checkpoint's MXFP4 blocks where ``packed`` (the config says so: ``all_mxfp4``), else as float32 values."""
    layers: dict[int, dict[tuple[str, str], Any]] = {}
    for name, tensor in tensors.items():
        if (found := expert_tensor(name)) is not None:
            layers.setdefault(found[0], {})[found[1:]] = tensor
    items = []
    for layer, parts in sorted(layers.items()):
        missing = {(p, s) for p in ("gate", "up", "down") for s in ("weight", "bias")} - parts.keys()
        if missing:
            raise ValueError(f"GGUF gpt-oss layer {layer} lacks its experts' {sorted(missing)}")
        size = sum(_bytes(tensor, packed) for tensor in parts.values())
        items.append((size, functools.partial(_layer_arrays, f"model.layers.{layer}.mlp.experts", parts, packed)))
    return items


def _bytes(tensor: Any, packed: bool) -> int:
    count = int(np.prod([int(d) for d in tensor.shape]))
    return count * _BLOCK_BYTES // 32 if packed and tensor.tensor_type.name == MXFP4 else 4 * count


def _layer_arrays(prefix: str, parts: dict[tuple[str, str], Any], packed: bool) -> list[tuple[str, np.ndarray]]:
    gate_bias, up_bias = (float_values(parts[p, "bias"]) for p in ("gate", "up"))
    arrays = [(f"{prefix}.gate_up_proj_bias", _interleave(gate_bias, up_bias)),
              (f"{prefix}.down_proj_bias", float_values(parts["down", "bias"]))]
    if packed:
        (gate_blocks, gate_scales), (up_blocks, up_scales), (down_blocks, down_scales) = (
            checkpoint_blocks(np.asarray(parts[p, "weight"].data)) for p in ("gate", "up", "down"))
        return arrays + [(f"{prefix}.gate_up_proj_blocks", _interleave(gate_blocks, up_blocks)),
                         (f"{prefix}.gate_up_proj_scales", _interleave(gate_scales, up_scales)),
                         (f"{prefix}.down_proj_blocks", down_blocks), (f"{prefix}.down_proj_scales", down_scales)]
    gate, up, down = (float_values(parts[p, "weight"]) for p in ("gate", "up", "down"))
    return arrays + [(f"{prefix}.gate_up_proj", np.ascontiguousarray(_interleave(gate, up).swapaxes(1, 2))),
                     (f"{prefix}.down_proj", np.ascontiguousarray(down.swapaxes(1, 2)))]


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``[experts, I, ...]`` twice → ``[experts, 2I, ...]``, gate's rows the even ones."""
    return np.ascontiguousarray(np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, *gate.shape[2:]))


def checkpoint_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGML MXFP4 rows (uint8 ``[..., rows, blocks · 17]``) → the checkpoint's ``(blocks [..., rows, blocks, 16],
    scales [..., rows, blocks])``."""
    raw = np.asarray(raw).view(np.uint8)
    if raw.shape[-1] % _BLOCK_BYTES:
        raise ValueError(f"MXFP4 rows of {raw.shape[-1]} bytes are not whole blocks of {_BLOCK_BYTES}")
    blocks = raw.reshape(*raw.shape[:-1], -1, _BLOCK_BYTES)
    nibbles = blocks[..., 1:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # value j, then value j + 16
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)), np.ascontiguousarray(blocks[..., 0])
