"""Architecture hyper-parameters read from a Hugging Face ``config.json``, normalised across the Llama family."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pagellm.model.compressed_tensors import scheme_of
from pagellm.model.encoder_config import ENCODERS, encoder_arch
from pagellm.model.hf_config import QWEN_VL, class_labels, qwen_vl_decoder, qwen_vl_text, with_defaults


# The base-model classes of the served families (their checkpoints have no LM head and no ``model.`` prefix).
BASE_MODELS = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
# Sequence classifiers (reward models, classifiers): the model and a ``score`` head over its last token's state.
CLASSIFIERS = frozenset({"LlamaForSequenceClassification", "MistralForSequenceClassification",
                         "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification"})
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_OPT_IN_WINDOW = (*_QWEN, "smollm3")  # their sliding_window applies only with use_sliding_window
GEMMA = ("gemma", "gemma2", "gemma3_text")
OLMO = ("olmo2", "olmo3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")  # the MLP gate's: SwiGLU, or Gemma's GeGLU (tanh or exact)


NORMS_PRE, NORMS_SANDWICH, NORMS_POST, NORMS_PARALLEL = "pre", "sandwich", "post", "parallel"
LONGROPE = ("longrope", "su")  # "su": LongRoPE's name in the first Phi-3 configs


def rope_kind(scaling: dict | None) -> str:
    """A ``rope_scaling`` dict's kind (``rope_type``, or the older ``type``); "default" without one."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE, gpt-oss): a router picks ``top_k`` of
    ``num_experts`` SwiGLU experts per token, and the token's output is their outputs weighted by the router's softmax
    probabilities (Granite's softmax over the chosen logits alone: the renormalised probabilities; gpt-oss's too,
    taken over the chosen logits as it computes them)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k probabilities divided by their sum (Mixtral; Qwen's norm_topk_prob)
    # Qwen casts the routing weights to the hidden states' dtype before scaling an expert's output; Mixtral keeps
    # them float32 (the same in float32, one rounding apart in bfloat16).
    weights_in_model_dtype: bool
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert, gated by a sigmoid, beside the routed ones
    sparse_step: int = 1  # every sparse_step-th layer is sparse (Qwen's decoder_sparse_step) ...
    dense_layers: tuple[int, ...] = ()  # ... except these, which keep a dense MLP (Qwen's mlp_only_layers)
    # gpt-oss's: biases on the router and on each expert's projections, the softmax over the top-k logits, and its
    # clamped gate, (clamp(up) + 1) * g * sigmoid(alpha g) with g = min(gate, limit) (``swiglu_limit``: None is SwiGLU)
    bias: bool = False
    softmax_top_k: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> MoEConfig | None:
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        if not experts:
            return None
        model_type = cfg.get("model_type")
        mixtral, granite = model_type == "mixtral", model_type == "granitemoe"  # granite: softmax over the top k
        oss = model_type == "gpt_oss"
        return cls(
            num_experts=experts,
            top_k=int(cfg.get("num_experts_per_tok") or cfg["experts_per_token"]),  # gpt-oss's first configs' name
            intermediate_size=int(cfg["intermediate_size"] if mixtral or granite or oss
                                  else cfg["moe_intermediate_size"]),
            renormalize=mixtral or granite or oss or bool(cfg.get("norm_topk_prob", False)),
            weights_in_model_dtype=not mixtral,
            shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            dense_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            **({"bias": True, "softmax_top_k": True, "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
                "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702))} if oss else {}),
        )

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (its index in the whole model) has the experts' MLP."""
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


# Where a config lists no layer types: every Nth layer attends to every key (N its sliding_window_pattern, else this;
# OLMo 3's configs have no pattern key).
_GLOBAL_EVERY = {"gemma3_text": 6, "cohere2": 4, "olmo3": 4, "exaone4": 4, "gpt_oss": 2}
# The families whose o_proj has a bias where the config's attention_bias says so (as transformers builds them; Qwen2's
# attention bias, always on, is q/k/v's alone)
_O_PROJ_BIAS = ("llama", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "smollm3", "granite", "granitemoe",
                "olmo2", "olmo3", "cohere", "cohere2", "gpt_oss")


def _full_attention_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers of a model with a sliding window that attend to every key, as transformers builds the model:
    Qwen's ``layer_types`` where the config lists them, else its rule for the family; the windows of the other
    families (Mistral, Mixtral, Phi-3) and of Qwen3-MoE hold in every layer."""
    model_type = cfg.get("model_type")
    if model_type not in (*_QWEN, "gemma2", "smollm3", *_GLOBAL_EVERY):
        return ()
    if model_type == "gemma2" and not cfg.get("layer_types"):  # Gemma 2's first configs: every other layer is global
        return tuple(range(1, num_layers, 2))
    if model_type in _GLOBAL_EVERY and not cfg.get("layer_types"):  # their first configs: a period, or EXAONE 4's
        pattern = cfg.get("sliding_window_pattern") or _GLOBAL_EVERY[model_type]  # string of L and G
        if isinstance(pattern, str):
            return tuple(i for i in range(num_layers) if pattern[i % len(pattern)] == "G")
        return tuple(i for i in range(num_layers) if (i + 1) % int(pattern) == 0)
    if cfg.get("layer_types"):
        return tuple(i for i, kind in enumerate(cfg["layer_types"]) if kind != "sliding_attention")
    limit = int(cfg.get("max_window_layers", 28))
    if model_type in ("qwen2", "qwen3"):  # the first max_window_layers layers see everything
        return tuple(range(min(limit, num_layers)))
    if model_type == "qwen2_moe":  # the even-numbered (0-based) layers below max_window_layers slide
        return tuple(i for i in range(num_layers) if not (i % 2 == 0 and i < limit))
    return ()


# Vision-language models: a decoder (``text_config``) that takes image rows in place of image tokens' embeddings
VISION_MODELS = ("Idefics3ForConditionalGeneration", "LlavaForConditionalGeneration",
                 "LlavaNextForConditionalGeneration", "Gemma3ForConditionalGeneration", *QWEN_VL)
# ... whose image tokens attend to their image's other tokens both ways (each run of them: model/gemma3_mm.py)
BIDIRECTIONAL_IMAGES = ("Gemma3ForConditionalGeneration",)
# what a vision-language model's config says of its vision side, beside its text_config
_VISION_KEYS = ("vision_config", "scale_factor", "image_token_id", "image_token_index", "vision_feature_layer",
                "vision_feature_select_strategy", "projector_hidden_act", "multimodal_projector_bias",
                "image_grid_pinpoints", "mm_tokens_per_image")


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
    rotary_dim: int  # the first dimensions of each head the rotary embedding turns (Phi-4-mini: 3/4 of them)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    quantization: str | None = None  # a quantized checkpoint's scheme (``compressed_tensors.scheme_of``)
    qk_norm: bool = False  # RMSNorm over each head's q and k before the rotary embedding (Qwen3)
    qk_norm_all_heads: bool = False  # ... over all heads' q and k at once instead (OLMo 2 and 3)
    # A base-model checkpoint (``LlamaModel``, ``Qwen3Model``, ...: embedding models such as e5-mistral): weights
    # without the ``model.`` prefix and no LM head; it serves pooling (embedding) requests only.
    base_model: bool = False
    moe: MoEConfig | None = None  # the experts of a mixture-of-experts model
    # Under a sliding window, the layers that still attend to every key (Qwen's, as transformers lays them out).
    full_attention_layers: tuple[int, ...] = ()
    # A sequence classifier's class names (its ``score`` head's rows; none: no head): it serves classify requests only.
    labels: tuple[str, ...] = ()
    # Gemma's: token embeddings scaled by sqrt(hidden_size); GeGLU (``hidden_act``); Gemma 2 and 3's attention
    # scale (query_pre_attn_scalar ** -0.5) and norms around attention and the MLP (``norms``); Gemma 3's
    # sliding layers' own rope base (``local_rope_theta``, unscaled). Gemma's RMSNorm weights w act as 1 + w.
    embed_scale: float | None = None
    hidden_act: str = "silu"
    attn_scale: float | None = None
    local_rope_theta: float | None = None
    # Gemma 2's soft caps: attention scores and final logits pass through cap * tanh(x / cap)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Where each decoder layer's RMSNorms sit (``model/decoder.py``): NORMS_PRE (Llama's: before attention and the MLP),
    # NORMS_SANDWICH (Gemma 2 and 3: before and after each), NORMS_POST (OLMo 2: after each sublayer's output only) or
    # NORMS_PARALLEL (Cohere: one norm before attention and the MLP side by side, both added to the residual)
    norms: str = NORMS_PRE
    # SmolLM3's NoPE layers: their q and k attend without a rotary embedding
    nope_layers: tuple[int, ...] = ()
    # Qwen2-VL's multimodal rotary embedding: how many of each head's frequencies turn by the temporal, height and
    # width position (``layers/rotary.MRotaryEmbedding``); empty: one position
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False  # Qwen3-VL's: the sections' frequencies interleaved (t, h, w, t, h, w, ...)
    # Granite's: token embeddings times embedding_multiplier (a float, where Gemma's embed_scale is rounded to the
    # model's dtype), each sublayer's output times residual_multiplier before it joins the residual stream, logits
    # divided by logits_scaling (its attention_multiplier is attn_scale)
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    # Cohere's: LayerNorms (mean subtracted, no bias) where the others have RMSNorms, and logits times logit_scale
    layer_norm: bool = False
    logit_scale: float | None = None
    o_proj_bias: bool = False  # attention's output projection has a bias (``_O_PROJ_BIAS``)
    # gpt-oss's attention sinks: a learned logit per head that joins each softmax's denominator (no value of its own)
    attention_sinks: bool = False
    # A vision-language model's vision side (``VISION_MODELS``: its ``vision_config``, ``scale_factor``,
    # ``image_token_id``); the rest of this config is its decoder's (``text_config``)
    vision: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # An encoder-only embedding model's (``model/encoder_config.py``: BERT, RoBERTa, XLM-RoBERTa) config keys
    encoder: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def image_token_id(self) -> int | None:
        if self.vision is None:
            return None
        vision = self.vision
        return int(vision["image_token_id"] if "image_token_id" in vision else vision["image_token_index"])

    @property
    def bidirectional_images(self) -> bool:
        return self.vision is not None and self.architecture in BIDIRECTIONAL_IMAGES

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def pooling_only(self) -> bool:
        """No LM head to sample from: an embedding model's base checkpoint, or a classifier."""
        return self.base_model or self.num_labels > 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ArchConfig:
        archs = cfg.get("architectures") or [""]
        if archs[0] in ENCODERS:
            return cls(**encoder_arch(cfg))
        if archs[0] in VISION_MODELS and ("text_config" in cfg or "vision_config" in cfg):  # its decoder's config, its
            vision = {key: cfg[key] for key in _VISION_KEYS if key in cfg}  # vision side kept beside it
            if "image_token_id" not in vision and "image_token_index" not in vision:
                raise ValueError(f"{archs[0]}'s config names no image token (image_token_id or image_token_index)")
            text = {**with_defaults(cfg.get("text_config") or qwen_vl_text(cfg)), "architectures": archs}
            for key in ("quantization_config", "tie_word_embeddings"):  # the whole model's, where it says
                if key in cfg:
                    text[key] = cfg[key]
            return replace(cls.from_hf(text), vision=vision)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        cfg, mrope = qwen_vl_decoder(cfg) if archs[0] in QWEN_VL else (cfg, {})  # Qwen2's or Qwen3's, M-RoPE's
        model_type = cfg.get("model_type")
        window = cfg.get("sliding_window") if (model_type not in _OPT_IN_WINDOW or cfg.get("use_sliding_window")) \
            else None
        rope_params = cfg.get("rope_parameters") or {}
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        partial = cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor")) or 1.0
        rotary_dim = int(head_dim * float(partial))  # Phi-4-mini's 0.75: 96 of 128
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={partial} gives {rotary_dim} rotated dimensions of each head's "
                             f"{head_dim}; it must give an even number from 2 to {head_dim}")
        rope_scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default")
                                                   != "default" else None)
        rope_scaling = _with_original_context(None if rope_kind(rope_scaling) == "mrope" else rope_scaling, cfg)
        base_model = archs[0] in BASE_MODELS
        labels = class_labels(cfg) if archs[0] in CLASSIFIERS else ()
        family = {**_family_fields(cfg, hidden, head_dim), **mrope}  # (its fields win)
        return cls(**{**dict(
            architecture=archs[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) or base_model or bool(labels),
            attention_bias=bool(cfg.get("attention_bias", False)) or model_type == "qwen2" or
            (model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True))),
            sliding_window=int(window) if window else None,
            quantization=scheme_of(cfg),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            base_model=base_model,
            moe=MoEConfig.from_hf(cfg),
            full_attention_layers=_full_attention_layers(cfg, int(cfg["num_hidden_layers"])) if window else (),
            labels=labels,
            o_proj_bias=bool(cfg.get("attention_bias", False)) and model_type in _O_PROJ_BIAS,
        ), **family})

    @property
    def context_length(self) -> int:
        """The longest sequence the model takes: max_position_embeddings, or under YaRN its original context times
        its factor where that is longer (as vLLM derives it: the long-context configs of Qwen2.5 and Qwen3 keep their
        original max_position_embeddings)."""
        if rope_kind(self.rope_scaling) == "yarn":
            scaling = self.rope_scaling
            assert scaling is not None
            scaled = int(int(scaling["original_max_position_embeddings"]) * float(scaling["factor"]))
            return max(scaled, self.max_position_embeddings)
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (its index in the whole model), or None: every key."""
        return None if not self.sliding_window or layer in self.full_attention_layers else self.sliding_window

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _with_original_context(scaling: dict | None, cfg: dict[str, Any]) -> dict | None:
    """LongRoPE and YaRN scalings with their original context: their own, else the config's beside them (Phi-3 keeps
    it there), else its max_position_embeddings (as transformers standardizes them)."""
    if rope_kind(scaling) not in (*LONGROPE, "yarn") or "original_max_position_embeddings" in scaling:  # type: ignore
        return scaling
    return {**scaling, "original_max_position_embeddings":  # type: ignore[dict-item]
            int(cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"])}


def _family_fields(cfg: dict[str, Any], hidden: int, head_dim: int) -> dict[str, Any]:
    """The fields a family sets beyond the Llama family's common ones (which they override)."""
    model_type = cfg.get("model_type")
    if model_type in GEMMA:
        return _gemma(cfg, hidden, head_dim)
    if model_type == "smollm3":  # no_rope_layers: 1 where a layer rotates, 0 where it is NoPE (every 4th by default)
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(cfg["num_hidden_layers"])]
        return {"nope_layers": tuple(i for i, rotates in enumerate(flags) if not rotates)}
    if model_type in ("granite", "granitemoe", "granitemoehybrid"):
        return {"embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
                "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
                "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
                "attn_scale": float(cfg.get("attention_multiplier", 1.0)),
                **(_granite4(cfg) if model_type == "granitemoehybrid" else {})}
    if model_type in ("cohere", "cohere2"):
        return _cohere(cfg)
    if model_type == "gpt_oss":
        return {"attention_sinks": True}
    if model_type == "ernie4_5":
        if cfg.get("use_bias"):
            raise ValueError("ERNIE 4.5 with use_bias (biases on every projection) is not supported; its released "
                             "dense models have none")
        return {}
    if model_type == "exaone4":  # its full-attention layers are NoPE where some layers slide (the 32B's hybrid)
        full = _full_attention_layers(cfg, int(cfg["num_hidden_layers"])) if cfg.get("sliding_window") else ()
        return {"norms": NORMS_POST, "qk_norm": True, "nope_layers": full}
    if model_type in OLMO:
        fields: dict[str, Any] = {"norms": NORMS_POST, "qk_norm": True, "qk_norm_all_heads": True}
        theta = cfg.get("rope_theta", 500000.0)  # OLMo 3's first configs: one base, scaled in the full layers only
        return {**fields, **_rope_by_layer_type(cfg, theta, theta)} if model_type == "olmo3" else fields
    return {}


