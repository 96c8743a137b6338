"""Model architectures by their Hugging Face ``architectures`` name."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed.groups import ParallelState
from pagellm.model.arch import BASE_MODELS, CLASSIFIERS, ArchConfig
from pagellm.model.bert import EncoderClassifier, EncoderEmbeddingModel
from pagellm.model.encoder_config import ENCODER_CLASSIFIERS, ENCODERS
from pagellm.model.gemma3_mm import Gemma3ForConditionalGeneration
from pagellm.model.modernbert import ModernBertClassifier, ModernBertEmbeddingModel
from pagellm.model.idefics3 import Idefics3ForConditionalGeneration
from pagellm.model.llama import (GemmaForCausalLM, GptOssForCausalLM, GraniteMoeForCausalLM,
                                 InterleavedRopeForCausalLM, LlamaForCausalLM, MixtralForCausalLM, Phi3ForCausalLM)
from pagellm.model.llava import LlavaForConditionalGeneration, LlavaNextForConditionalGeneration
from pagellm.model.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from pagellm.model.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeForCausalLM,  # Granite 4.0's attention-only models
    "Olmo2ForCausalLM": LlamaForCausalLM,
    "Olmo3ForCausalLM": LlamaForCausalLM,
    "Exaone4ForCausalLM": LlamaForCausalLM,
    "Ernie4_5ForCausalLM": InterleavedRopeForCausalLM,
    "CohereForCausalLM": InterleavedRopeForCausalLM,
    "Cohere2ForCausalLM": InterleavedRopeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,  # its attention sinks on the torch_ref backend
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,  # its soft-capped attention on the torch_ref backend
    "Gemma3ForCausalLM": GemmaForCausalLM,  # Gemma 3's text model (gemma-3-270m, -1b)
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # gemma-3-4b-it and up: images too
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,  # SmolVLM: images in its prompts
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,  # LLaVA-1.5: a CLIP or SigLIP tower
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,  # LLaVA-NeXT: any-resolution images
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,  # images at their own resolution, M-RoPE
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,  # ... windowed attention in its tower
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,  # ... DeepStack rows in its first layers
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,  # ... Qwen3-MoE's decoder
    # encoder-only embedding models (BERT, RoBERTa, XLM-RoBERTa), for pooling requests
    **{name: EncoderClassifier if name in ENCODER_CLASSIFIERS else EncoderEmbeddingModel for name in ENCODERS},
    "ModernBertModel": ModernBertEmbeddingModel,
    "ModernBertForSequenceClassification": ModernBertClassifier,
    # base models (embedding checkpoints: no LM head; ArchConfig.base_model), for pooling requests
    **{name: LlamaForCausalLM for name in BASE_MODELS},
    # sequence classifiers: the same decoder and a score head (ArchConfig.num_labels), for classify requests
    **{name: LlamaForCausalLM for name in CLASSIFIERS},
}


def build_model(cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState) -> LlamaForCausalLM:
    if cfg.architecture not in _MODELS:
        raise ValueError(f"model architecture {cfg.architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(_MODELS))}")
    return _MODELS[cfg.architecture](cfg, dtype, parallel)
