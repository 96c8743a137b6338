"""FP8 checkpoints (``model/fp8_checkpoint.py``): ``quant_method: fp8`` (per block or per matrix) and compressed-tensors
``float-quantized`` (per matrix, per output, per block).

The checkpoints are written here from a tiny random model's weights, each layer's float8 values and scales as the
formats store them. The reference weights are the libraries' own: transformers dequantizes an ``fp8`` checkpoint on a
CPU, and with compressed-tensors decompresses a ``float-quantized`` one. pagellm must load exactly those weights
(float32), and serve the checkpoint with transformers' greedy tokens over it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from safetensors.torch import load_file
from test_parity import _prompts, assert_greedy_parity, run
from test_weight_only import LINEARS, _write

from pagellm import LLM
from pagellm.model import fp8_checkpoint
from pagellm.model.compressed_tensors import scheme_of
from pagellm.model.loader import iter_weights

FP8_MAX = 448.0  # float8 e4m3's largest value
# (format, scale granularity): blocks that do not divide the tiny model's matrices (their last ones cut short)
KINDS = [("fp8", (16, 32)), ("fp8", None), ("ct", "tensor"), ("ct", "channel"), ("ct", (24, 40))]


def _blocked(w: torch.Tensor, block: tuple[int, int], scale: torch.Tensor) -> torch.Tensor:
    """A per-block [ceil(N / BN), ceil(K / BK)] tensor spread over [N, K]."""
    n, k = w.shape
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def _quantize(w: torch.Tensor, granularity) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 values, float32 scales) of ``w`` at ``granularity`` (None or "tensor": one scale; "channel": one per
    output; a block shape: one per block)."""
    w = w.float()
    n, k = w.shape
    if isinstance(granularity, tuple):
        bn, bk = granularity
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.zeros(rows * bn, cols * bk).index_put_((torch.arange(n)[:, None], torch.arange(k)), w.abs())
        scale = padded.view(rows, bn, cols, bk).amax((1, 3)) / FP8_MAX
        spread = _blocked(w, granularity, scale)
    elif granularity == "channel":
        scale = spread = w.abs().amax(1, keepdim=True) / FP8_MAX
    else:
        scale = (w.abs().amax() / FP8_MAX).reshape(1) if granularity == "tensor" else w.abs().amax() / FP8_MAX
        spread = scale
    return (w / spread).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _config(fmt: str, granularity) -> dict:
    if fmt == "fp8":
        # per block with activations scaled as they come (Qwen3's, DeepSeek's); per matrix with static activation
        # scales (AutoFP8's)
        return {"quant_method": "fp8", "activation_scheme": "dynamic" if granularity else "static", "fmt": "e4m3",
                "weight_block_size": list(granularity) if granularity else None}
    block = isinstance(granularity, tuple)
    weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block" if block else granularity,
                               block_structure=list(granularity) if block else None)
    activations = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=weights, input_activations=activations)}, format="float-quantized",
        quantization_status="compressed", ignore=["lm_head"])
    return {**config.model_dump(), "quant_method": "compressed-tensors"}


def _checkpoint(src: Path, out: Path, fmt: str, granularity) -> Path:
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        layer = name.removesuffix(".weight")
        if not (name.endswith(".weight") and layer.split(".")[-1] in LINEARS):
            tensors[name] = w
            continue
        q, scale = _quantize(w, granularity)
        scale_name = "weight_scale_inv" if fmt == "fp8" and granularity else "weight_scale"
        tensors.update({name: q, f"{layer}.{scale_name}": scale})
        if fmt == "ct" or not granularity:  # a static scheme's activation scales (dropped; here as a stand-in)
            tensors[f"{layer}.input_scale"] = torch.ones(1)
    config = json.loads((src / "config.json").read_text())
    return _write(src, out, {**config, "quantization_config": _config(fmt, granularity)}, tensors)


def _library_weights(src: Path, ckpt: Path, fmt: str, granularity) -> dict[str, torch.Tensor]:
    """transformers' float32 weights of ``ckpt``: it dequantizes an ``fp8`` checkpoint in blocks itself, and
    decompresses a compressed-tensors one with that library; an ``fp8`` one per matrix, which it does not read, is
    read as its compressed-tensors twin (the same values and scales) is decompressed."""
    if fmt == "fp8" and not granularity:
        return _library_weights(src, _checkpoint(src, ckpt.parent / "ct-twin", "ct", "tensor"), "ct", "tensor")
    quant = {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)} if fmt == "ct" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, **quant)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=KINDS, ids=lambda kind: f"{kind[0]}-{kind[1]}")
