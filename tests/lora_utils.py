"""LoRA adapters for the tests, made by ``peft`` itself (the reference implementation and file format)."""

from __future__ import annotations

from pathlib import Path

import torch


def build_lora_adapter(model_dir: Path, out: Path, seed: int, targets: list[str], rank: int,
                       rslora: bool = False) -> Path:
    """A PEFT LoRA adapter of ``model_dir`` with random, non-zero A and B matrices, saved as PEFT saves it."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                        use_rslora=rslora, lora_dropout=0.0)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(out)
    return out
