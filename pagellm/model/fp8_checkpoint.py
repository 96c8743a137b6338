"""FP8 checkpoints (float8 e4m3 weights with float32 scales), read into the float weights they stand for.

Two ways of writing them are read, the two that vLLM serves and that most FP8 models on the Hugging Face Hub use:

- **``quant_method: fp8``** (transformers' ``FineGrainedFP8Config``; DeepSeek-V3's and Qwen3's ``-FP8`` models):
  ``weight_block_size: [BN, BK]`` gives each block of BN outputs by BK inputs one scale, stored as
  ``<layer>.weight_scale_inv`` [ceil(N / BN), ceil(K / BK)] beside ``<layer>.weight`` (float8 [N, K]); without a
  block size one scale per matrix, ``<layer>.weight_scale``.
- **compressed-tensors ``format: float-quantized``** (llm-compressor's ``FP8``, ``FP8_DYNAMIC`` and
  ``FP8_BLOCK`` schemes, e.g. the ``-FP8-dynamic`` models): ``<layer>.weight_scale`` per matrix (``strategy:
  tensor``, one value), per output (``channel``, [N, 1]) or per block (``block``, ``block_structure``).

A layer's value is ``W = float(q) · scale`` of its block, computed in float32 (as transformers dequantizes these
checkpoints where it has no FP8 GEMM, and as compressed-tensors decompresses them) and handed on in the model's
dtype. The activations' scales (``input_scale``: a ``static`` activation scheme) and the KV cache's (``k_scale``,
``v_scale``) are dropped: the layers compute in the model's dtype, and the KV cache keeps its own format
(``--kv-cache-dtype``). ``--quantization`` then quantizes these weights as it quantizes a float checkpoint's.
Layers the config leaves out (``modules_to_not_convert``, ``ignore``: the LM head) are stored as float and pass as
they are; which layers are FP8 is read from their tensors' dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

SCHEME = "fp8"
_SCALES = ("weight_scale_inv", "weight_scale")
_DROPPED = ("input_scale", "k_scale", "v_scale", "q_scale")
_FP8 = (torch.float8_e4m3fn,)


@dataclass(frozen=True)
class Fp8Checkpoint:
    method: str  # "fp8" or "compressed-tensors"
    block: tuple[int, int] | None  # (outputs, inputs) per scale; None: the scale's shape says (tensor or channel)


def scheme(quant: dict[str, Any]) -> Fp8Checkpoint | None:
    """The FP8 scheme of a ``quantization_config``, ``None`` where it is no FP8 one; raises ``ValueError`` naming what
    pagellm does not read (float8 e5m2 weights, FP8 activations without FP8 weights)."""
    method = quant.get("quant_method")
    if method == "fp8":
        if str(quant.get("fmt", "e4m3")).lower() != "e4m3":
            raise ValueError(f"this fp8 checkpoint's weights are {quant.get('fmt')!r}; pagellm reads e4m3")
        block = quant.get("weight_block_size")
        return Fp8Checkpoint(method, (int(block[0]), int(block[1])) if block else None)
    if method != "compressed-tensors" or quant.get("format") != "float-quantized":
        return None
    weights = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
    if len(weights) != 1 or weights[0].get("type") != "float" or weights[0].get("num_bits") != 8 or \
            weights[0].get("strategy") not in ("tensor", "channel", "block"):
        raise ValueError("this compressed-tensors float-quantized checkpoint's scheme is not served: pagellm reads "
                         f"one group of 8-bit float weights, strategy tensor, channel or block; found {weights}")
    block = weights[0].get("block_structure")
    return Fp8Checkpoint(method, (int(block[0]), int(block[1])) if weights[0]["strategy"] == "block" else None)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 ``q · scale`` [N, K]: one scale per ``block`` (its last row and column blocks may be cut short), or
    one per matrix or per output row, as the scale's shape says."""
    n, k = q.shape
    scale = scale.float()
    if block is not None and scale.numel() > 1:
        rows, cols = -(-n // block[0]), -(-k // block[1])
        if tuple(scale.shape) != (rows, cols):
            raise ValueError(f"an FP8 layer of [{n}, {k}] in blocks of {list(block)} needs [{rows}, {cols}] scales; "
                             f"it has {list(scale.shape)}")
        scale = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    elif scale.numel() not in (1, n):
        raise ValueError(f"an FP8 layer of [{n}, {k}] has {list(scale.shape)} scales; pagellm reads one per matrix, "
                         "per output row or per block")
    else:
        scale = scale.reshape(-1, 1) if scale.numel() == n else scale.reshape(1, 1)
    return q.float() * scale


def weights(stream: Iterable[tuple[str, torch.Tensor]], fp8: Fp8Checkpoint,
            dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint ``stream`` with each FP8 layer's weight and scale turned into ``<layer>.weight`` (in ``dtype``,
    float32 by default), once both have come; the activations' and KV cache's scales dropped."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        layer, _, part = name.rpartition(".")
        if part in _DROPPED:
            continue
        if not (part in _SCALES or (part == "weight" and tensor.dtype in _FP8)):
            yield name, tensor
            continue
        got = pending.setdefault(layer, {})
        got[part] = tensor
        scale = next((got[s] for s in _SCALES if s in got), None)
        if "weight" in got and scale is not None:
            pending.pop(layer)
            yield f"{layer}.weight", dequantize(got["weight"], scale, fp8.block).to(dtype or torch.float32)
    for layer, got in pending.items():
        lacks = "a weight_scale_inv or weight_scale" if "weight" in got else "its float8 weight"
        raise ValueError(f"the FP8 checkpoint's layer {layer!r} lacks {lacks}")
