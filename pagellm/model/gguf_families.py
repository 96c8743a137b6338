"""The architecture-specific keys of a GGUF file's Hugging Face config, for ``model/gguf_convert.py``: Phi-3's
sliding window, the Gemma family's (GeGLU, soft caps, sliding layers, and what llama.cpp fixes for them rather than
storing), SmolLM3's NoPE layers, Granite's multipliers, OLMo 3's, EXAONE 4's and Command R7B's sliding layers,
Cohere's LayerNorms and logit scale, gpt-oss's windows and clamp, and the experts of a mixture; and
how a ``{arch}.key`` metadata value is read."""

from __future__ import annotations

from typing import Any

import numpy as np

# Whether the chosen experts' weights are renormalised, where a file does not say (``{arch}.expert_weights_norm``):
# what llama.cpp itself assumes for each architecture.
_EXPERT_WEIGHTS_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True}
# gpt-oss's MXFP4 checkpoints leave these in bfloat16 (its published config's list)
_GPT_OSS_NOT_MXFP4 = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
REQUIRED = object()


def arch_value(meta: dict[str, Any], arch: str, key: str, default: Any = REQUIRED) -> Any:
    full_key = f"{arch}.{key}"
    if full_key in meta:
        return meta[full_key]
    if default is REQUIRED:
        raise ValueError(f"GGUF metadata {full_key!r} is missing; the file is truncated or not from llama.cpp")
    return default


def shortest_float(value: float) -> float:
    # GGUF stores float32: 1e-5 comes back as 9.999999747e-06. The shortest decimal that round-trips through
    # float32 is what the original config said, and is the same number once a float32 model uses it.
    return float(str(np.float32(value)))


def phi3_config(meta: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's sliding window (llama.cpp writes it for the 4k models); its LongRoPE is ``_rope_scaling``'s."""
    window = int(arch_value(meta, "phi3", "attention.sliding_window", 0))
    # pad_token_id: the file's, where it names one (set after this); transformers' class default (32000) else
    return {"sliding_window": window or None, "pad_token_id": None}


def gemma_config(meta: dict[str, Any], arch: str, hidden_per_head: int, head_dim: int,
                  layers: int) -> dict[str, Any]:
    """Gemma's GeGLU; Gemma 2's soft caps and sliding window (every other layer global, as llama.cpp fixes it); Gemma
    3's sliding window, and what llama.cpp fixes for it rather than storing: a global layer every sixth (unless the
    file says otherwise), the sliding layers' rope base of 10,000; and both's attention scale (llama.cpp's rule:
    1/sqrt(hidden / heads) for the 27B models, 46 layers in Gemma 2, 62 in Gemma 3; else 1/sqrt(head size))."""
    config: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma2":
        return {**config, "sliding_window": int(arch_value(meta, arch, "attention.sliding_window")),
                "attn_logit_softcapping": arch_value(meta, arch, "attn_logit_softcapping", None),
                "final_logit_softcapping": arch_value(meta, arch, "final_logit_softcapping", None),
                "query_pre_attn_scalar": hidden_per_head if layers == 46 else head_dim}
    if arch != "gemma3":
        return config
    pattern = arch_value(meta, arch, "attention.sliding_window_pattern", 6)
    config.update(sliding_window=int(arch_value(meta, arch, "attention.sliding_window")),
                  rope_local_base_freq=10000.0, final_logit_softcapping=None, attn_logit_softcapping=None,
                  query_pre_attn_scalar=hidden_per_head if layers == 62 else head_dim)
    if isinstance(pattern, (list, tuple)):  # one flag per layer: True where it slides
        config["layer_types"] = ["sliding_attention" if slides else "full_attention" for slides in pattern]
    else:
        config["sliding_window_pattern"] = int(pattern)
    return config


def smollm3_config() -> dict[str, Any]:
    """SmolLM3's NoPE layers: every fourth, as llama.cpp fixes them (its files store no key for them)."""
    return {"no_rope_layer_interval": 4, "no_rope_layers": None, "pad_token_id": None}


