"""LLaVA (LLaVA-1.5, its SigLIP-towered kin): a CLIP or SigLIP vision tower, a two-layer projector, a Llama-family
decoder (Llama, Vicuna, Mistral, Qwen2).

Contract: ``LlavaForConditionalGeneration`` is the decoder (``LlamaForCausalLM``, every fast path of it) with
``vision``, the tower and projector in plain PyTorch, computed as transformers' ``LlavaModel.get_image_features``
computes them: each image (``pixel_values`` [images, 3, H, W], the processor's fixed crop) as patches (a ``patch_size``
convolution; CLIP's with a class token first and a LayerNorm before the layers), learned positions, the encoder's
layers up to ``vision_feature_layer`` (the hidden state after that many layers, counted from the end when negative;
a list of them concatenated), the class token dropped under the "default" strategy, then ``linear_1``, the
projector's activation, ``linear_2``. ``image_rows(inputs)`` gives one row per image token in the prompt's order, in
the decoder's dtype. Only the layers the feature layer reads are built; the checkpoint's later layers, the tower's
final LayerNorm and SigLIP's pooling head are not loaded. Checkpoints name the parts ``vision_tower.vision_model.``,
``multi_modal_projector.``, ``language_model.model.`` and ``language_model.lm_head.`` (the released llava-hf ones;
transformers 5 saves the tower without ``vision_model.``), or with transformers 5's module names
(``model.vision_tower.``, ``model.multi_modal_projector.``, ``model.language_model.``, ``lm_head.``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model.arch import NORMS_PRE, ArchConfig, with_defaults
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.vit import EncoderLayer, act, activation

if TYPE_CHECKING:
    from pagellm.multimodal import MultiModalInputs

TOWERS = ("clip_vision_model", "siglip_vision_model")


class _Embeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any], clip: bool, dtype: torch.dtype) -> None:
        super().__init__()
        width, patch = int(cfg["hidden_size"]), int(cfg["patch_size"])
        positions = (int(cfg["image_size"]) // patch) ** 2 + clip
        if clip:
            self.class_embedding = nn.Parameter(torch.zeros(width, dtype=dtype))
        self.patch_embedding = nn.Conv2d(int(cfg.get("num_channels", 3)), width, patch, stride=patch, bias=not clip,
                                         dtype=dtype)
        self.position_embedding = nn.Embedding(positions, width, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        if hasattr(self, "class_embedding"):
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], 1)
        if x.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(f"images of {x.shape[1]} patches for a tower of {self.position_embedding.num_embeddings} "
                             "positions; send the model's processor's crops")
        return x + self.position_embedding.weight


class VisionTower(nn.Module):
    """CLIP's or SigLIP's vision model, its layers up to the deepest feature layer read (see the module doc)."""

    def __init__(self, cfg: dict[str, Any], feature_layers: list[int], dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.get("model_type") not in TOWERS:
            raise ValueError(f"LLaVA's vision tower {cfg.get('model_type')!r} is not supported; supported: "
                             f"{', '.join(TOWERS)}")
        self.clip = cfg["model_type"] == "clip_vision_model"
        total = int(cfg["num_hidden_layers"])
        self.feature_layers = [layer if layer >= 0 else total + 1 + layer for layer in feature_layers]
        if not all(0 <= layer <= total for layer in self.feature_layers):
            raise ValueError(f"vision_feature_layer {feature_layers} is outside the tower's {total} layers")
        self.vision_model = vm = nn.Module()
        vm.embeddings = _Embeddings(cfg, self.clip, dtype)
        if self.clip:  # (transformers' spelling)
            vm.pre_layrnorm = nn.LayerNorm(int(cfg["hidden_size"]), eps=float(cfg["layer_norm_eps"]), dtype=dtype)
        vm.encoder = nn.Module()
        vm.encoder.layers = nn.ModuleList(EncoderLayer(cfg, dtype) for _ in range(max(self.feature_layers)))

    def forward(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """The hidden states after each of ``feature_layers`` layers (0: the embeddings)."""
        vm = self.vision_model
        x = vm.embeddings(pixels)
        if self.clip:
            x = vm.pre_layrnorm(x)
        states = [x]
        for layer in vm.encoder.layers:
            states.append(layer(states[-1], None))
        return [states[i] for i in self.feature_layers]

    def loads(self, name: str) -> bool:
        """Whether a tower tensor (its name below ``vision_tower.vision_model.``) has a place here: not the final LayerNorm, the
        pooling head, nor a layer past the feature layers."""
        if name.startswith(("post_layernorm.", "head.")):
            return False
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) < len(self.vision_model.encoder.layers)
        return True


class LlavaVision(nn.Module):
    def __init__(self, vision: dict[str, Any], text_width: int, dtype: torch.dtype) -> None:
        super().__init__()
        layer = vision.get("vision_feature_layer", -2)
        layers = [int(i) for i in layer] if isinstance(layer, (list, tuple)) else [int(layer)]
        self.tower = VisionTower(with_defaults(vision.get("vision_config") or {}), layers, dtype)
        self.strategy = vision.get("vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.strategy!r} is not supported: default or full")
        width, bias = int(self.tower.vision_model.embeddings.patch_embedding.out_channels), \
            bool(vision.get("multimodal_projector_bias", True))
        self.projector = nn.Module()
        self.projector.linear_1 = nn.Linear(width * len(layers), text_width, bias=bias, dtype=dtype)
        self.projector.linear_2 = nn.Linear(text_width, text_width, bias=bias, dtype=dtype)
        self.kind = activation(vision.get("projector_hidden_act", "gelu"))

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images · tokens per image, text width] of ``pixels`` [images, 3, H, W]."""
        dtype = self.projector.linear_1.weight.dtype
        states = self.tower(pixels.to(dtype))
        if self.strategy == "default" and self.tower.clip:  # the class token (SigLIP's towers have none)
            states = [s[:, 1:] for s in states]
        features = torch.cat(states, -1)
        rows = self.projector.linear_2(act(self.projector.linear_1(features), self.kind))
        return rows.flatten(0, 1)


