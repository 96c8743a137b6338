"""Tiny random sequence classifiers (``*ForSequenceClassification``), saved as Hugging Face directories with the
tiny models' byte tokenizer: the classify tests' models (offline and served)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, pad_token_id=319)  # 319: no prompt holds it
KINDS = {  # arch → (config class, model class, its labels)
    "llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification, ["neg", "neu", "pos"]),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification, ["spam", "ham"]),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForSequenceClassification, ["reward"]),
}


def build_classifier(path: Path, arch: str, tokenizer_from: Path) -> Path:
    """A random ``arch`` classifier with ``KINDS[arch]``'s labels under ``path``, with ``tokenizer_from``'s
    tokenizer files."""
    config_cls, model_cls, labels = KINDS[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    config = config_cls(**SHAPE, **extra, num_labels=len(labels), id2label=dict(enumerate(labels)),
                        label2id={name: i for i, name in enumerate(labels)})
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # decisive classes
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, path / name)
    return path
