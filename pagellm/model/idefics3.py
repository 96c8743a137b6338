"""Idefics3 (SmolVLM, Idefics3-8B): a SigLIP vision encoder, a pixel-shuffle connector, and a Llama decoder.

Contract: ``Idefics3ForConditionalGeneration`` is the Llama decoder (``LlamaForCausalLM``, every fast path of it)
with ``vision``, the encoder and connector in plain PyTorch, computed as transformers' ``Idefics3Model.
get_image_features`` computes them: each image tile's patches (a ``patch_size`` convolution) plus position
embeddings bucketed over the tile's real patches (``pixel_attention_mask``: a padded tile's patches beyond its
image take position 0 and are masked as keys), ``num_hidden_layers`` pre-LayerNorm encoder layers (bidirectional
attention with biases, a GELU MLP), a final LayerNorm, then the connector: ``scale_factor``² neighbouring patches
shuffled into one row, projected to the decoder's width (no bias). ``image_rows(inputs)`` gives one row per image
token, in the prompt's order (tiles as the processor lays them out), in the decoder's dtype; all-zero padding tiles
are dropped, as transformers drops them. The checkpoint's ``model.text_model.*`` tensors are the decoder's,
``model.vision_model.*`` and ``model.connector.*`` the encoder's; the encoder is replicated on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model.arch import ArchConfig
from pagellm.model.layers.linear import ReplicatedLinear
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.vit import EncoderLayer

if TYPE_CHECKING:
    from pagellm.multimodal import MultiModalInputs


class _Embeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        width, self.patch = int(cfg["hidden_size"]), int(cfg["patch_size"])
        self.side = int(cfg["image_size"]) // self.patch  # the position grid's patches per side
        self.patch_embedding = nn.Conv2d(int(cfg.get("num_channels", 3)), width, self.patch, stride=self.patch,
                                         dtype=dtype)
        self.position_embedding = nn.Embedding(self.side ** 2, width, dtype=dtype)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """Patches [n, rows * cols, width]; ``patch_mask`` [n, rows, cols] marks a tile's real patches, whose
        positions spread over the whole grid (NaViT's fractional buckets)."""
        n = pixels.shape[0]
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side)
        fractions = [torch.arange(patch_mask.shape[d], dtype=torch.float32)[None, :] * (1.0 / real)[:, None]
                     for d, real in ((1, patch_mask[:, :, 0].sum(1)), (2, patch_mask[:, 0, :].sum(1)))]
        rows, cols = (torch.bucketize(f.clamp(max=1 - 1e-6), boundaries, right=True) for f in fractions)
        positions = (rows[:, :, None] * self.side + cols[:, None, :]).reshape(n, -1)
        positions = torch.where(patch_mask.reshape(n, -1), positions, torch.zeros_like(positions))
        return x + self.position_embedding(positions)


class Idefics3Vision(nn.Module):
    """The encoder and the connector (see the module doc)."""

    def __init__(self, cfg: dict[str, Any], scale_factor: int, text_width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = scale_factor
        self.embeddings = _Embeddings(cfg, dtype)
        self.tile_rows = (self.embeddings.side // scale_factor) ** 2  # the connector's rows of one tile
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(cfg, dtype) for _ in range(int(cfg["num_hidden_layers"])))
        width = int(cfg["hidden_size"])
        self.post_layernorm = nn.LayerNorm(width, eps=float(cfg.get("layer_norm_eps", 1e-6)), dtype=dtype)
        self.connector = nn.Module()
        self.connector.modality_projection = nn.Module()
        self.connector.modality_projection.proj = ReplicatedLinear(width * scale_factor ** 2, text_width, dtype)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None) -> torch.Tensor:
        """[tiles · tokens per tile, text width] of ``pixels`` [tiles, 3, H, W] (all-zero tiles dropped)."""
        dtype = self.post_layernorm.weight.dtype
        real = (pixels != 0).flatten(1).any(1)
        pixels = pixels[real].to(dtype)
        mask = torch.ones(pixels.shape[0], *pixels.shape[2:], dtype=torch.bool) if pixel_mask is None \
            else pixel_mask[real].bool()
        p = self.embeddings.patch
        patch_mask = mask.unfold(1, p, p).unfold(2, p, p).sum((-1, -2)) > 0
        x = self.embeddings(pixels, patch_mask)
        keys = patch_mask.reshape(pixels.shape[0], -1)
        keys = None if bool(keys.all()) else keys  # whole tiles (the processor's): no mask to apply
        for layer in self.encoder.layers:
            x = layer(x, keys)
        return self.connector.modality_projection.proj(self._shuffle(self.post_layernorm(x))).flatten(0, 1)

    def _shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """Each ``scale``×``scale`` square of patches as one row (transformers' ``pixel_shuffle``)."""
        n, length, width = x.shape
        side, s = int(length ** 0.5), self.scale
        x = x.view(n, side, side // s, width * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, width * s * s).permute(0, 2, 1, 3)
        return x.reshape(n, length // (s * s), width * s * s)


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    VISION = (("model.vision_model.", "vision."), ("model.connector.", "vision.connector."))

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        super().__init__(cfg, dtype, parallel)
        vision = cfg.vision
        self.vision = None if vision is None else Idefics3Vision(vision.get("vision_config") or {},
                                                                 int(vision.get("scale_factor", 2)), cfg.hidden_size,
                                                                 dtype)

    def encode_images(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None) -> torch.Tensor:
        rows = self.vision(pixel_values, pixel_attention_mask)
        return rows.to(self.model.norm.weight.dtype)

    def image_rows(self, images: MultiModalInputs, skip: int = 0, last: int | None = None) -> torch.Tensor:
        """The rows of images ``skip`` to ``last`` (None: the last one; each image's tiles follow the ones before,
        its ``items`` count of rows a tile's worth at a time; the batch's all-zero padding tiles trail)."""
        pixels, mask = images.tensor("pixel_values"), images.tensor("pixel_attention_mask")
        assert pixels is not None
        counts = [count for _, count in images.items]
        lo = sum(counts[:skip]) // self.vision.tile_rows
        hi = None if last is None else sum(counts[:last]) // self.vision.tile_rows
        return self.encode_images(pixels[lo:hi], None if mask is None else mask[lo:hi])

    def _target(self, name: str) -> tuple[str | None, str | int | None]:
        """The encoder's tensors by their own names (none of the decoder's fused matrices); the decoder's as a Llama
        checkpoint's (``model.text_model.layers.N`` is ``model.layers.N``)."""
        for prefix, ours in self.VISION:
            if name.startswith(prefix):  # skipped without ``vision`` (language_model_only)
                return (ours + name[len(prefix):] if self.vision is not None else None), None
        return super()._target(name.replace("model.text_model.", "model.", 1))
