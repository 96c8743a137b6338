"""LLaVA (LLaVA-1.5, its SigLIP-towered kin) and LLaVA-NeXT (LLaVA-1.6): a CLIP or SigLIP vision tower, a two-layer
projector, a Llama-family decoder (Llama, Vicuna, Mistral, Qwen2).

Contract: ``LlavaForConditionalGeneration`` is the decoder (``LlamaForCausalLM``, every fast path of it) with
``vision``, the tower and projector in plain PyTorch, computed as transformers' ``LlavaModel.get_image_features``
computes them: each image (``pixel_values`` [images, 3, H, W], the processor's fixed crop) as patches (a
``patch_size`` convolution; CLIP's with a class token first and a LayerNorm before the layers), learned positions, the
encoder's layers up to ``vision_feature_layer`` (the hidden state after that many layers, counted from the end when
negative; a list of them concatenated), the first token (CLIP's class token) dropped under the "default" strategy,
then ``linear_1``, the projector's activation, ``linear_2``. ``LlavaNextForConditionalGeneration`` takes each image as
the processor tiles it (``pixel_values`` [images, tiles, 3, H, W] and ``image_sizes``): the whole image's tile, then
the grid of its best resolution among ``image_grid_pinpoints``, its patch rows laid out across the grid, cut to the
image's aspect ratio and each followed by ``image_newline`` (transformers' ``pack_image_features``).
``image_rows(inputs, skip, last)`` gives one row per image token of images ``skip`` to ``last`` (after those the
prefix cache holds, up to those no chunk reached yet), in the prompt's order, in the decoder's dtype. Only the
layers the feature layer reads are built; the checkpoint's later layers, the tower's final LayerNorm and SigLIP's
pooling head are not loaded. Checkpoints name the
parts ``vision_tower.vision_model.``, ``multi_modal_projector.``, ``language_model.model.`` and
``language_model.lm_head.`` (the released llava-hf ones; transformers 5 saves the tower without ``vision_model.``), or
with transformers 5's module names (``model.vision_tower.``, ``model.multi_modal_projector.``,
``model.language_model.``, ``lm_head.``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model.arch import NORMS_PRE, ArchConfig
from pagellm.model.hf_config import with_defaults
from pagellm.model.layers.linear import ReplicatedLinear
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.vit import EncoderLayer, act, activation

if TYPE_CHECKING:
    from pagellm.multimodal import MultiModalInputs

TOWERS = ("clip_vision_model", "siglip_vision_model")
DEFAULT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # LLaVA-NeXT's (transformers')


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

    def __init__(self, cfg: dict[str, Any], feature_layers: list[int], dtype: torch.dtype,
                 post_norm: bool = False) -> None:
        """``post_norm``: the last layer's state through the tower's final LayerNorm (Gemma 3 reads it so)."""
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
        if post_norm:
            vm.post_layernorm = nn.LayerNorm(int(cfg["hidden_size"]), eps=float(cfg["layer_norm_eps"]), dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """The hidden states after each of ``feature_layers`` layers (0: the embeddings)."""
        vm = self.vision_model
        x = vm.embeddings(pixels)
        if self.clip:
            x = vm.pre_layrnorm(x)
        states = {0: x}
        for depth, layer in enumerate(vm.encoder.layers, 1):
            x = layer(x, None)
            if depth in self.feature_layers:  # only the layers read are kept
                states[depth] = x
        if hasattr(vm, "post_layernorm"):
            states[len(vm.encoder.layers)] = vm.post_layernorm(x)
        return [states[i] for i in self.feature_layers]

    def loads(self, name: str) -> bool:
        """Whether a tower tensor (its name below ``vision_tower.vision_model.``) has a place here: not the final
        LayerNorm (unless it is read), the pooling head, nor a layer past the feature layers."""
        if name.startswith("head.") or (name.startswith("post_layernorm.")
                                        and not hasattr(self.vision_model, "post_layernorm")):
            return False
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) < len(self.vision_model.encoder.layers)
        return True


class LlavaVision(nn.Module):
    def __init__(self, vision: dict[str, Any], text_width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = vision = completed(vision)
        layer = vision.get("vision_feature_layer", -2)
        layers = [int(i) for i in layer] if isinstance(layer, (list, tuple)) else [int(layer)]
        self.tower = VisionTower(vision["vision_config"], layers, dtype)
        self.strategy = vision.get("vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.strategy!r} is not supported: default or full")
        width, bias = int(self.tower.vision_model.embeddings.patch_embedding.out_channels), \
            bool(vision.get("multimodal_projector_bias", True))
        self.projector = nn.Module()
        self.projector.linear_1 = ReplicatedLinear(width * len(layers), text_width, dtype, bias=bias)
        self.projector.linear_2 = ReplicatedLinear(text_width, text_width, dtype, bias=bias)
        self.kind = activation(vision.get("projector_hidden_act", "gelu"))

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images · tokens per image, text width] of ``pixels`` [images, 3, H, W]."""
        return self.project(pixels).flatten(0, 1)

    def project(self, pixels: torch.Tensor) -> torch.Tensor:
        """[tiles, tokens per tile, text width] of ``pixels`` [tiles, 3, H, W]."""
        states = self.tower(pixels.to(self.projector.linear_1.weight.dtype))
        if self.strategy == "default":  # the first token (CLIP's class token; as transformers, whatever the tower)
            states = [s[:, 1:] for s in states]
        return self.projector.linear_2(act(self.projector.linear_1(torch.cat(states, -1)), self.kind))


