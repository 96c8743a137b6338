"""Checkpoints in the compressed-tensors format (what llm-compressor writes and vLLM serves): W8A8 int8 ones read and
written here, weight-only ``pack-quantized`` ones (W4A16) written here and read by ``model/weight_only.py``.

Such a checkpoint's ``config.json`` carries a ``quantization_config`` with ``quant_method: compressed-tensors``; its
one scheme pagellm serves is the one ``--quantization w8a8_int8`` computes: int8 weights, symmetric, one scale per
output channel (``strategy: channel``), and int8 activations quantized per token at run time (``dynamic: true``,
``strategy: token``), stored as ``format: int-quantized``. Each quantized linear layer then has ``<name>.weight``
(int8 [N, K]) and ``<name>.weight_scale`` (float [N, 1]); the layers the config's ``ignore`` names (the LM head) keep
their float weights. ``scheme_of`` reads the config (and refuses other schemes with what it found); the model loads
``Q`` and the scales as they are (``model/layers/linear.py``), with no second rounding.

``write_w8a8`` makes such a checkpoint from a float one, with the weights quantized as ``--quantization w8a8_int8``
quantizes the bfloat16 model's at load (``ops.gemm_w8a8.quantize``), the same int8 weights and scales: the
benchmarks give vLLM the weights pagellm runs. ``write_w4a16`` makes a W4A16 one (round to nearest, groups of 128
by default), the checkpoint a user gets from llm-compressor's ``W4A16`` scheme without its calibration.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from pagellm.model import fp8_checkpoint, weight_only
from pagellm.ops import gemm_w8a8

SCHEME = gemm_w8a8.FORMAT
# The decoder layers' linear layers, as Hugging Face names them.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def scheme_of(hf_config: dict[str, Any]) -> str | None:
    """``"w8a8_int8"`` for a compressed-tensors W8A8 int8 checkpoint, ``"wna16"`` for a weight-only one (GPTQ, AWQ,
    compressed-tensors pack-quantized: ``model/weight_only.py``), ``"mxfp4"`` for gpt-oss's (``model/mxfp4.py``),
    ``"fp8"`` for an FP8 one (``model/fp8_checkpoint.py``), ``None`` for an unquantized one; raises
    ``ValueError`` naming what it found for any other quantization."""
    quant = hf_config.get("quantization_config")
    if not quant:
        return None
    if weight_only.scheme(quant) is not None:
        return weight_only.SCHEME
    method = quant.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts: kept in 4 bits, or dequantized as they load (``model/mxfp4.py``)
        return "mxfp4"
    if fp8_checkpoint.scheme(quant) is not None:  # dequantized as they load (``model/fp8_checkpoint.py``)
        return fp8_checkpoint.SCHEME
    if method != "compressed-tensors":
        raise ValueError(f"this checkpoint is quantized with {method!r}; pagellm reads GPTQ, AWQ, FP8 and compressed-"
                         "tensors (W8A8 int8, pack-quantized, float-quantized) checkpoints, or quantizes float ones "
                         "itself (--quantization w8a8_int8 or w4a8_int4)")
    groups = list((quant.get("config_groups") or {}).values())
    found = [(g.get("weights") or {}, g.get("input_activations") or {}) for g in groups]
    if quant.get("format", "int-quantized") != "int-quantized" or len(found) != 1 or \
            any(w.get(k) != v for k, v in _WEIGHTS.items() for w, _ in found) or \
            any(a.get(k) != v for k, v in _ACTIVATIONS.items() for _, a in found):
        raise ValueError("this compressed-tensors checkpoint's scheme is not served: pagellm serves format "
                         "pack-quantized (weight-only) and format "
                         f"int-quantized with one group with weights {_WEIGHTS} and input_activations {_ACTIVATIONS}; "
                         f"found format {quant.get('format')!r} and {found}")
    return SCHEME


def _quant_config() -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**_WEIGHTS, "group_size": None},
                                          "input_activations": {**_ACTIVATIONS, "group_size": None},
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}


def is_linear(name: str) -> bool:
    """Whether a checkpoint tensor is a decoder linear layer's weight (what a quantized checkpoint quantizes)."""
    return name.endswith(".weight") and any(f".{linear}." in name for linear in LINEARS)


def write_w8a8(src: Path, out: Path) -> Path:
    """A compressed-tensors W8A8 int8 copy of the float checkpoint ``src`` (a Hugging Face directory) in ``out``:
    the decoder layers' linear weights quantized, everything else (embedding, norms, LM head, tokenizer) as it was."""
    def layer(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = gemm_w8a8.quantize(weight)
        return {name: q, name + "_scale": scale[:, None].contiguous()}
    return write_quantized(src, out, _quant_config(), layer)


def write_w4a16(src: Path, out: Path, group_size: int = 128) -> Path:
    """A compressed-tensors W4A16 copy of ``src`` in ``out``, as llm-compressor's round-to-nearest ``W4A16`` scheme
    writes one (``format: pack-quantized``): each ``group_size`` inputs of a decoder linear weight get a bfloat16
    scale ``max |W| / 7.5`` and 4-bit values ``round(W / s)`` in [-8, 7], packed eight to an int32 along the inputs
    (value ``i`` in bits ``4i``, offset by 8); served dequantized, or with ``--quantization w4a8_int4`` as it is."""
    def layer(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = weight.shape
        if k % group_size:
            raise ValueError(f"{name} has {k} inputs, not whole groups of {group_size}")
        w = weight.float().view(n, k // group_size, group_size)
        scale = (w.abs().amax(dim=2) / 7.5).to(torch.bfloat16)
        step = torch.where(scale > 0, scale.float(), 1.0)
        q = torch.round(w / step[..., None]).clamp_(-8, 7).to(torch.int64) + 8
        base = name.removesuffix(".weight")
        return {f"{base}.weight_packed": pack_int32(q.view(n, k // 8, 8)), f"{base}.weight_scale": scale,
                f"{base}.weight_shape": torch.tensor([n, k])}
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
               "dynamic": False}
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                            "output_activations": None}},
              "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}
    return write_quantized(src, out, config, layer)


def pack_int32(values: torch.Tensor) -> torch.Tensor:
    """[..., 8] values of 4 bits packed into int32 words [...], value ``i`` in bits ``4i``."""
    words = (values.to(torch.int64) << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def write_quantized(src: Path, out: Path, quant_config: dict[str, Any],
                    layer: Callable[[str, torch.Tensor], dict[str, torch.Tensor]]) -> Path:
    """``src`` with each decoder linear weight replaced by ``layer(name, its bfloat16 weight)``'s tensors (from
    bfloat16, as the bfloat16 model's weights are quantized at load) and ``quant_config``."""
    from safetensors.torch import save_file

    from pagellm.model.loader import iter_weights, load_hf_config

    config = load_hf_config(src)
    if config.get("quantization_config"):
        raise ValueError(f"{src} is quantized already")
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iter_weights(src):
        tensors.update(layer(name, tensor.to(torch.bfloat16)) if is_linear(name) else {name: tensor.contiguous()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quant_config}, indent=2))
    for path in src.iterdir():  # tokenizer and generation files
        if path.is_file() and path.name != "config.json" and not path.name.endswith(".safetensors") and \
                path.name != "model.safetensors.index.json":
            shutil.copy2(path, out / path.name)
    return out
