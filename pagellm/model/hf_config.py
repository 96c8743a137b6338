"""Reading Hugging Face ``config.json`` dicts as transformers reads them: a nested config completed by its model
type's config class, a classifier's class names. No torch here (transformers' config classes only)."""

from __future__ import annotations

from typing import Any

# Qwen2-VL, Qwen2.5-VL and Qwen3-VL: images at their own resolution, M-RoPE positions (``model/qwen2_vl.py``,
# ``model/qwen3_vl.py``)
QWEN_VL = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
           "Qwen3VLMoeForConditionalGeneration")
QWEN3_VL = QWEN_VL[2:]  # Qwen3's decoder (dense or a mixture of experts), DeepStack, interleaved M-RoPE
_QWEN_VL_TEXT = dict(zip(QWEN_VL, ("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text")))


def with_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """A nested config (a vision-language model's ``text_config`` or ``vision_config``) completed as transformers
    completes it, its model type's config class made from what it says (so derived defaults follow it: Gemma 3's
    layer types from its layer count, its first configs' rope keys as ``rope_parameters``): the released LLaVA
    configs give their decoder's vocabulary and context only, their CLIP tower's activation and norm epsilon not at
    all, gemma-3-4b-it's decoder its widths, depth, window and rope scaling."""
    from transformers import AutoConfig

    model_type = cfg.get("model_type")
    if not model_type:
        return cfg
    return {**AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"}).to_dict(),
            **cfg}


def qwen_vl_text(cfg: dict[str, Any]) -> dict[str, Any]:
    """A released Qwen2-VL or Qwen2.5-VL config's decoder: its top level (one flat config), as its text model's."""
    return {**{k: v for k, v in cfg.items() if k != "vision_config"},
            "model_type": _QWEN_VL_TEXT[cfg["architectures"][0]]}


def mrope_section(cfg: dict[str, Any]) -> tuple[int, ...]:
    """M-RoPE's sections (transformers' defaults where the config names none: Qwen3-VL's differ)."""
    for scaling in (cfg.get("rope_parameters"), cfg.get("rope_scaling")):
        if scaling and scaling.get("mrope_section"):
            return tuple(int(n) for n in scaling["mrope_section"])
    return (24, 20, 20) if (cfg.get("architectures") or [""])[0] in QWEN3_VL else (16, 24, 24)


def qwen_vl_decoder(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Qwen-VL model's decoder config read as its text family's (Qwen2's; Qwen3-VL's Qwen3's, or Qwen3-MoE's, whose
    experts always renormalize their top k), and its M-RoPE fields."""
    architecture = cfg["architectures"][0]
    family = "qwen3_moe" if architecture == QWEN3_VL[1] else "qwen3" if architecture in QWEN3_VL else "qwen2"
    return ({**cfg, "model_type": family, **({"norm_topk_prob": True} if family == "qwen3_moe" else {})},
            {"mrope_section": mrope_section(cfg), "mrope_interleaved": architecture in QWEN3_VL})


def class_labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's class names in class order: ``id2label``'s, else ``LABEL_i`` for ``num_labels`` classes (2 by
    default, as transformers counts them)."""
    names = cfg.get("id2label") or {}
    count = len(names) or int(cfg.get("num_labels") or 2)
    return tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(count))
