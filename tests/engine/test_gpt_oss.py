"""gpt-oss: its config, its MXFP4 experts read as transformers dequantizes them, and its attention sinks (on the
reference backend, which computes them). Greedy parity in every scheduling mode is test_parity's (ARCHS)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pagellm import LLM, SamplingParams
from pagellm.model import mxfp4
from pagellm.model.arch import ArchConfig
from pagellm.ops import decoder_stack, gemm, gemm_mxfp4, gemm_w4a16

from test_parity import (_prompts, assert_greedy_parity, hf_prompt_logprobs, prompt_logprobs, run,
                         scored_with_and_without_the_stack)

# openai/gpt-oss-20b's config.json, as published (its keys that matter here)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 32, "experts_per_token": 4, "num_experts_per_tok": 4,
    "sliding_window": 128, "attention_bias": True, "rope_theta": 150000, "swiglu_limit": 7.0,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}


def test_gpt_oss_20bs_published_config() -> None:
    cfg = ArchConfig.from_hf(GPT_OSS_20B)
    assert cfg.attention_sinks and cfg.attention_bias and cfg.o_proj_bias and cfg.quantization == mxfp4.SCHEME
    assert [cfg.layer_window(i) for i in range(4)] == [128, None, 128, None]
    assert cfg.rope_theta == 150000 and cfg.rope_scaling["rope_type"] == "yarn" and cfg.context_length == 131072
    moe = cfg.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (32, 4, 2880)
    assert moe.bias and moe.softmax_top_k and moe.swiglu_limit == 7.0 and moe.swiglu_alpha == 1.702
    assert ArchConfig.from_hf({**GPT_OSS_20B, "layer_types": None}).full_attention_layers == tuple(range(1, 24, 2))


def test_mxfp4_dequantizes_as_transformers() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 8, 4), generator=gen, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [experts, in, out]
        assert torch.equal(mxfp4.dequantize(blocks, scales, dtype).transpose(1, 2), theirs)
    named = dict(mxfp4.weights([("e.down_proj_scales", scales), ("e.bias", scales), ("e.down_proj_blocks", blocks)],
                               torch.float32))
    assert named.keys() == {"e.bias", "e.down_proj"}
    assert torch.equal(named["e.down_proj"], convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    with pytest.raises(ValueError, match="without their other half: e.down_proj_blocks"):
        list(mxfp4.weights([("e.down_proj_blocks", blocks)]))


def _mxfp4_twins(model_dir: Path, out: Path) -> tuple[Path, Path]:
    """An MXFP4 checkpoint of ``model_dir``'s shape with random expert codes and exponents, and its float twin (the
    experts as transformers dequantizes them, every other tensor the same)."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    packed, dense = {}, {}
    for name, tensor in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = dense[name] = tensor
            continue
        experts, inputs, outputs = tensor.shape  # the float layout: [experts, in, out]
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(121, 125, (experts, outputs, inputs // 32), generator=gen, dtype=torch.uint8)
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    dirs = []
    for kind, weights in (("mxfp4", packed), ("float", dense)):
        target = out / kind
        shutil.copytree(model_dir, target)
        save_file(weights, str(target / "model.safetensors"))
        if kind == "mxfp4":
            config = json.loads((target / "config.json").read_text())
            config["quantization_config"] = GPT_OSS_20B["quantization_config"]
            (target / "config.json").write_text(json.dumps(config))
        dirs.append(target)
    return dirs[0], dirs[1]


def assert_serves_its_float_twin(model: Path, dense: Path, seed: int) -> None:
    """``model`` served in float32 gives transformers' greedy tokens on its float twin ``dense``, and its prompt
    log-probabilities within 1e-5."""
    llm = LLM(str(model), dtype="float32", max_num_batched_tokens=40)
    try:
        prompts = _prompts(seed=seed)
        assert_greedy_parity(dense, prompts, run(llm, prompts))
        ours = prompt_logprobs(llm, prompts[-1])
    finally:
        llm.shutdown()
    assert (ours - hf_prompt_logprobs(dense, prompts[-1])).abs().max().item() < 1e-5


def test_an_mxfp4_checkpoint_serves_what_transformers_computes_from_its_experts(tiny_model_factory,
                                                                               tmp_path: Path) -> None:
    packed, dense = _mxfp4_twins(tiny_model_factory("gpt_oss"), tmp_path)
    assert_serves_its_float_twin(packed, dense, seed=5)


@pytest.mark.skipif(not gemm_mxfp4.runs_here(), reason="the MXFP4 GEMM needs AVX-512 BF16 and VNNI")
def test_in_bfloat16_an_mxfp4_checkpoints_experts_stay_in_4_bits(tiny_model_factory, tmp_path: Path) -> None:
    """Served in bfloat16, the experts keep the checkpoint's codes and scales on the MXFP4 GEMM (their values
    exactly, 5 bits a weight); attention and the router stay bfloat16; the log-probabilities are the float twin's
    served in bfloat16 (the same values in the bfloat16 GEMM) within bfloat16's rounding."""
    packed, dense = _mxfp4_twins(tiny_model_factory("gpt_oss"), tmp_path)
    prompt = _prompts(seed=6)[-1]
    results = {}
    for kind, model_dir in (("mxfp4", packed), ("float", dense)):
        llm = LLM(str(model_dir), dtype="bfloat16")
        try:
            if kind == "mxfp4":
                layer = llm.engine.core.executor.worker.runner.model.model.layers[1]
                expert = layer.mlp.experts[2]
                assert {gemm.weight_format(expert.gate_up_proj.weight), gemm.weight_format(expert.down_proj.weight)} \
                    == {gemm_mxfp4.FORMAT}
                assert gemm.weight_format(layer.self_attn.qkv_proj.weight) == "bf16"
                assert gemm.weight_format(layer.mlp.gate.weight) == "bf16"
                theirs = load_file(str(dense / "model.safetensors"))["model.layers.1.mlp.experts.down_proj"][2]
                assert torch.equal(gemm.plain(expert.down_proj.weight).float(), theirs.t())
            results[kind] = prompt_logprobs(llm, prompt)
        finally:
            llm.shutdown()
    assert (results["mxfp4"] - results["float"]).abs().mean().item() < 0.02


@pytest.mark.skipif(not (gemm_mxfp4.runs_here() and decoder_stack.available()),
                    reason="the MXFP4 GEMM and the native decoder stack need AVX-512 BF16 and VNNI")
def test_the_native_stack_runs_mxfp4_experts_beside_bfloat16_attention(tiny_model_factory, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An MXFP4 checkpoint in bfloat16 (its experts on the MXFP4 GEMM, every other matrix bfloat16) runs its layers in
    the one-call native stack, the experts through their own kernels: bit for bit the Python layers' tokens and
    log-probabilities."""
    packed, _ = _mxfp4_twins(tiny_model_factory("gpt_oss"), tmp_path)
    results = scored_with_and_without_the_stack(monkeypatch, packed, _prompts(seed=24)[:4], max_num_batched_tokens=40)
    assert results["1"] == results["0"]


@pytest.mark.skipif(not gemm_w4a16.runs_here(), reason="the W4A16 kernel needs AVX-512 BF16 and VNNI")
def test_an_mxfp4_checkpoint_takes_another_4_bit_format_from_its_values(tiny_model_factory, tmp_path: Path) -> None:
    """``--quantization w4a16_int4`` on an MXFP4 checkpoint: its experts' exact values load and are quantized to
    integer groups as a float checkpoint's are (not its E2M1 codes read as integers)."""
    packed, dense = _mxfp4_twins(tiny_model_factory("gpt_oss"), tmp_path)
    prompt = _prompts(seed=6)[-1]
    results = {}
    for kind, model_dir in (("mxfp4", packed), ("float", dense)):
        llm = LLM(str(model_dir), dtype="bfloat16", quantization="w4a16_int4")
        try:
            expert = llm.engine.core.executor.worker.runner.model.model.layers[0].mlp.experts[1]
            assert gemm.weight_format(expert.down_proj.weight) == gemm_w4a16.FORMAT
            results[kind] = prompt_logprobs(llm, prompt)
        finally:
            llm.shutdown()
    assert torch.equal(results["mxfp4"], results["float"])  # the same values, quantized alike


def test_the_sinks_run_on_the_cpu_kernel_as_on_its_twin(tiny_model_factory) -> None:
    """gpt-oss's steps take the C++ paged kernel (``auto``), whose sinks are its twin's: the same prompt
    log-probabilities in float32, and in bfloat16 within its rounding (test_parity runs both backends in float32)."""
    model_dir, prompt = tiny_model_factory("gpt_oss"), _prompts(seed=9)[-1]
    results = {}
    for backend in ("cpu_paged", "torch_ref"):
        for dtype in ("float32", "bfloat16"):
            llm = LLM(str(model_dir), dtype=dtype, attention_backend=backend)
            try:
                assert llm.engine.core.executor.worker.runner.backend.name == backend
                out = llm.generate([prompt], SamplingParams(max_tokens=8, prompt_logprobs=0, temperature=0,
                                                            ignore_eos=True), use_tqdm=False)[0]
            finally:
                llm.shutdown()
            logprobs = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
            results[backend, dtype] = logprobs, out.outputs[0].token_ids
    assert (results["cpu_paged", "float32"][0] - results["torch_ref", "float32"][0]).abs().max() < 1e-5
    bf16 = (results["cpu_paged", "bfloat16"][0] - results["torch_ref", "bfloat16"][0]).abs()
    assert bf16.mean().item() < 0.02
