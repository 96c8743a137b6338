"""YaRN rope scaling (Qwen2.5 and Qwen3's long contexts, OLMo 3, SmolLM3's): its frequencies and its cos/sin scale as
transformers computes them, and a model with it served as transformers runs it."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagellm import LLM, SamplingParams
from pagellm.model.arch import ArchConfig
from pagellm.model.layers.rotary import RotaryEmbedding, rope_attention_factor, rope_inv_freq

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {
    "qwen3": YARN,
    "attention-factor": {**YARN, "attention_factor": 0.8},
    "deepseek-mscale": {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16},
    "untruncated": {**YARN, "truncate": False, "beta_slow": 2},
}


def _theirs(scaling: dict, head_dim: int = 64, theta: float = 1e6) -> tuple[torch.Tensor, float]:
    config = transformers.Qwen3Config(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=256, rope_parameters={**scaling, "rope_theta": theta})
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


@pytest.mark.parametrize("scaling", list(VARIANTS.values()), ids=list(VARIANTS))
def test_yarns_frequencies_and_scale_are_transformers(scaling: dict) -> None:
    inv_freq, factor = _theirs(scaling)
    assert torch.equal(rope_inv_freq(64, 1e6, scaling), inv_freq)
    assert rope_attention_factor(scaling, 256) == pytest.approx(factor, rel=1e-12)
    rotary = RotaryEmbedding(64, 256, 1e6, scaling, torch.float32)
    positions = torch.arange(256, dtype=torch.float32)
    emb = torch.cat([torch.outer(positions, inv_freq)] * 2, dim=-1)
    assert torch.equal(rotary.cos, emb.cos() * factor) and torch.equal(rotary.sin, emb.sin() * factor)


def test_yarns_original_context_defaults_to_the_configs_max_positions() -> None:
    """A YaRN scaling without its original context takes the config's max_position_embeddings, as transformers
    standardizes it."""
    cfg = ArchConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 300,
                              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "head_dim": 16, "max_position_embeddings": 512,
                              "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 512


def test_a_yarn_model_serves_transformers_prompt_logprobs(tiny_model_factory) -> None:
    """A Qwen3 with YaRN (factor 4 over an original context of 64, which its max_position_embeddings keeps, as
    Qwen's long-context configs do): its context is 256 tokens, as vLLM derives it, and its prompt log-probabilities
    to within 1e-5 of transformers', on a prompt past the original context."""
    model_dir = tiny_model_factory("qwen3", seed=4, rope_parameters={**YARN, "rope_theta": 10000.0},
                                   max_position_embeddings=64)
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(str(model_dir), dtype="float32")
    assert llm.input_processor.max_model_len == 256
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    theirs = logits.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (ours - theirs).abs().max().item() < 1e-5
