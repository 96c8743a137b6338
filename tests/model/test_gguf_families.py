"""SmolLM3, Granite, OLMo 2 / OLMo 3, EXAONE 4, ERNIE 4.5 and Cohere (Command R, R7B) GGUF files, and YaRN-scaled
ones, as llama.cpp writes them, converted and served (``model/gguf_convert.py``, ``model/gguf_families.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_gguf import assert_serves_as_transformers, random_model, tiny_config, write_tiny_gguf
from tokenizers import Tokenizer as BackendTokenizer
from transformers import AutoModelForCausalLM

from pagellm.model.gguf_convert import convert_gguf_to_hf
from pagellm.model.gguf_families import granite_config
from pagellm.model.loader import hf_model_dir, iter_weights, load_hf_config

# What llama.cpp's file says of each (or fixes without saying): SmolLM3's NoPE layer every fourth; Granite's four
# multipliers; OLMo 3's and EXAONE 4's sliding window and the layers it slides in (OLMo 2 has none); Cohere's logit
# scale and LayerNorm epsilon, Command R7B's window in three layers of four.
EXPECTED = {
    "smollm3": {"no_rope_layers": [1, 1, 1, 0]},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.5,
                "logits_scaling": 8.0},
    "olmo2": {"model_type": "olmo2"},
    "olmo3": {"model_type": "olmo3", "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
    "exaone4": {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
    "ernie4_5": {"model_type": "ernie4_5"},
    "command-r": {"logit_scale": 0.25, "layer_norm_eps": 1e-5},
    "cohere2": {"logit_scale": 0.25, "sliding_window": 6,
                "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
}


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_a_familys_gguf_round_trips_and_serves_as_transformers_does(tmp_path: Path, tiny_tokenizer: BackendTokenizer,
                                                                    arch: str) -> None:
    """The file's tensors come back as the model's (q/k rows un-permuted for SmolLM3 and Granite, whose files
    llama.cpp's LlamaModel writes; OLMo's as written), its config as transformers' (above), its logits as the
    original's; the engine serves the file's greedy tokens as transformers generates them."""
    tied = arch in ("command-r", "cohere2")  # Cohere's files have no LM head of their own
    model = random_model(tiny_config(arch, tiny_tokenizer.get_vocab_size(), tied))
    write_tiny_gguf(tmp_path / "tiny.gguf", model, tiny_tokenizer, arch)
    out = tmp_path / "hf"
    convert_gguf_to_hf(tmp_path / "tiny.gguf", out)
    original = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    converted = dict(iter_weights(out))
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    reloaded = AutoModelForCausalLM.from_pretrained(hf_model_dir(out), dtype=torch.float32).eval()
    for key, value in EXPECTED[arch].items():
        assert getattr(reloaded.config, key) == pytest.approx(value) if isinstance(value, float) else \
            getattr(reloaded.config, key) == value, key
    hf_config = load_hf_config(out)
    assert hf_config["architectures"] == [type(model).__name__]
    assert (hf_config.get("sliding_window") is None) == (arch not in ("olmo3", "exaone4", "cohere2"))
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 1, 9, 11, 60]])  # past OLMo 3's 6-token window
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-5)
    assert_serves_as_transformers(tmp_path / "tiny.gguf", model, ids[0].tolist())


def test_a_granite_file_without_its_multipliers_scales_as_llama_cpp_does() -> None:
    """llama.cpp's converter writes each multiplier only where the model sets one; where a file has none, llama.cpp
    leaves embeddings, sublayer outputs and logits unscaled and scales attention scores by 1/sqrt(head size) (not
    transformers' default attention_multiplier of 1)."""
    assert granite_config({}, 16) == {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
                                      "attention_multiplier": 0.25}


@pytest.mark.parametrize("attention_factor", [None, 0.9], ids=["default-scale", "attention-factor"])
def test_a_yarn_gguf_keeps_its_scaling(tmp_path: Path, tiny_tokenizer: BackendTokenizer,
                                       attention_factor: float | None) -> None:
    """YaRN's type, factor, original context and (where the model set one) attention factor come back as the
    model's rope scaling, and the engine serves the file as transformers runs the original (past its original
    context of 8)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
            **({} if attention_factor is None else {"attention_factor": attention_factor})}
    model = random_model(tiny_config("llama", tiny_tokenizer.get_vocab_size(), False, rope_scaling=yarn))
    write_tiny_gguf(tmp_path / "tiny.gguf", model, tiny_tokenizer, "llama")
    convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf")
    scaling = load_hf_config(tmp_path / "hf")["rope_scaling"]
    assert {k: scaling[k] for k in yarn} == pytest.approx(yarn)
    assert_serves_as_transformers(tmp_path / "tiny.gguf", model, [5, 17, 42, 99, 3, 250, 7, 1, 9, 11, 60, 8, 30])
