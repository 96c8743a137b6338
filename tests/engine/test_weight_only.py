"""Weight-only integer checkpoints (``model/weight_only.py``): GPTQ, AWQ and compressed-tensors pack-quantized.

The checkpoints are written here from a tiny random model's weights, quantized round-to-nearest, with the
compressed-tensors library's own packer (``pack_to_int32``; a GPTQ qweight is its packing of the same values,
transposed). The reference weights come from the formats' libraries where this machine has them: transformers with
compressed-tensors decompresses a pack-quantized checkpoint, and compressed-tensors' AutoAWQ converter reads an AWQ
one. pagellm must load exactly those weights (float32), match transformers' greedy tokens over them, and with
``--quantization w4a8_int4`` keep the checkpoint's integers and scales in the 4-bit kernel's groups.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from safetensors.torch import load_file, save_file
from test_parity import _prompts, assert_greedy_parity, run

from pagellm import LLM, SamplingParams
from pagellm.distributed.groups import ParallelState
from pagellm.model import weight_only
from pagellm.model.arch import ArchConfig
from pagellm.model.loader import iter_weights, load_hf_config
from pagellm.model.registry import build_model
from pagellm.model.compressed_tensors import scheme_of, write_w4a16
from pagellm.ops import gemm, gemm_w4a8, gemm_w4a16

kernel = pytest.mark.skipif(not gemm_w4a8.available(), reason="the 4-bit GEMM needs AVX-512 VNNI and a compiler")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "qkv_proj",
           "gate_up_proj")
FORMATS = ["ct-symmetric", "ct-asymmetric", "gptq", "gptq-act-order", "gptq-8bit", "awq"]


def _rtn(w: torch.Tensor, group: int, symmetric: bool, dtype: torch.dtype, g_idx: torch.Tensor | None = None,
         bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest ``(q, z, s, g)``: q in [0, 2^bits) [N, K], z and s [N, G], g each input's group."""
    n, k = w.shape
    top = (1 << bits) - 1
    g = g_idx if g_idx is not None else torch.arange(k) // group
    by_group = [w[:, g == i] for i in range(int(g.max()) + 1)]
    if symmetric:
        s = torch.stack([c.abs().amax(1) / (top / 2) for c in by_group], 1).to(dtype)
        z = torch.full(s.shape, (top + 1) // 2, dtype=torch.int16)
    else:
        lo, hi = (torch.stack([c.amin(1) for c in by_group], 1), torch.stack([c.amax(1) for c in by_group], 1))
        s = ((hi - lo) / 15).to(dtype)
        z = torch.round(-lo / s.float()).clamp(1, 15).to(torch.int16)  # >= 1: GPTQ's format stores z - 1
    q = torch.round(w / s.float()[:, g] + z[:, g]).clamp(0, top).to(torch.int16)
    return q, z, s, g


def _signed(t: torch.Tensor, bits: int = 4) -> torch.Tensor:
    return (t - (1 << (bits - 1))).to(torch.int8)


def _tensors(kind: str, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> dict:
    """One layer's tensors in ``kind``'s names and packing."""
    if kind.startswith("ct"):
        out = {"weight_packed": pack_to_int32(_signed(q), 4), "weight_scale": s,
               "weight_shape": torch.tensor(list(q.shape))}
        if kind == "ct-asymmetric":
            out["weight_zero_point"] = pack_to_int32(_signed(z), 4, packed_dim=0)
        return out
    if kind.startswith("gptq"):  # packed along K (the transpose of compressed-tensors' packing), zeros minus one
        bits = 8 if kind == "gptq-8bit" else 4
        return {"qweight": pack_to_int32(_signed(q, bits), bits).t().contiguous(),
                "qzeros": pack_to_int32(_signed(z.t() - 1, bits), bits), "scales": s.t().contiguous(),
                "g_idx": g.to(torch.int32)}
    order = list(weight_only.AWQ_ORDER)  # AWQ: packed along N in AutoAWQ's order

    def awq(t: torch.Tensor) -> torch.Tensor:
        rows, cols = t.shape
        return pack_to_int32(_signed(t.reshape(rows, cols // 8, 8)[:, :, order].reshape(rows, cols)), 4)
    return {"qweight": awq(q.t()), "qzeros": awq(z.t()), "scales": s.t().contiguous()}


def _quant_config(kind: str, group: int) -> dict:
    if kind.startswith("ct"):
        args = QuantizationArgs(num_bits=4, type="int", symmetric=kind == "ct-symmetric", strategy="group",
                                group_size=group)
        config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                    format="pack-quantized", quantization_status="compressed", ignore=["lm_head"])
        return {**config.model_dump(), "quant_method": "compressed-tensors"}
    if kind.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 8 if kind == "gptq-8bit" else 4, "group_size": group,
                "desc_act": kind == "gptq-act-order", "sym": True, "checkpoint_format": "gptq"}
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}


def _write(src: Path, out: Path, config: dict, tensors: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for path in src.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.endswith(".safetensors"):
            shutil.copy2(path, out / path.name)
    return out


# The matrices that take one input, whose act-order is one (GPTQ orders a layer's inputs by its inputs' Hessian).
_SAME_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}


def _checkpoint(src: Path, out: Path, kind: str, group: int | None = None,
                own_orders: bool = False) -> tuple[Path, dict[str, tuple]]:
    """``kind``'s checkpoint of ``src`` in ``out`` (groups of ``group`` inputs: by default 64 for GPTQ in order, else
    32), and each quantized layer's ``(q, z, s, g)``. Act-order: the matrices of one input share its order, as GPTQ's
    do (with ``own_orders`` each takes its own)."""
    group = group or (64 if kind in ("gptq", "gptq-8bit") else 32)
    dtype = torch.bfloat16 if kind.startswith("ct") else torch.float16
    config = json.loads((src / "config.json").read_text())
    tensors, layers, orders = {}, {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        layer = name.removesuffix(".weight")
        if not (name.endswith(".weight") and layer.split(".")[-1] in LINEARS):
            tensors[name] = w
            continue
        g = None
        if kind == "gptq-act-order":  # inputs in an order of their own: each group takes scattered inputs
            base, _, part = layer.rpartition(".")
            key = layer if own_orders else f"{base}.{_SAME_INPUT.get(part, part)}"
            perm = orders.setdefault(key, torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(
                len(orders))))
            g = torch.empty(w.shape[1], dtype=torch.int64)
            g[perm] = torch.arange(w.shape[1]) // group
        layers[layer] = _rtn(w, group, kind not in ("ct-asymmetric", "awq"), dtype, g, 8 if "8bit" in kind else 4)
        tensors.update({f"{layer}.{part}": t for part, t in _tensors(kind, *layers[layer]).items()})
    return _write(src, out, {**config, "quantization_config": _quant_config(kind, group)}, tensors), layers


def _library_weights(ckpt: Path, kind: str, tmp: Path) -> dict[str, torch.Tensor]:
    """The float32 weights the formats' libraries make of ``ckpt``: transformers with compressed-tensors decompresses
    a pack-quantized checkpoint (an AWQ one after compressed-tensors' AutoAWQ converter); GPTQ's library is not on
    this machine, so its weights are ``(q - z) · s`` in float16, as GPTQ's torch path computes them."""
    if kind.startswith("gptq"):
        return {}
    if kind == "awq":
        converter = AutoAWQConverter.from_autoawq_config(json.loads((ckpt / "config.json").read_text())
                                                         ["quantization_config"])
        tensors = converter.process(load_file(ckpt / "model.safetensors"))
        config = json.loads((ckpt / "config.json").read_text())
        quant = {**converter.update_config(None).model_dump(), "quant_method": "compressed-tensors"}
        ckpt = _write(ckpt, tmp / "awq-as-ct", {**config, "quantization_config": quant}, tensors)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=FORMATS)
def quantized(request, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    """(kind, checkpoint, each layer's (q, z, s, g), a float32 reference checkpoint of the library's weights)."""
    kind, tmp = request.param, tmp_path_factory.mktemp(request.param)
    ckpt, layers = _checkpoint(tiny_llama, tmp / "ckpt", kind)
    library = _library_weights(ckpt, kind, tmp)
    dense = load_file(tiny_llama / "model.safetensors")
    for layer, parts in layers.items():
        mine = weight_only.dequantize(*parts).float()
        if library:
            assert torch.equal(library[f"{layer}.weight"], mine), layer  # our reading of the format is the library's
        dense[f"{layer}.weight"] = mine
    reference = _write(tiny_llama, tmp / "reference", json.loads((tiny_llama / "config.json").read_text()), dense)
    return kind, ckpt, layers, reference


def _model(llm: LLM):
    return llm.engine.core.executor.worker.runner.model


def test_the_checkpoint_is_read_as_weight_only(quantized) -> None:
    kind, ckpt, _, _ = quantized
    assert scheme_of(json.loads((ckpt / "config.json").read_text())) == weight_only.SCHEME


def test_float32_serving_loads_the_librarys_weights_and_matches_transformers(quantized) -> None:
    kind, ckpt, layers, reference = quantized
    llm = LLM(str(ckpt), dtype="float32", kv_cache_memory=1 << 24, max_num_batched_tokens=40)
    ref = LLM(str(reference), dtype="float32", kv_cache_memory=1 << 24, max_num_batched_tokens=40)
    ours, theirs = _model(llm), _model(ref)
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(a, b), name
    prompts = _prompts(seed=3)
    got = run(llm, prompts)
    assert_greedy_parity(reference, prompts, got)
    assert got == run(ref, prompts)


@kernel
@pytest.mark.parametrize("quantization", ["w4a8_int4", "w4a16_int4", None])
def test_four_bit_kernels_keep_the_checkpoints_integers_and_scales(quantized, quantization: str | None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``w4a8_int4`` and ``w4a16_int4`` pack the checkpoint's own integers, scales and zero points (an act-order
    layer's with its inputs sorted by group, which the packed weight takes in that order); with no flag a bfloat16
    model takes ``w4a16_int4`` (the checkpoint's own scheme) where it runs and the groups fit, else the dequantized
    weights. Each layer computes ``x · Wᵀ`` over the checkpoint's weights, and the native stack's greedy tokens are
    the Python layers'."""
    kind, ckpt, layers, _ = quantized
    if quantization == "w4a16_int4" and not gemm_w4a16.available():
        pytest.skip("the W4A16 kernel needs AVX-512 BF16 and VNNI")
    fits = kind != "gptq-8bit"
    if quantization and not fits:
        with pytest.raises(ValueError, match="8-bit weights"):
            LLM(str(ckpt), dtype="bfloat16", kv_cache_memory=1 << 24, quantization=quantization)
        return
    llm = LLM(str(ckpt), dtype="bfloat16", kv_cache_memory=1 << 24, quantization=quantization)
    layer = _model(llm).model.layers[1]
    expected = quantization or (gemm_w4a16.FORMAT if fits and gemm_w4a16.available() else "bf16")
    fused = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj"),
             "self_attn.o_proj": ("o_proj",), "mlp.down_proj": ("down_proj",)}
    for ours, parts in fused.items():
        linear = layer.get_submodule(ours)
        assert gemm.weight_format(linear.weight) == expected and not hasattr(linear, "weight_groups")
        if expected == "bf16":
            continue
        prefix = f"model.layers.1.{ours.split('.')[0]}."
        want = [layers[prefix + part] for part in parts]
        _assert_packed_as_the_checkpoint(linear.weight, want, kind == "gptq-act-order")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(_prompts(seed=3), params, use_tqdm=False)]
    assert all(len(tokens) == 8 for tokens in out)
    monkeypatch.setenv("PAGELLM_NATIVE_DECODER", "0")
    assert [o.outputs[0].token_ids for o in llm.generate(_prompts(seed=3), params, use_tqdm=False)] == out


def _assert_packed_as_the_checkpoint(weight: torch.Tensor, want: list[tuple], act_order: bool) -> None:
    """A packed 4-bit weight holds the checkpoint's ``(q, z, s, g)`` of its fused matrices (their inputs sorted by
    group where ``act_order``), gives back their weights in the inputs' order and computes ``x · Wᵀ`` over them."""
    n, k = gemm.packed_shape(weight)
    q, d, m = gemm_w4a8.unpack(weight.data, n, k)
    order = gemm.input_order(weight)
    assert (order is not None) == act_order
    cols = torch.sort(want[0][3], stable=True).indices if act_order else torch.arange(k)
    assert order is None or torch.equal(order, cols)
    assert torch.equal(q.to(torch.int16), torch.cat([w[0][:, cols] for w in want]))
    assert torch.equal(d, torch.cat([w[2][:, w[3][cols][::32]].half() for w in want]))
    assert torch.equal(m, torch.cat([(-(w[1] * w[2].float()))[:, w[3][cols][::32]].half() for w in want]))
    dense = torch.cat([weight_only.dequantize(*w).float() for w in want])
    torch.testing.assert_close(gemm.plain(weight).float(), dense, rtol=1e-2, atol=1e-3)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y, ref = gemm.linear(x, weight).float(), F.linear(x.float(), dense)
    assert (y - ref).norm() / ref.norm() < 0.02  # int8 activations (w4a8) round each x by 1/254 of its row's max


def test_schemes_pagellm_does_not_read_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="3-bit weights"):
        weight_only.scheme({"quant_method": "gptq", "bits": 3, "group_size": 128})
    with pytest.raises(ValueError, match="version is 'gemv'"):
        weight_only.scheme({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"})
    with pytest.raises(ValueError, match="LM head"):
        weight_only.scheme({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True})
    w4a8 = _quant_config("ct-symmetric", 32)
    w4a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token"}
    with pytest.raises(ValueError, match="no activation quantization"):
        weight_only.scheme(w4a8)
    with pytest.raises(ValueError, match="quantized with 'bitsandbytes'"):
        scheme_of({"quantization_config": {"quant_method": "bitsandbytes"}})


def test_the_four_bit_hint_names_what_keeps_the_weights() -> None:
    hint = weight_only.four_bit_hint({"quantization_config": _quant_config("gptq", 128)})
    assert hint is not None and "--quantization w4a8_int4" in hint and "gptq" in hint
    assert "gptq" in weight_only.four_bit_hint({"quantization_config": _quant_config("gptq-act-order", 128)})
    assert weight_only.four_bit_hint({"quantization_config": {"quant_method": "gptq", "bits": 8}}) is None
    assert weight_only.four_bit_hint({}) is None


def test_a_layer_missing_a_tensor_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    ckpt, _ = _checkpoint(tiny_llama, tmp_path / "gptq", "gptq")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.scales"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.mlp.up_proj' lacks scales"):
        LLM(str(ckpt), dtype="float32", kv_cache_memory=1 << 24)


def _reference(src: Path, out: Path, layers: dict[str, tuple]) -> Path:
    """A float32 checkpoint of ``src`` with its quantized layers' dequantized weights."""
    dense = load_file(src / "model.safetensors")
    dense.update({f"{layer}.weight": weight_only.dequantize(*parts).float() for layer, parts in layers.items()})
    return _write(src, out, json.loads((src / "config.json").read_text()), dense)


def _gptq_parity_then_four_bits(src: Path, tmp_path: Path, seed: int,
                                kind: str = "gptq") -> tuple[LLM | None, dict[str, tuple]]:
    """A GPTQ checkpoint of ``src``: its float32 greedy tokens held to transformers' over its dequantized weights;
    then, where the 4-bit kernel runs, the checkpoint served with ``w4a8_int4`` (else ``None``), and its layers."""
    ckpt, layers = _checkpoint(src, tmp_path / "gptq", kind)
    prompts = _prompts(seed=seed)
    llm = LLM(str(ckpt), dtype="float32", kv_cache_memory=1 << 24, max_num_batched_tokens=40)
    assert_greedy_parity(_reference(src, tmp_path / "reference", layers), prompts, run(llm, prompts))
    if not gemm_w4a8.available():
        return None, layers
    return LLM(str(ckpt), dtype="bfloat16", kv_cache_memory=1 << 24, quantization="w4a8_int4"), layers


@pytest.mark.parametrize("kind", ["gptq", "gptq-act-order"])
def test_a_gptq_mixture_of_experts_matches_transformers_and_keeps_its_experts_in_four_bits(tiny_model_factory,
                                                                                        tmp_path: Path,
                                                                                        kind: str) -> None:
    """A Mixtral GPTQ checkpoint: every expert's w1/w2/w3 is quantized (the router is not). In float32 its tokens
    are transformers'; with w4a8_int4 each expert's fused gate/up and its down projection hold the checkpoint's own
    integers and compute over its weights. Act-order experts take their inputs through the Python experts' loop
    (each expert's rows gathered in its order), not the native experts' call."""
    llm, layers = _gptq_parity_then_four_bits(tiny_model_factory("mixtral"), tmp_path, seed=5, kind=kind)
    assert sum(".experts." in layer for layer in layers) == 2 * 4 * 3
    if llm is None:
        return
    mlp = _model(llm).model.layers[0].mlp
    prefix = "model.layers.0.block_sparse_moe.experts.2."
    for linear, parts in ((mlp.experts[2].gate_up_proj, ("w1", "w3")), (mlp.experts[2].down_proj, ("w2",))):
        assert gemm.weight_format(linear.weight) == gemm_w4a8.FORMAT
        _assert_packed_as_the_checkpoint(linear.weight, [layers[prefix + part] for part in parts],
                                         kind == "gptq-act-order")
    assert (mlp.native_experts() is None) == (kind == "gptq-act-order")
    assert len(run(llm, _prompts(seed=5))[0]) > 0


def test_a_written_w4a16_checkpoint_is_what_compressed_tensors_decompresses(tiny_llama: Path, tmp_path: Path) -> None:
    """``write_w4a16`` (llm-compressor's round-to-nearest W4A16): its packing unpacks through transformers with
    compressed-tensors to ``round(W / s) · s`` with ``s`` the bfloat16 ``max |W| / 7.5`` of each 32 inputs, and pagellm
    serves those weights."""
    ckpt = write_w4a16(tiny_llama, tmp_path / "w4a16", group_size=32)
    library = _library_weights(ckpt, "ct-symmetric", tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"
    w = load_file(tiny_llama / "model.safetensors")[name].to(torch.bfloat16).float().view(64, 4, 32)
    s = (w.abs().amax(dim=2) / 7.5).to(torch.bfloat16)
    want = (torch.round(w / s.float()[..., None]).clamp(-8, 7).to(torch.bfloat16) * s[..., None]).float().view(64, 128)
    assert torch.equal(library[name], want)
    llm = LLM(str(ckpt), dtype="float32", kv_cache_memory=1 << 24)
    assert torch.equal(_model(llm).model.layers[1].mlp.down_proj.weight, want)
    with pytest.raises(ValueError, match="not whole groups of 48"):
        write_w4a16(tiny_llama, tmp_path / "w4a16-48", group_size=48)


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_gptq_checkpoints_of_other_families(tiny_model_factory, tmp_path: Path, arch: str) -> None:
    """Qwen2 (q/k/v biases beside the quantized weights, left in float) and Phi-3 (q/k/v and gate/up quantized as
    one fused matrix each, split back into the fused layers' shards, groups too): greedy tokens equal transformers'
    in float32, and with w4a8_int4 the fused layers hold the checkpoint's integers."""
    llm, layers = _gptq_parity_then_four_bits(tiny_model_factory(arch), tmp_path, seed=9)
    if llm is None:
        return
    qkv = _model(llm).model.layers[1].self_attn.qkv_proj
    q, _, _ = gemm_w4a8.unpack(qkv.weight.data, *gemm.packed_shape(qkv.weight))
    attn = "model.layers.1.self_attn."
    want = layers[attn + "qkv_proj"][0] if arch == "phi3" else \
        torch.cat([layers[attn + p][0] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(q.to(torch.int16), want)
    assert qkv.bias is None if arch == "phi3" else qkv.bias.abs().sum() > 0


def test_a_layer_whose_tensors_lie_in_different_shards(tiny_llama: Path, tmp_path: Path) -> None:
    """A sharded checkpoint (``model.safetensors.index.json``) may put a layer's qweight in one file and its scales,
    zero points and g_idx in the next: each layer is read once all its tensors have come, with the same weights."""
    ckpt, layers = _checkpoint(tiny_llama, tmp_path / "gptq", "gptq")
    tensors = load_file(ckpt / "model.safetensors")
    first = {k: v for k, v in tensors.items() if not k.endswith((".scales", ".qzeros", ".g_idx"))}
    second = {k: v for k, v in tensors.items() if k not in first}
    (ckpt / "model.safetensors").unlink()
    for name, part in (("model-00001-of-00002.safetensors", first), ("model-00002-of-00002.safetensors", second)):
        save_file(part, str(ckpt / name), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    llm = LLM(str(ckpt), dtype="float32", kv_cache_memory=1 << 24)
    down = _model(llm).model.layers[0].mlp.down_proj.weight
    assert torch.equal(down, weight_only.dequantize(*layers["model.layers.0.mlp.down_proj"]).float())


def test_fused_matrices_in_different_orders_are_dequantized(tiny_llama: Path, tmp_path: Path) -> None:
    """An act-order GPTQ checkpoint whose q, k and v (and gate and up) take their inputs in different orders (GPTQ
    gives matrices of one input one order; this one does not): the worker picks ``w4a16_int4`` from the config,
    finds a fused layer whose matrices cannot share one gathered input, and loads the weights dequantized instead;
    with the kernel asked for by name it is refused by name."""
    ckpt, layers = _checkpoint(tiny_llama, tmp_path / "gptq", "gptq-act-order", own_orders=True)
    llm = LLM(str(ckpt), dtype="bfloat16", kv_cache_memory=1 << 24)
    down = _model(llm).model.layers[0].mlp.down_proj.weight
    assert gemm.weight_format(down) in ("bf16", None)
    assert torch.equal(gemm.plain(down), weight_only.dequantize(*layers["model.layers.0.mlp.down_proj"])
                       .to(torch.bfloat16))
    if gemm_w4a16.available():
        with pytest.raises(weight_only.GroupsDoNotFit, match="different orders"):
            LLM(str(ckpt), dtype="bfloat16", kv_cache_memory=1 << 24, quantization="w4a16_int4")


@kernel
def test_an_act_order_layer_split_over_ranks_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    """Under tensor parallelism a row-parallel layer (o_proj, down_proj) takes a slice of its inputs on each rank,
    and an act-order group's inputs lie on every rank: its 4-bit weights are refused by name (the worker then loads
    the checkpoint dequantized, as for any groups that do not fit)."""
    ckpt, _ = _checkpoint(tiny_llama, tmp_path / "gptq", "gptq-act-order")
    model = build_model(ArchConfig.from_hf(load_hf_config(ckpt)), torch.bfloat16, ParallelState(tp_rank=1, tp_size=2))
    with pytest.raises(weight_only.GroupsDoNotFit, match="act-order 4-bit layer's groups take inputs from every "
                                                         "tensor-parallel rank's slice"):
        model.load_weights(iter_weights(ckpt, groups=True), gemm_w4a8.FORMAT)


def test_groups_that_do_not_divide_the_inputs(tiny_llama: Path, tmp_path: Path) -> None:
    """Groups of 96 over 64 inputs (one short group) and 128 (a full group and a short one), as compressed-tensors
    stores them with no group indices: read in float32 as the dequantized weights, and kept in 4 bits where each 32
    inputs lie in one group."""
    ckpt, layers = _checkpoint(tiny_llama, tmp_path / "ct96", "ct-symmetric", group=96)
    llm = LLM(str(ckpt), dtype="float32", kv_cache_memory=1 << 24)
    down = _model(llm).model.layers[0].mlp.down_proj.weight
    assert torch.equal(down, weight_only.dequantize(*layers["model.layers.0.mlp.down_proj"]).float())
    if gemm_w4a16.available():
        llm = LLM(str(ckpt), dtype="bfloat16", kv_cache_memory=1 << 24)
        down = _model(llm).model.layers[0].mlp.down_proj.weight
        assert gemm.weight_format(down) == gemm_w4a16.FORMAT
        q, d, _ = gemm_w4a8.unpack(down.data, 64, 128)
        want = layers["model.layers.0.mlp.down_proj"]
        assert torch.equal(q.to(torch.int16), want[0]) and torch.equal(d, want[2][:, [0, 0, 0, 1]].half())
