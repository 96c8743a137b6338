"""The decoder layers of the families beyond Llama's own (``model/decoder.py``): what their configs say, and the
native decoder stack serving SmolLM3's NoPE layers, Granite's residual multiplier and OLMo's and EXAONE 4's norms
after each sublayer as the Python layers compute them, bit for bit. (Their parity with transformers is
``engine/test_parity.py``'s.)"""

from __future__ import annotations

import pytest
import torch
from test_parity import _prompts, scored, scored_with_and_without_the_stack

from pagellm import LLM
from pagellm.model.arch import NORMS_PARALLEL, NORMS_POST, NORMS_PRE, ArchConfig
from pagellm.ops import decoder_stack

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)


def test_smollm3s_nope_layers_are_every_fourth_unless_the_config_lists_them() -> None:
    default = ArchConfig.from_hf({**BASE, "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3"})
    assert default.nope_layers == (3, 7) and default.sliding_window is None
    listed = ArchConfig.from_hf({**BASE, "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3",
                                 "no_rope_layers": [1, 0, 0, 1, 1, 1, 1, 0]})
    assert listed.nope_layers == (1, 2, 7)


def test_smollm3s_window_slides_only_where_the_config_turns_it_on() -> None:
    cfg = {**BASE, "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "sliding_window": 32,
           "layer_types": ["full_attention"] * 3 + ["sliding_attention"] + ["full_attention"] * 4}
    assert ArchConfig.from_hf(cfg).sliding_window is None  # use_sliding_window is false by default
    on = ArchConfig.from_hf({**cfg, "use_sliding_window": True})
    assert [on.layer_window(i) for i in range(8)] == [None] * 3 + [32] + [None] * 4


