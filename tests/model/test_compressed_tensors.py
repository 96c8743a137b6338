"""compressed-tensors W8A8 int8 checkpoints (``model/compressed_tensors.py``): the one written from a float
checkpoint holds int8 weights and per-channel scales in the format's names, pagellm serves it with exactly the
weights ``--quantization w8a8_int8`` makes from the float one (same tokens, same logprobs), a layer the checkpoint
leaves in float stays bfloat16, and schemes pagellm does not serve are refused with what was found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.model.compressed_tensors import scheme_of, write_w8a8
from pagellm.ops import gemm, gemm_w8a8

kernel = pytest.mark.skipif(not gemm_w8a8.available(), reason="the int8 GEMM needs AVX-512 VNNI and a compiler")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 9, 23, 7], list(range(40, 75))]


def _scored(llm: LLM) -> list[tuple[list[int], float]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in outs]


@pytest.fixture(scope="module")
def w8a8_dir(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_w8a8(tiny_llama, tmp_path_factory.mktemp("ct") / "tiny-w8a8")


def test_the_written_checkpoint_is_int8_weights_and_channel_scales(tiny_llama: Path, w8a8_dir: Path) -> None:
    config = json.loads((w8a8_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert scheme_of(config) == "w8a8_int8"
    source = {k: v for f in tiny_llama.glob("*.safetensors") for k, v in load_file(f).items()}
    written = load_file(w8a8_dir / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    q, scale = written[name], written[name + "_scale"]
    assert q.dtype == torch.int8 and scale.shape == (q.shape[0], 1)
    ref_q, ref_scale = gemm_w8a8.quantize(source[name].to(torch.bfloat16))
    assert torch.equal(q, ref_q) and torch.equal(scale[:, 0], ref_scale)
    assert torch.equal(written["model.norm.weight"], source["model.norm.weight"])  # the rest as it was
    assert sum(k.endswith("_scale") for k in written) == 7 * 2  # 7 linear layers in each of 2 decoder layers
    assert (w8a8_dir / "tokenizer.json").exists()


@kernel
def test_a_w8a8_checkpoint_serves_the_weights_online_quantization_makes(tiny_llama: Path, w8a8_dir: Path) -> None:
    from_checkpoint = LLM(str(w8a8_dir), dtype="bfloat16", kv_cache_memory=1 << 24)
    online = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory=1 << 24, quantization="w8a8_int8")
    a = from_checkpoint.engine.core.executor.worker.runner.model
    b = online.engine.core.executor.worker.runner.model
    for la, lb in zip(a.model.layers, b.model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            wa, wb = la.get_submodule(name).weight, lb.get_submodule(name).weight
            assert gemm.weight_format(wa) == "w8a8_int8" and torch.equal(wa, wb)
            assert not hasattr(la.get_submodule(name), "weight_scale")  # packed into the weight
    assert _scored(from_checkpoint) == _scored(online)


def _left_in_float(w8a8_dir: Path, out: Path, name: str) -> Path:
    """A copy of the checkpoint with the linear layer ``name`` in bfloat16 (dequantized) and on its ``ignore`` list."""
    tensors = load_file(w8a8_dir / "model.safetensors")
    q, scale = tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.weight_scale")
    tensors[f"{name}.weight"] = (q.float() * scale).to(torch.bfloat16)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((w8a8_dir / "config.json").read_text())
    config["quantization_config"]["ignore"].append(name)
    (out / "config.json").write_text(json.dumps(config))
    for path in w8a8_dir.glob("tokenizer*"):
        (out / path.name).write_bytes(path.read_bytes())
    return out


@kernel
def test_a_layer_the_checkpoint_leaves_in_float_stays_bfloat16(w8a8_dir: Path, tmp_path: Path) -> None:
    llm = LLM(str(_left_in_float(w8a8_dir, tmp_path / "partly", "model.layers.0.mlp.down_proj")), dtype="bfloat16",
              kv_cache_memory=1 << 24)
    layers = llm.engine.core.executor.worker.runner.model.model.layers
    assert gemm.weight_format(layers[0].mlp.down_proj.weight) == "bf16"
    assert gemm.weight_format(layers[1].mlp.down_proj.weight) == "w8a8_int8"
    assert all(len(tokens) == GREEDY.max_tokens for tokens, _ in _scored(llm))


@kernel
def test_a_fused_layer_half_quantized_is_refused(w8a8_dir: Path, tmp_path: Path) -> None:
    """q/k/v run as one matrix: k in float beside int8 q and v cannot be packed as either."""
    path = _left_in_float(w8a8_dir, tmp_path / "k-float", "model.layers.1.self_attn.k_proj")
    with pytest.raises(ValueError, match="quantizes 2 of the 3 matrices fused into one layer"):
        LLM(str(path), dtype="bfloat16", kv_cache_memory=1 << 24)


def test_a_w8a8_checkpoint_on_a_float32_model_is_refused(w8a8_dir: Path) -> None:
    with pytest.raises(ValueError, match="quantization=w8a8_int8 runs on bfloat16 models; set dtype bfloat16"):
        LLM(str(w8a8_dir), dtype="float32", kv_cache_memory=1 << 24)


@pytest.mark.parametrize("change,found", [
    ({"quant_method": "bitsandbytes"}, "quantized with 'bitsandbytes'"),
    ({"format": "pack-quantized"}, "no activation quantization"),  # weight-only packing with int8 activations
    ({"weights": {"strategy": "tensor"}}, "'strategy': 'tensor'"),
    ({"weights": {"num_bits": 4}}, "'num_bits': 4"),
    ({"input_activations": {"dynamic": False}}, "'dynamic': False"),
], ids=["bitsandbytes", "packed-w8a8", "per-tensor", "4-bit", "static-activations"])
def test_other_schemes_are_refused_with_what_was_found(w8a8_dir: Path, change: dict, found: str) -> None:
    config = json.loads((w8a8_dir / "config.json").read_text())
    quant = config["quantization_config"]
    group = quant["config_groups"]["group_0"]
    for key, value in change.items():
        if key in group:
            group[key].update(value)
        else:
            quant[key] = value
    with pytest.raises(ValueError) as info:
        scheme_of(config)
    assert found in str(info.value)
    assert scheme_of({"architectures": ["LlamaForCausalLM"]}) is None


@kernel
def test_a_w8a8_checkpoint_is_not_quantized_again(w8a8_dir: Path) -> None:
    with pytest.raises(ValueError, match="this checkpoint's layers are w8a8_int8 already .*serve it without "
                                         "quantization=w4a8_int4"):
        LLM(str(w8a8_dir), dtype="bfloat16", kv_cache_memory=1 << 24, quantization="w4a8_int4")