def _granite4(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite 4.0's attention-only models (granite-4.0-micro, -1b, -350m; ``GraniteMoeHybridForCausalLM`` with every
    layer attention and no routed experts): Granite's layer, its MLP the shared one; every layer NoPE unless
    ``position_embedding_type`` is "rope"."""
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * int(cfg["num_hidden_layers"])
    if any(kind not in ("attention", "full_attention") for kind in kinds) or int(cfg.get("num_local_experts") or 0):
        raise ValueError("Granite 4.0's Mamba layers and routed experts (its -h- models) are not supported; its "
                         "attention-only models (granite-4.0-micro, -1b, -350m) are")
    nope = () if cfg.get("position_embedding_type") == "rope" else tuple(range(int(cfg["num_hidden_layers"])))
    return {"intermediate_size": int(cfg["shared_intermediate_size"]), "nope_layers": nope}


def _cohere(cfg: dict[str, Any]) -> dict[str, Any]:
    """Cohere's (Command R, Aya) and Cohere 2's (Command R7B, Command A): LayerNorms, attention and the MLP side by
    side, scaled logits; Cohere 2 attends without a rotary embedding in its full-attention layers (its sliding ones
    rotate)."""
    if cfg.get("use_qk_norm"):
        raise ValueError("Cohere's q/k norms (use_qk_norm: Command R+) are not supported; Command R, R7B, A and Aya "
                         "have none")
    fields = {"norms": NORMS_PARALLEL, "layer_norm": True, "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
              "logit_scale": float(cfg.get("logit_scale", 1.0)),
              "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}
    if cfg.get("model_type") == "cohere2":
        layers = int(cfg["num_hidden_layers"])
        full = _full_attention_layers(cfg, layers) if cfg.get("sliding_window") else tuple(range(layers))
        fields["nope_layers"] = full
    return fields


def _rope_by_layer_type(cfg: dict[str, Any], theta: float, local_theta: float) -> dict[str, Any]:
    """The full-attention layers' rope base and scaling and the sliding layers' (unscaled) base, from transformers
    5's ``rope_parameters`` by layer type, else the first configs' keys (``theta``, ``rope_scaling``, and
    ``local_theta``: the family's key for the sliding layers' base)."""
    by_type = cfg.get("rope_parameters") or {}
    full, local = by_type.get("full_attention"), by_type.get("sliding_attention")
    if full is not None and local is not None:
        theta, scaling, local_theta = full["rope_theta"], full, local["rope_theta"]
    else:
        scaling = cfg.get("rope_scaling")
    scaling = _with_original_context(scaling, cfg) if rope_kind(scaling) != "default" else None
    same = scaling is None and float(local_theta) == float(theta)  # one rotary embedding serves every layer
    return {"rope_theta": float(theta), "rope_scaling": scaling,
            "local_rope_theta": None if same else float(local_theta)}


def _gemma(cfg: dict[str, Any], hidden: int, head_dim: int) -> dict[str, Any]:
    """ArchConfig's fields for Gemma (1), Gemma 2 (its soft caps) and Gemma 3's text model, from either of Gemma 3's
    config layouts (its first configs: rope_theta, rope_local_base_freq, rope_scaling; transformers 5's:
    rope_parameters by layer type)."""
    act = cfg.get("hidden_activation") or ("gelu_pytorch_tanh" if cfg.get("hidden_act") in (None, "gelu")
                                           else cfg["hidden_act"])
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    fields: dict[str, Any] = {"embed_scale": hidden ** 0.5, "hidden_act": act}
    if cfg.get("model_type") == "gemma2":
        return {**fields, "attn_scale": float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
                "norms": NORMS_SANDWICH, "attn_softcap": _cap(cfg, "attn_logit_softcapping"),
                "final_softcap": _cap(cfg, "final_logit_softcapping")}
    if cfg.get("model_type") != "gemma3_text":
        return fields
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(name) is not None:
            raise ValueError(f"{name} is Gemma 2's; a Gemma 3 config with it is not supported")
    return {**fields, "attn_scale": float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            "norms": NORMS_SANDWICH, "qk_norm": True,
            **_rope_by_layer_type(cfg, cfg.get("rope_theta", 1e6), cfg.get("rope_local_base_freq", 10000.0))}


def _cap(cfg: dict[str, Any], name: str) -> float | None:
    value = cfg.get(name)
    return float(value) if value else None