def granite_config(meta: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Granite's multipliers under llama.cpp's names (each written only where the model sets it): embeddings, sublayer
    outputs and logits unscaled where the file has none; attention scores scaled by 1/sqrt(head size) where it has
    none (llama.cpp's rule, not transformers' default of 1)."""
    def scale(key: str, default: float) -> float:
        return shortest_float(arch_value(meta, "granite", key, 0.0)) or default

    return {"embedding_multiplier": scale("embedding_scale", 1.0), "residual_multiplier": scale("residual_scale", 1.0),
            "logits_scaling": scale("logit_scale", 1.0), "attention_multiplier": scale("attention.scale",
                                                                                        head_dim ** -0.5)}


def post_norm_config(meta: dict[str, Any], arch: str, layers: int) -> dict[str, Any]:
    """OLMo 2, or OLMo 3 where the file has a sliding window (llama.cpp writes both as ``olmo2``), and EXAONE 4 (its
    1.2B without a window, its 32B with one): the window and the layers it slides in (``attention.
    sliding_window_pattern``, one flag per layer; else OLMo 3's and EXAONE 4's default, three of four)."""
    window = int(arch_value(meta, arch, "attention.sliding_window", 0))
    if not window:  # (EXAONE 4's config would default to a 4,096-token window)
        return {"pad_token_id": None, "sliding_window": None}
    pattern = arch_value(meta, arch, "attention.sliding_window_pattern", None)
    slides = list(pattern) if pattern is not None else [(i + 1) % 4 != 0 for i in range(layers)]
    config = {"sliding_window": window, "pad_token_id": None,
              "layer_types": ["sliding_attention" if s else "full_attention" for s in slides]}
    return {**config, "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3"} if arch == "olmo2" else config


def cohere_config(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """Command R's (``command-r``) and Command R7B's (``cohere2``): the LayerNorms' epsilon, the logit scale, and R7B's
    sliding window, in three layers of four as llama.cpp fixes it (its files store no pattern)."""
    config = {"layer_norm_eps": shortest_float(arch_value(meta, arch, "attention.layer_norm_epsilon")),
              "logit_scale": shortest_float(arch_value(meta, arch, "logit_scale", 1.0)), "pad_token_id": None}
    if arch == "cohere2":
        config.update(sliding_window=int(arch_value(meta, arch, "attention.sliding_window")), sliding_window_pattern=4)
    return config


def gpt_oss_config(meta: dict[str, Any], layers: int, mxfp4: bool) -> dict[str, Any]:
    """gpt-oss's sliding window in every other layer, the first sliding (llama.cpp's rule where the file stores no
    pattern), its experts' clamp at 7 (llama.cpp fixes it rather than storing it), and where the file keeps every
    expert matrix in MXFP4, the checkpoint's ``quantization_config`` (the experts are written as its blocks)."""
    pattern = arch_value(meta, "gpt-oss", "attention.sliding_window_pattern", 2)
    slides = list(pattern) if isinstance(pattern, (list, tuple)) else \
        [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    config = {"sliding_window": int(arch_value(meta, "gpt-oss", "attention.sliding_window")), "swiglu_limit": 7.0,
              "layer_types": ["sliding_attention" if s else "full_attention" for s in slides], "pad_token_id": None}
    if mxfp4:
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": _GPT_OSS_NOT_MXFP4}
    return config


def experts_config(meta: dict[str, Any], arch: str, experts: int) -> dict[str, Any]:
    """The mixture-of-experts keys of the Hugging Face config: Mixtral's, or Qwen's (every layer sparse: llama.cpp's
    Qwen MoE architectures have no dense layers)."""
    def get(key: str, default: Any = REQUIRED) -> Any:
        return arch_value(meta, arch, key, default)

    used = int(get("expert_used_count"))
    if arch == "gpt-oss":  # the softmax over the chosen logits (its own rule: the renormalised probabilities)
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    renormalize = bool(get("expert_weights_norm", _EXPERT_WEIGHTS_NORM[arch]))
    if arch == "llama":
        if not renormalize:
            raise ValueError("GGUF llama file with experts that are not renormalised: Mixtral renormalises them; "
                             "convert the original checkpoint instead")
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    config = {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": renormalize,
              "moe_intermediate_size": int(get("expert_feed_forward_length")), "decoder_sparse_step": 1,
              "mlp_only_layers": []}
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    return config