def fp8(request, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(checkpoint, a float32 checkpoint of the library's weights, what transformers generates from: the checkpoint
    itself where it reads it, an ``fp8`` one in blocks; else those weights)."""
    fmt, granularity = request.param
    tmp = tmp_path_factory.mktemp(f"fp8-{fmt}")
    ckpt = _checkpoint(tiny_llama, tmp / "ckpt", fmt, granularity)
    library = _library_weights(tiny_llama, ckpt, fmt, granularity)
    ours = dict(iter_weights(ckpt))
    dense = load_file(tiny_llama / "model.safetensors")
    for name in dense:
        assert torch.equal(ours[name].float(), library[name].float()), name  # our reading is the library's
        dense[name] = ours[name]
    assert set(ours) == set(dense)  # the activations' scales are dropped
    reference = _write(tiny_llama, tmp / "reference", json.loads((tiny_llama / "config.json").read_text()), dense)
    return ckpt, reference, ckpt if fmt == "fp8" and granularity else reference


def test_the_checkpoint_is_read_as_fp8(fp8) -> None:
    ckpt, _, _ = fp8
    assert scheme_of(json.loads((ckpt / "config.json").read_text())) == fp8_checkpoint.SCHEME


def test_float32_serving_loads_the_librarys_weights_and_matches_transformers(fp8) -> None:
    ckpt, reference, transformers_reads = fp8
    llm = LLM(str(ckpt), dtype="float32", kv_cache_memory=1 << 24, max_num_batched_tokens=40)
    prompts = _prompts(seed=5)
    got = run(llm, prompts)
    assert_greedy_parity(transformers_reads, prompts, got)
    assert got == run(LLM(str(reference), dtype="float32", kv_cache_memory=1 << 24, max_num_batched_tokens=40),
                      prompts)


def test_schemes_pagellm_does_not_read_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="this fp8 checkpoint's weights are 'e5m2'; pagellm reads e4m3"):
        scheme_of({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}})
    int_groups = _config("ct", "channel")
    int_groups["config_groups"]["group_0"]["weights"]["type"] = "int"
    with pytest.raises(ValueError, match="pagellm reads one group of 8-bit float weights"):
        scheme_of({"quantization_config": int_groups})


def test_a_layer_missing_its_scale_or_a_misfit_scale_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    ckpt = _checkpoint(tiny_llama, tmp_path / "ckpt", "fp8", (24, 40))
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    _write(ckpt, tmp_path / "lacking", json.loads((ckpt / "config.json").read_text()), tensors)
    with pytest.raises(ValueError, match="layer 'model.layers.1.mlp.up_proj' lacks a weight_scale_inv or weight_sc"):
        list(iter_weights(tmp_path / "lacking"))
    tensors["model.layers.1.mlp.up_proj.weight_scale_inv"] = torch.ones(2, 2)
    _write(ckpt, tmp_path / "misfit", json.loads((ckpt / "config.json").read_text()), tensors)
    with pytest.raises(ValueError, match=r"of \[128, 64\] in blocks of \[24, 40\] needs \[6, 2\] scales; it has \[2,"):
        list(iter_weights(tmp_path / "misfit"))


@pytest.mark.parametrize("quantization", [None, "w8a8_int8"])
def test_bfloat16_and_int8_serving_take_the_weights_a_float_checkpoint_would(tiny_llama: Path, tmp_path: Path,
                                                                              quantization: str | None) -> None:
    """In bfloat16 the FP8 layers are the native GEMMs' packed weights, and ``--quantization`` quantizes them, as
    it does a float checkpoint's with the same values."""
    ckpt = _checkpoint(tiny_llama, tmp_path / "ckpt", "fp8", (16, 32))
    dense = {**load_file(tiny_llama / "model.safetensors"), **dict(iter_weights(ckpt))}
    reference = _write(tiny_llama, tmp_path / "reference", json.loads((tiny_llama / "config.json").read_text()), dense)
    prompts = _prompts(seed=6)
    runs = [run(LLM(str(path), dtype="bfloat16", quantization=quantization, kv_cache_memory=1 << 24,
                    max_num_batched_tokens=40), prompts) for path in (ckpt, reference)]
    assert runs[0] == runs[1]