class LlavaNextVision(LlavaVision):
    """LLaVA-NeXT's any-resolution images: each image a base tile (the whole image) and a grid of tiles (its best
    resolution among ``image_grid_pinpoints``), the grid's rows unpadded to the image's aspect ratio, each row of
    patches followed by ``image_newline``."""

    def __init__(self, vision: dict[str, Any], text_width: int, dtype: torch.dtype) -> None:
        super().__init__(vision, text_width, dtype)
        self.image_newline = nn.Parameter(torch.zeros(text_width, dtype=dtype))

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """[all the images' rows, text width] of ``pixels`` [images, tiles (padded), 3, H, W] and the images'
        original ``image_sizes`` [images, 2] (height, width)."""
        out, side = [], side_of(self.config)
        for tiles, (height, width) in zip(pixels, image_sizes.tolist()):
            rows, cols = anyres_grid(self.config, height, width)
            features = self.project(tiles[:rows * cols + 1])
            grid = features[1:].reshape(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3)
            grid = grid.reshape(-1, rows * side, cols * side)
            kept_rows, kept_cols = unpadded(self.config, (rows, cols), height, width)
            top, left = (rows * side - kept_rows) // 2, (cols * side - kept_cols) // 2
            grid = grid[:, top:top + kept_rows, left:left + kept_cols]
            newline = self.image_newline[:, None, None].expand(-1, kept_rows, 1).to(grid.dtype)
            out += [features[0], torch.cat([grid, newline], -1).flatten(1).T]
        return torch.cat(out)


def completed(vision: dict[str, Any]) -> dict[str, Any]:
    """A LLaVA config's vision side with its tower's config completed by transformers' defaults
    (``hf_config.with_defaults``), as the functions below read it."""
    return {**vision, "vision_config": with_defaults(vision.get("vision_config") or {})}


def side_of(vision: dict[str, Any]) -> int:
    """Patches along a tile's side (``vision``: ``completed``)."""
    return int(vision["vision_config"]["image_size"]) // int(vision["vision_config"]["patch_size"])


def tile_tokens(vision: dict[str, Any]) -> int:
    """The rows one tile makes (a LLaVA-1.5 image, a LLaVA-NeXT base tile): its patches, a CLIP tower's class token,
    less the first token under the "default" strategy."""
    return side_of(vision) ** 2 + (vision["vision_config"].get("model_type") == "clip_vision_model") - \
        (vision.get("vision_feature_select_strategy", "default") == "default")


def anyres_grid(vision: dict[str, Any], height: int, width: int) -> tuple[int, int]:
    """The grid of tiles (rows, columns) of an image of ``height`` × ``width``: its best resolution among
    ``image_grid_pinpoints`` (transformers' choice), in tiles."""
    from transformers.image_processing_utils import select_best_resolution

    tile = int(vision["vision_config"]["image_size"])
    best_height, best_width = select_best_resolution((height, width), vision.get("image_grid_pinpoints")
                                                     or DEFAULT_PINPOINTS)
    return best_height // tile, best_width // tile


