"""Gemma 3's vision-language models (gemma-3-4b-it, -12b, -27b: ``Gemma3ForConditionalGeneration``): a SigLIP vision
tower, Gemma 3's projector, Gemma 3's text decoder.

Contract: ``Gemma3ForConditionalGeneration`` is the decoder (``GemmaForCausalLM``, every fast path of it) with
``vision``, computed as transformers' ``Gemma3Model.get_image_features`` computes it: each image (``pixel_values``
[crops, 3, H, W], the processor's fixed square; a pan-and-scan crop is one more such image) through every layer of
the SigLIP tower and its final LayerNorm, its patch grid average-pooled down to ``mm_tokens_per_image`` rows, each
row RMS-normed (Gemma's 1 + w, in float32) and multiplied by ``mm_input_projection_weight``. Unlike the other
vision-language models' image tokens, each image's (each run of image tokens) attend to one another both ways while
the prompt is computed, as transformers' mask does (``ArchConfig.bidirectional_images``: the runner gives each such
token its run's end, ``CommonAttentionInputs.visible_ends``, and the scheduler never ends a step inside a run,
``SchedulerConfig.disable_chunked_mm_input``). Checkpoints name the parts as LLaVA's do (``VisionNames``: the
released ``vision_tower.vision_model.``, ``multi_modal_projector.``, ``language_model.model.``, or transformers 5's
``model.``-prefixed names); the decoder's norm weights load as Gemma's 1 + w, the tower's LayerNorms as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model.arch import ArchConfig
from pagellm.model.llama import GemmaForCausalLM, LlamaForCausalLM
from pagellm.model.llava import VisionNames, VisionTower, completed

if TYPE_CHECKING:
    from pagellm.multimodal import MultiModalInputs


def tokens_per_image(vision: dict[str, Any]) -> int:
    """The rows one image (one crop) makes."""
    return int(vision.get("mm_tokens_per_image", 256))


class Projector(nn.Module):
    """Gemma 3's ``multi_modal_projector``: the tower's patch grid average-pooled to ``tokens`` rows, RMS-normed,
    projected to the decoder's width."""

    def __init__(self, tower: dict[str, Any], tokens: int, text_width: int, dtype: torch.dtype) -> None:
        super().__init__()
        width = int(tower["hidden_size"])
        self.side = int(tower["image_size"]) // int(tower["patch_size"])
        per_side = int(round(tokens ** 0.5))
        if per_side * per_side != tokens or self.side % per_side:
            raise ValueError(f"mm_tokens_per_image={tokens} is no square that pools the tower's {self.side} x "
                             f"{self.side} patches evenly")
        self.kernel = self.side // per_side
        self.eps = float(tower["layer_norm_eps"])
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(width, text_width, dtype=dtype))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(width, dtype=dtype))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """[crops, tokens, text width] of the tower's last states [crops, patches, width]."""
        crops, _, width = states.shape
        grid = states.transpose(1, 2).reshape(crops, width, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.mm_soft_emb_norm.weight.float())
        return torch.matmul(x.to(states.dtype), self.mm_input_projection_weight)


class Gemma3Vision(nn.Module):
    def __init__(self, vision: dict[str, Any], text_width: int, dtype: torch.dtype) -> None:
        super().__init__()
        vision = completed(vision)
        tower = vision["vision_config"]
        if tower.get("model_type") != "siglip_vision_model":
            raise ValueError(f"Gemma 3's vision tower must be SigLIP's; this one is {tower.get('model_type')!r}")
        self.tower = VisionTower(tower, [-1], dtype, post_norm=True)
        self.projector = Projector(tower, tokens_per_image(vision), text_width, dtype)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[crops · tokens per image, text width] of ``pixels`` [crops, 3, H, W]."""
        (states,) = self.tower(pixels.to(self.projector.mm_input_projection_weight.dtype))
        return self.projector(states).flatten(0, 1)


class Gemma3ForConditionalGeneration(VisionNames, GemmaForCausalLM):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        super().__init__(cfg, dtype, parallel)
        self.vision = None if cfg.vision is None else Gemma3Vision(cfg.vision, cfg.hidden_size, dtype)

    def image_rows(self, images: MultiModalInputs, skip: int = 0, last: int | None = None) -> torch.Tensor:
        """The encoder's rows of images ``skip`` to ``last`` (one crop each where the frontend counted each image's
        tokens; else every crop, 0 to None)."""
        pixels = images.tensor("pixel_values")
        assert pixels is not None
        return self.vision(pixels[skip:last]).to(self.model.norm.weight.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], quantization: str | None = None) -> None:
        """The decoder's norm weights as Gemma's 1 + w (``GemmaForCausalLM``); the tower's and projector's as they
        are (the projector adds its 1 itself, in float32)."""
        def adjusted() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                vision = self.TOWER.match(name) or self.PROJECTOR.match(name)
                yield name, (tensor.float() + 1.0 if not vision and name.endswith("norm.weight") else tensor)

        LlamaForCausalLM.load_weights(self, adjusted(), quantization)
