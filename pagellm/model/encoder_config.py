"""Encoder-only embedding models' configs (BERT, RoBERTa, XLM-RoBERTa: bge, e5, gte, all-MiniLM, bge-m3,
multilingual-e5; their cross-encoders, bge-reranker, ms-marco MiniLM; ModernBERT: modernbert-embed, gte-modernbert):
their ``ArchConfig`` (``ArchConfig.encoder`` carries what the encoder reads of config.json) and how they pool, from
the sentence-transformers files beside the weights (``modules.json``, the Pooling module's ``config.json``, Dense
modules) or ``--pooler-config``. No torch here: the engine reads it before its workers start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagellm.model.hf_config import class_labels, with_defaults

# cross-encoders (rerankers such as bge-reranker, ms-marco MiniLM): a classification head over the first token
ENCODER_CLASSIFIERS = ("BertForSequenceClassification", "RobertaForSequenceClassification",
                       "XLMRobertaForSequenceClassification", "ModernBertForSequenceClassification")
ENCODERS = ("BertModel", "RobertaModel", "XLMRobertaModel", "ModernBertModel", *ENCODER_CLASSIFIERS)
POOLING_TYPES = ("CLS", "MEAN", "LAST")
_ACTIVATIONS = ("Tanh", "Identity")  # a sentence-transformers Dense layer's
_ROBERTA = ("roberta", "xlm-roberta")  # their positions start past the padding id
# what the encoder reads of config.json (``model/bert.py``)
_KEYS = ("model_type", "hidden_act", "layer_norm_eps", "type_vocab_size", "pad_token_id", "position_embedding_type",
         # ModernBERT's
         "hidden_activation", "norm_bias", "attention_bias", "mlp_bias", "local_attention", "layer_types",
         "rope_parameters", "classifier_pooling", "classifier_activation", "classifier_bias")


def encoder_arch(cfg: dict[str, Any]) -> dict[str, Any]:
    """``ArchConfig``'s fields for an encoder-only model's config.json (completed with transformers' defaults for
    its model type): no rotary embedding, one K/V head per head, the usable context (RoBERTa's positions start at its
    padding id + 1, so two of its position embeddings are never a token's)."""
    cfg = {**with_defaults({k: v for k, v in cfg.items() if k != "architectures"}),
           "architectures": cfg["architectures"]}
    if cfg.get("position_embedding_type") not in (None, "absolute"):
        raise ValueError(f"position_embedding_type={cfg['position_embedding_type']!r} is not supported; absolute "
                         "positions only")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    context = int(cfg["max_position_embeddings"])
    if cfg.get("model_type") in _ROBERTA:
        context -= int(cfg.get("pad_token_id") or 0) + 1
    encoder = {key: cfg.get(key) for key in _KEYS}
    classifier = cfg["architectures"][0] in ENCODER_CLASSIFIERS
    return dict(labels=class_labels(cfg) if classifier else (), base_model=not classifier,
                architecture=cfg["architectures"][0], vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, rotary_dim=hidden // heads,
                rms_norm_eps=float(cfg["norm_eps"] if "norm_eps" in cfg else cfg.get("layer_norm_eps", 1e-12)),
                rope_theta=10000.0, rope_scaling=None,
                max_position_embeddings=context, tie_word_embeddings=True, attention_bias=True, sliding_window=None,
                encoder=encoder)


def encoder_settings(model_dir: Path, tokenizer_dir: Path, encoder: dict[str, Any],
                     pooler_config: dict[str, Any] | None) -> dict[str, Any]:
    """What the encoder reads beside its config.json: how it pools, the sentence-transformers Dense layers after the
    pooling, and with two token types its tokenizer's separator id (a pair's second text, after it, is type 1)."""
    settings: dict[str, Any] = {"pooling": pooling_type(model_dir, pooler_config), "dense": dense_layers(model_dir)}
    if int(encoder.get("type_vocab_size") or 1) > 1:
        from transformers import AutoTokenizer

        settings["sep_token_id"] = AutoTokenizer.from_pretrained(str(tokenizer_dir)).sep_token_id
    return settings


def dense_layers(model_dir: Path) -> list[dict[str, Any]]:
    """The sentence-transformers Dense modules after the pooling, in order (their folder, shape, bias and activation:
    Tanh or Identity); a module of another kind than Transformer, Pooling, Dense and Normalize is refused by name
    (its embeddings would not be the model's)."""
    dense = []
    for module in _modules(model_dir):
        kind = str(module.get("type", "")).rpartition(".")[2]
        if kind not in ("Transformer", "Pooling", "Dense", "Normalize"):
            raise ValueError(f"{model_dir}: its sentence-transformers module {module.get('type')!r} is not supported "
                             "(Transformer, Pooling, Dense and Normalize are)")
        if kind == "Dense":
            folder = model_dir / module.get("path", "")
            settings = json.loads((folder / "config.json").read_text())
            activation = str(settings.get("activation_function", "")).rpartition(".")[2]
            if activation not in _ACTIVATIONS:
                raise ValueError(f"{folder}: a Dense layer's activation {activation!r} is not supported "
                                 f"({', '.join(_ACTIVATIONS)} are)")
            dense.append({"path": str(folder), "in": int(settings["in_features"]), "out": int(settings["out_features"]),
                          "bias": bool(settings.get("bias", True)), "activation": activation})
    return dense


def _modules(model_dir: Path) -> list[dict[str, Any]]:
    path = model_dir / "modules.json"
    return json.loads(path.read_text()) if path.is_file() else []


def pooling_type(model_dir: Path, pooler_config: dict[str, Any] | None, default: str = "CLS") -> str:
    """How a model's token states become one embedding: ``--pooler-config``'s ``pooling_type``, else the
    sentence-transformers Pooling module's (its ``pooling_mode_*`` switches), else ``default`` (CLS: vLLM's for
    encoders)."""
    if pooler_config and pooler_config.get("pooling_type"):
        kind = str(pooler_config["pooling_type"]).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(f"pooler_config's pooling_type {kind!r}: use one of {', '.join(POOLING_TYPES)}")
        return kind
    for module in _modules(model_dir):
        if str(module.get("type", "")).endswith(".Pooling"):
            return _sentence_transformers_pooling(model_dir / module.get("path", ""), model_dir)
    return default


def _sentence_transformers_pooling(folder: Path, model_dir: Path) -> str:
    settings = json.loads((folder / "config.json").read_text())
    modes = [name for name, key in (("CLS", "pooling_mode_cls_token"), ("MEAN", "pooling_mode_mean_tokens"),
                                    ("LAST", "pooling_mode_lasttoken")) if settings.get(key)]
    others = [key for key, on in settings.items() if key.startswith("pooling_mode_") and on and key not in
              ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_lasttoken")]
    if len(modes) != 1 or others:
        raise ValueError(f"{model_dir}: its sentence-transformers Pooling ({folder.name}) asks for "
                         f"{modes + others}; one of CLS, mean or last-token pooling is supported (or set "
                         "--pooler-config '{\"pooling_type\": \"CLS\"}')")
    return modes[0]