def unpadded(vision: dict[str, Any], grid: tuple[int, int], height: int, width: int) -> tuple[int, int]:
    """The patch rows and columns of an image's ``grid`` of tiles (``anyres_grid``) that show the image (the padding
    its aspect ratio left cut off, as transformers' ``unpad_image``)."""
    rows, cols = (n * side_of(vision) for n in grid)
    if width / height > cols / rows:
        padding = (rows - int(round(height * (cols / width), 7))) // 2
        return rows - 2 * padding, cols
    padding = (cols - int(round(width * (rows / height), 7))) // 2
    return rows, cols - 2 * padding


def image_tokens(vision: dict[str, Any], architecture: str, height: int, width: int) -> int:
    """The rows an image of ``height`` × ``width`` makes (one image token each; ``vision``: ``completed``)."""
    if architecture == "LlavaForConditionalGeneration":
        return tile_tokens(vision)
    kept_rows, kept_cols = unpadded(vision, anyres_grid(vision, height, width), height, width)
    return tile_tokens(vision) + kept_rows * (kept_cols + 1)


class VisionNames:
    """A vision-language checkpoint's names (LLaVA's, Gemma 3's): its tower's tensors (those ``VisionTower.loads``
    keeps) and projector's under ``vision.``, its decoder's as a text checkpoint's (``_target``, before the
    decoder class's own). Without ``vision`` (``language_model_only``) the tower's and projector's are skipped."""

    TOWER = re.compile(r"^(model\.)?vision_tower\.(vision_model\.)?")
    PROJECTOR = re.compile(r"^(model\.)?multi_modal_projector\.")
    DECODER = re.compile(r"^(model\.)?language_model\.(model\.)?")
    vision: Any

    def _target(self, name: str) -> tuple[str | None, str | int | None]:
        text = super()._target  # type: ignore[misc]
        if match := self.TOWER.match(name):
            rest = name[match.end():]
            keep = self.vision is not None and self.vision.tower.loads(rest)
            return (f"vision.tower.vision_model.{rest}" if keep else None), None
        if match := self.PROJECTOR.match(name):
            return (f"vision.projector.{name[match.end():]}" if self.vision is not None else None), None
        if name.startswith("language_model.lm_head."):
            return text(name.removeprefix("language_model."))
        if match := self.DECODER.match(name):
            return text(f"model.{name[match.end():]}")
        return text(name)


class LlavaForConditionalGeneration(VisionNames, LlamaForCausalLM):
    VISION_CLASS = LlavaVision

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        if cfg.embed_scale is not None or cfg.norms != NORMS_PRE:
            raise ValueError("LLaVA's decoder must be of the Llama family (Llama, Vicuna, Mistral, Qwen2); this "
                             "one's text_config is not")
        super().__init__(cfg, dtype, parallel)
        self.vision = None if cfg.vision is None else self.VISION_CLASS(cfg.vision, cfg.hidden_size, dtype)

    def image_rows(self, images: MultiModalInputs, skip: int = 0, last: int | None = None) -> torch.Tensor:
        """The rows of images ``skip`` to ``last`` (None: the last one): precomputed embeddings' own, or the
        encoder's."""
        embeds = images.tensor("image_embeds")
        if embeds is not None:
            counts = [count for _, count in images.items]
            end = None if last is None else sum(counts[:last])
            return embeds[sum(counts[:skip]):end].to(self.model.norm.weight.dtype)
        pixels = images.tensor("pixel_values")
        assert pixels is not None
        return self.vision(pixels[skip:last]).to(self.model.norm.weight.dtype)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT (LLaVA-1.6): LLaVA with any-resolution images (``LlavaNextVision``); ``image_newline`` is the
    checkpoint's ``image_newline`` or ``model.image_newline``."""

    VISION_CLASS = LlavaNextVision

    def image_rows(self, images: MultiModalInputs, skip: int = 0, last: int | None = None) -> torch.Tensor:
        if "image_embeds" in images.tensors:
            return super().image_rows(images, skip, last)
        pixels, sizes = images.tensor("pixel_values"), images.tensor("image_sizes")
        assert pixels is not None and sizes is not None
        return self.vision(pixels[skip:last], sizes[skip:last]).to(self.model.norm.weight.dtype)

    def _target(self, name: str) -> tuple[str | None, str | int | None]:
        if name in ("image_newline", "model.image_newline"):
            return ("vision.image_newline" if self.vision is not None else None), None
        return super()._target(name)