class LlavaForConditionalGeneration(LlamaForCausalLM):
    TOWER = re.compile(r"^(model\.)?vision_tower\.(vision_model\.)?")
    PROJECTOR = re.compile(r"^(model\.)?multi_modal_projector\.")
    DECODER = re.compile(r"^(model\.)?language_model\.(model\.)?")

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        if cfg.embed_scale is not None or cfg.norms != NORMS_PRE:
            raise ValueError("LLaVA's decoder must be of the Llama family (Llama, Vicuna, Mistral, Qwen2); this "
                             "one's text_config is not")
        super().__init__(cfg, dtype, parallel)
        self.vision = LlavaVision(cfg.vision or {}, cfg.hidden_size, dtype)

    def image_rows(self, images: MultiModalInputs) -> torch.Tensor:
        pixels = images.tensor("pixel_values")
        assert pixels is not None
        return self.vision(pixels).to(self.model.norm.weight.dtype)

    def _target(self, name: str) -> tuple[str | None, str | int | None]:
        """The tower's (those ``VisionTower.loads`` keeps) and projector's tensors by their own names; the decoder's
        as a Llama checkpoint's."""
        if match := self.TOWER.match(name):
            rest = name[match.end():]
            return (f"vision.tower.vision_model.{rest}" if self.vision.tower.loads(rest) else None), None
        if match := self.PROJECTOR.match(name):
            return f"vision.projector.{name[match.end():]}", None
        if name.startswith("language_model.lm_head."):
            return super()._target(name.removeprefix("language_model."))
        if match := self.DECODER.match(name):
            return super()._target(f"model.{name[match.end():]}")
        return super()._target(name)
