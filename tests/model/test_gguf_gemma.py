"""Gemma-family GGUF files as llama.cpp writes them, converted and served (``model/gguf_convert.py``,
``model/gguf_families.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_gguf import assert_serves_as_transformers, random_model, tiny_config, write_tiny_gguf
from tokenizers import Tokenizer as BackendTokenizer
from transformers import AutoModelForCausalLM

from pagellm.model.gguf_convert import convert_gguf_to_hf
from pagellm.model.loader import hf_model_dir, iter_weights, load_hf_config


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_a_gemma_gguf_round_trips(tmp_path: Path, tiny_tokenizer: BackendTokenizer, arch: str) -> None:
    """Gemma, Gemma 2 and Gemma 3 as llama.cpp writes them (their norms as 1 + w; Gemma 2 and 3's ffn_norm the norm
    before the MLP, their sliding window and Gemma 2's soft caps in the metadata; the global-layer pattern, Gemma 3's
    local rope base and the attention scale left to the reader) come back as transformers' models; the engine
    serves the file as transformers does."""
    # 2 heads of 16 in a hidden 64: the attention scale is the head size's, not hidden / heads' (the 27B's rule)
    config = tiny_config(arch, tiny_tokenizer.get_vocab_size(), True, num_attention_heads=2, num_key_value_heads=1)
    model = random_model(config)
    write_tiny_gguf(tmp_path / "tiny.gguf", model, tiny_tokenizer, arch)
    out = tmp_path / "hf"
    convert_gguf_to_hf(tmp_path / "tiny.gguf", out)
    original = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    converted = dict(iter_weights(out))
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():  # a norm's (w + 1) - 1 in float32 is w to its last bit or so
        assert torch.allclose(converted[name], tensor, rtol=0, atol=1e-6 if name.endswith("norm.weight") else 0), name
    hf_config = load_hf_config(out)
    reloaded = AutoModelForCausalLM.from_pretrained(hf_model_dir(out), dtype=torch.float32).eval()
    assert (hf_config["model_type"], reloaded.config.head_dim) == (config.model_type, 16)
    if arch != "gemma":
        assert (hf_config["sliding_window"], hf_config["query_pre_attn_scalar"]) == (6, 16)
        assert reloaded.config.layer_types == config.layer_types
        assert reloaded.config.rope_parameters == config.rope_parameters
    if arch == "gemma2":
        assert (reloaded.config.attn_logit_softcapping, reloaded.config.final_logit_softcapping) == (1.0, 3.0)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 1, 9, 11, 60]])  # past the 6-token window
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-5)
    assert_serves_as_transformers(tmp_path / "tiny.gguf", model, ids[0].tolist())
