"""Qwen3-VL (``Qwen3VLForConditionalGeneration``: Qwen3-VL-2B, -4B, -8B, -32B; ``Qwen3VLMoeForConditionalGeneration``:
-30B-A3B, -235B-A22B, Qwen3-MoE's decoder): Qwen2-VL's way with images
(``model/qwen2_vl.py``: each image at its own resolution, merged 2 x 2 patch blocks, M-RoPE positions), a SigLIP-2
style tower and DeepStack.

Contract: the tower adds to each patch's embedding (a convolution with a bias) its learned position embedding,
resampled bilinearly from the checkpoint's square grid (``num_position_embeddings``) to the image's grid (transformers'
``get_vision_interpolation_indices_and_weights``, corners aligned), runs the blocks (LayerNorms, the 2-D rotary
embedding, attention over each image, a GELU MLP: ``linear_fc1``/``linear_fc2``) and merges each 2 x 2 block into one
row (``merger``: norm, then the MLP). DeepStack: the states after each of ``deepstack_visual_indexes``' blocks,
merged by their own mergers (normed after the merge), are added to the decoder's hidden states at the image tokens'
positions after its first as many layers. ``image_rows`` gives each image token's row and its DeepStack rows side by
side ([tokens, hidden · (1 + DeepStack layers)], ``image_row_width``); a step whose inputs place such rows runs the
Python layers (the others the native stack). The decoder is Qwen3's (per-head q/k norms), its M-RoPE sections
interleaved (``MRotaryEmbedding(interleaved=True)``). Checkpoints name the tower ``model.visual.`` and the decoder
``model.language_model.`` (the released ones), or ``visual.`` and ``model.``.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.runs import Runs
from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model.arch import ArchConfig
from pagellm.model.hf_config import with_defaults
from pagellm.model.layers.linear import ReplicatedLinear
from pagellm.model.llama import _gate_up
from pagellm.model.qwen2_vl import (Qwen2VLForConditionalGeneration, RunsOnKernel, VisionAttention, rotary_and_frames,
                                    vision_inv_freq)
from pagellm.model.vit import act, activation


class Block(nn.Module):
    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        width, inner = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        self.norm1 = nn.LayerNorm(width, eps=1e-6, dtype=dtype)
        self.norm2 = nn.LayerNorm(width, eps=1e-6, dtype=dtype)
        self.attn = VisionAttention(width, int(cfg["num_heads"]), dtype)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = ReplicatedLinear(width, inner, dtype, bias=True)
        self.mlp.linear_fc2 = ReplicatedLinear(inner, width, dtype, bias=True)
        self.kind = activation(cfg.get("hidden_act", "gelu_pytorch_tanh"))

    def forward(self, x: torch.Tensor, runs: Runs, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), runs, cos, sin)
        return x + self.mlp.linear_fc2(act(self.mlp.linear_fc1(self.norm2(x)), self.kind))


class Merger(nn.Module):
    """Each 2 x 2 block of patches to one row: normed per patch (the last states') or per merged block
    (``after``: DeepStack's), then a GELU MLP."""

    def __init__(self, width: int, out: int, merge: int, after: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.after = width * merge * merge, after
        self.norm = nn.LayerNorm(self.inner if after else width, eps=1e-6, dtype=dtype)
        self.linear_fc1 = ReplicatedLinear(self.inner, self.inner, dtype, bias=True)
        self.linear_fc2 = ReplicatedLinear(self.inner, out, dtype, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.inner)) if self.after else self.norm(x).view(-1, self.inner)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(RunsOnKernel):
    def __init__(self, vision: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        cfg = self.config = with_defaults({"model_type": "qwen3_vl_vision", **(vision.get("vision_config") or {})})
        width, out, self.merge = int(cfg["hidden_size"]), int(cfg["out_hidden_size"]), int(cfg["spatial_merge_size"])
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(int(cfg.get("in_channels", 3)), width, bias=True, dtype=dtype,
                                          kernel_size=(int(cfg["temporal_patch_size"]), *[int(cfg["patch_size"])] * 2))
        self.pos_embed = nn.Embedding(int(cfg["num_position_embeddings"]), width, dtype=dtype)
        self.side = int(int(cfg["num_position_embeddings"]) ** 0.5)
        self.blocks = nn.ModuleList(Block(cfg, dtype) for _ in range(int(cfg["depth"])))
        self.merger = Merger(width, out, self.merge, False, dtype)
        self.deepstack = [int(i) for i in cfg.get("deepstack_visual_indexes") or ()]
        if any(not 0 <= i < len(self.blocks) for i in self.deepstack):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack} name blocks outside the tower's "
                             f"{len(self.blocks)}")
        self.deepstack_merger_list = nn.ModuleList(Merger(width, out, self.merge, True, dtype) for _ in self.deepstack)
        self.inv_freq, self.head_size = vision_inv_freq(cfg, width), width // int(cfg["num_heads"])

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """[image tokens, text width · (1 + DeepStack layers)] of ``pixels`` and ``grids`` [images, 3]."""
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        proj = self.patch_embed.proj
        x = F.linear(pixels.to(proj.weight.dtype), proj.weight.flatten(1), proj.bias)
        index, weights = get_vision_interpolation_indices_and_weights(
            grids, num_grid_per_side=self.side, mode="bilinear", align_corners=True, spatial_merge_size=self.merge)
        x = x + (self.pos_embed(index) * weights[:, :, None]).sum(1).to(x.dtype)
        cos, sin, bounds = rotary_and_frames(grids, self.merge, self.inv_freq)
        runs, deep = self.runs(bounds, x.dtype), []
        for i, block in enumerate(self.blocks):
            x = block(x, runs, cos, sin)
            if i in self.deepstack:
                deep.append(self.deepstack_merger_list[self.deepstack.index(i)](x))
        return torch.cat([self.merger(x), *deep], -1)


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        if parallel.pp_size > 1:
            raise ValueError("Qwen3-VL runs on one pipeline stage (its DeepStack rows join the first layers); drop "
                             "pipeline_parallel_size")
        super().__init__(cfg, dtype, parallel)
        self.deepstack = 0 if self.vision is None else len(self.vision.deepstack)
        self.image_row_width = cfg.hidden_size * (1 + self.deepstack)  # the rows ``image_rows`` gives a token

    def tower(self, vision: dict[str, Any], dtype: torch.dtype) -> nn.Module:
        return VisionTower(vision, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """As every decoder's, and where the step places image rows, their DeepStack rows added after the first
        layers (the Python layers)."""
        width = self.cfg.hidden_size
        if embeds is None or embeds[1].shape[1] == width:
            return super().forward(input_ids, positions, num_layers, embeds)
        flat, rows = embeds
        model = self.model
        x, residual = model.embed(input_ids, (flat, rows[:, :width])), None
        for i, layer in enumerate(model.layers[:num_layers]):
            x, residual = layer(positions, x, residual)  # the stream is x + residual
            if i < self.deepstack:
                x = x.index_add(0, flat, rows[:, width * (i + 1):width * (i + 2)])
        return model.norm(x, residual)[0]


_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL-30B-A3B and -235B-A22B: Qwen3-VL with Qwen3-MoE's decoder. Their checkpoints keep each layer's
    experts as two stacked tensors (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), as the released files
    store them ([experts, hidden, 2 · inner] and [experts, inner, hidden]) or as transformers 5 saves them (each
    expert's matrix as a linear layer's, [2 · inner, hidden] and [hidden, inner]; a square one is read so); each is
    split into the experts' own gate, up and down matrices."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], quantization: str | None = None) -> None:
        super().load_weights(self._split_experts(weights), quantization)

    def _split_experts(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        hidden = self.cfg.hidden_size
        for name, tensor in weights:
            match = _FUSED_EXPERTS.search(name)
            if match is None:
                yield name, tensor
                continue
            stem = name[:match.start()] + ".mlp.experts"
            for expert, matrix in enumerate(tensor):
                if match.group(1) == "gate_up_proj":
                    released = matrix.shape[0] == hidden != matrix.shape[1]
                    yield from _gate_up(matrix.T if released else matrix, f"{stem}.{expert}.gate_proj.weight",
                                        f"{stem}.{expert}.up_proj.weight")
                else:
                    released = matrix.shape[1] == hidden != matrix.shape[0]
                    yield f"{stem}.{expert}.down_proj.weight", matrix.T if released else matrix
