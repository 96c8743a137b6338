"""Reading Hugging Face ``config.json`` dicts as transformers reads them: a nested config completed by its model
type's config class, a classifier's class names. No torch here (transformers' config classes only)."""

from __future__ import annotations

from typing import Any


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


def class_labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's class names in class order: ``id2label``'s, else ``LABEL_i`` for ``num_labels`` classes (2 by
    default, as transformers counts them)."""
    names = cfg.get("id2label") or {}
    count = len(names) or int(cfg.get("num_labels") or 2)
    return tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(count))