def test_granites_multipliers() -> None:
    cfg = ArchConfig.from_hf({**BASE, "architectures": ["GraniteForCausalLM"], "model_type": "granite",
                              "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                              "attention_multiplier": 0.0078125, "logits_scaling": 8.0})
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attn_scale, cfg.logits_scaling) == \
        (12.0, 0.22, 0.0078125, 8.0)
    assert cfg.norms == NORMS_PRE


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
def test_olmo3s_full_layers_take_the_rope_scaling_and_its_sliding_layers_do_not(layout: str) -> None:
    """OLMo 3's configs in transformers 5's layout (rope parameters by layer type) and the first one (a rope_theta
    and a rope_scaling, which transformers applies to the full-attention layers only)."""
    scaling = {"rope_type": "linear", "factor": 4.0}
    rope = {"rope_parameters": {"full_attention": {**scaling, "rope_theta": 500000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}} \
        if layout == "rope_parameters" else {"rope_theta": 500000.0, "rope_scaling": scaling}
    cfg = ArchConfig.from_hf({**BASE, "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
                              "sliding_window": 16, **rope})
    assert cfg.norms == NORMS_POST and cfg.qk_norm
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling["factor"]) == (500000.0, 500000.0, 4.0)
    assert [cfg.layer_window(i) for i in range(8)] == [16, 16, 16, None] * 2  # transformers' default: 3 of 4 slide


@pytest.mark.skipif(not decoder_stack.available(), reason="the native decoder stack needs AVX-512 BF16")
@pytest.mark.parametrize("arch", ["smollm3", "granite", "granitemoe", "granite4", "olmo2", "olmo3", "exaone4", "gemma",
                                  "gemma2", "gemma3", "gpt_oss", "cohere", "cohere2"])
def test_the_native_stack_computes_each_familys_layer_as_the_python_layers(
        tiny_model_factory, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """SmolLM3 (a layer without a rotary embedding), Granite (each sublayer's output scaled before the residual add,
    its own attention scale; Granite MoE's experts' output too) and OLMo's layer (norms after each sublayer, the
    stream their input; OLMo's q/k norms over all heads, EXAONE 4's per head and its NoPE full layer, OLMo 3's
    sliding layer), Gemma's (norms before and after each sublayer, GeGLU; Gemma 2's soft-capped scores, Gemma 3's
    sliding layers' own rope base), gpt-oss's (sinks, o_proj bias, biased experts) and Cohere's (one LayerNorm,
    attention and the MLP side by side; Command R7B's windowed layers and NoPE full ones) in bfloat16: the native
    stack's greedy tokens and summed logprobs are the Python layers', bit for bit."""
    results = scored_with_and_without_the_stack(monkeypatch, tiny_model_factory(arch), _prompts(seed=23)[:6],
                                                max_num_batched_tokens=40)
    assert results["1"] == results["0"]
    assert all(torch.isfinite(torch.tensor(lp)) for _, lp in results["1"])


@pytest.mark.parametrize(("pattern", "full"), [({"layer_types": ["sliding_attention"] * 7 + ["full_attention"]}, (7,)),
                                               ({"sliding_window_pattern": "LLLG"}, (3, 7)),
                                               ({"sliding_window_pattern": 2}, (1, 3, 5, 7)),
                                               ({}, (3, 7))], ids=["layer-types", "string", "period", "default"])
def test_exaone4s_full_layers_are_nope_where_others_slide(pattern: dict, full: tuple[int, ...]) -> None:
    """EXAONE 4's hybrid attention (its 32B's): the full-attention layers, from its layer types or its pattern (a
    string of L and G or a period), attend without a rotary embedding; without a window (its 1.2B) every layer
    rotates and sees every key. Norms after each sublayer, q and k normed per head."""
    base = {**BASE, "architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4"}
    hybrid = ArchConfig.from_hf({**base, "sliding_window": 32, **pattern})
    assert hybrid.nope_layers == full and hybrid.full_attention_layers == full
    assert [hybrid.layer_window(i) for i in range(8)] == [None if i in full else 32 for i in range(8)]
    dense = ArchConfig.from_hf({**base, "sliding_window": None})
    assert dense.nope_layers == () and dense.sliding_window is None
    assert (dense.norms, dense.qk_norm, dense.qk_norm_all_heads) == (NORMS_POST, True, False)


def test_cohere_configs() -> None:
    """Cohere's LayerNorms (their epsilon its layer_norm_eps), side-by-side sublayers, logit scale and tied embeddings
    by default; Command R7B's full-attention layers (every fourth by its first configs' pattern) without a rotary
    embedding; Command R+'s q/k norms refused with what is supported."""
    base = {**BASE, "architectures": ["CohereForCausalLM"], "model_type": "cohere", "layer_norm_eps": 1e-5,
            "logit_scale": 0.0625}
    cohere = ArchConfig.from_hf(base)
    assert (cohere.norms, cohere.layer_norm, cohere.rms_norm_eps, cohere.logit_scale, cohere.tie_word_embeddings) == \
        (NORMS_PARALLEL, True, 1e-5, 0.0625, True)
    assert cohere.nope_layers == () and cohere.sliding_window is None
    r7b = ArchConfig.from_hf({**base, "architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2",
                              "sliding_window": 32, "sliding_window_pattern": 4})
    assert r7b.nope_layers == r7b.full_attention_layers == (3, 7)
    assert [r7b.layer_window(i) for i in range(8)] == [32, 32, 32, None] * 2
    with pytest.raises(ValueError, match="q/k norms \\(use_qk_norm: Command R\\+\\) are not supported"):
        ArchConfig.from_hf({**base, "use_qk_norm": True})


def test_granite4s_attention_only_models_and_what_is_refused() -> None:
    """Granite 4.0's attention-only models: Granite's multipliers, the shared MLP's width, a rotary embedding only
    where position_embedding_type says "rope" (else every layer NoPE); its Mamba layers and routed experts refused."""
    base = {**BASE, "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
            "shared_intermediate_size": 96, "num_local_experts": 0, "layer_types": ["attention"] * 8,
            "residual_multiplier": 0.22}
    micro = ArchConfig.from_hf({**base, "position_embedding_type": "rope"})
    assert (micro.intermediate_size, micro.residual_multiplier, micro.nope_layers, micro.moe) == (96, 0.22, (), None)
    assert ArchConfig.from_hf(base).nope_layers == tuple(range(8))
    for hybrid in ({"layer_types": ["mamba"] * 7 + ["attention"]}, {"num_local_experts": 4}):
        with pytest.raises(ValueError, match="Mamba layers and routed experts .* are not supported"):
            ArchConfig.from_hf({**base, **hybrid})


@pytest.mark.skipif(not decoder_stack.available(), reason="the native decoder stack needs AVX-512 BF16")
@pytest.mark.parametrize("arch", ["olmo2", "gemma2"])
def test_post_normed_pipeline_stages_run_the_native_stack_as_one_process(tiny_model_factory,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         arch: str) -> None:
    """OLMo's and Gemma 2's layers across two pipeline stages: the second stage's first layer takes the first's
    normed output and stream (OLMo's: their sum its input; Gemma's: their sum normed), the last ends with the final
    norm; bit for bit one process's, and the stages' Python layers'."""
    model_dir = tiny_model_factory(arch, num_hidden_layers=3, seed=5)
    prompts = _prompts(seed=16)[:4]
    stages = scored_with_and_without_the_stack(monkeypatch, model_dir, prompts, "run_stage", pipeline_parallel_size=2,
                                               max_num_batched_tokens=40)
    monkeypatch.setenv("PAGELLM_NATIVE_DECODER", "1")
    one_process = scored(LLM(str(model_dir), dtype="bfloat16", max_num_batched_tokens=40), prompts)
    assert stages["1"] == one_process == stages["0"]
