"""Architecture hyper-parameters read from a Hugging Face ``config.json``, normalised across the Llama family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.model.compressed_tensors import scheme_of


# The base-model classes of the served families (their checkpoints have no LM head and no ``model.`` prefix).
BASE_MODELS = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    quantization: str | None = None  # a quantized checkpoint's scheme (``compressed_tensors.scheme_of``)
    qk_norm: bool = False  # RMSNorm over each head's q and k before the rotary embedding (Qwen3)
    # A base-model checkpoint (``LlamaModel``, ``Qwen3Model``, ...: embedding models such as e5-mistral): weights
    # without the ``model.`` prefix and no LM head; it serves pooling (embedding) requests only.
    base_model: bool = False

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ArchConfig:
        archs = cfg.get("architectures") or [""]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        model_type = cfg.get("model_type")
        is_qwen = model_type in ("qwen2", "qwen3")  # their sliding_window applies only with use_sliding_window
        window = cfg.get("sliding_window") if (not is_qwen or cfg.get("use_sliding_window")) else None
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default")
                                                   != "default" else None)
        base_model = archs[0] in BASE_MODELS
        return cls(
            architecture=archs[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) or base_model,  # no head of its own
            attention_bias=bool(cfg.get("attention_bias", False)) or model_type == "qwen2",
            sliding_window=int(window) if window else None,
            quantization=scheme_of(cfg),
            qk_norm=model_type == "qwen3",
            base_model=base_model,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
