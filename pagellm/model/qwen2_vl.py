"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``): a vision
transformer over each image at its own resolution, a patch merger, Qwen2's decoder with M-RoPE positions.

Contract: the model is the decoder (``LlamaForCausalLM`` with Qwen2's layers and ``layers/rotary.MRotaryEmbedding``)
with ``vision``, computed as transformers' ``get_image_features`` computes it: an image's patches (``pixel_values``
[patches, 3 · 2 · 14 · 14], the processor's, in 2 x 2 merge blocks; ``image_grid_thw`` [images, 3] each image's
grid) through the patch embedding (a convolution whose kernel is its stride: one matrix product), every block (a
2-D rotary embedding of each patch's row and column on q and k, attention over its image, an MLP) and the merger
(each block of 2 x 2 patches normed and projected to one row: one image token). Qwen2-VL's blocks have LayerNorms
and a fc1/fc2 MLP; Qwen2.5-VL's RMSNorms and a gated MLP, and attend within windows of ``window_size`` pixels
except in ``fullatt_block_indexes`` (its patches reordered window by window for the blocks and back after the
merger). ``image_rows(inputs, skip, last)`` gives the rows of images ``skip`` to ``last``.

``mrope_positions(prompt_ids, inputs)`` gives a prompt's three positions a token (transformers' ``get_rope_index``
for images): text counts on from the previous token's; an image's tokens sit at the next position plus their
(0, row, column) in its merged grid, and the text after it starts past its longer side; a token after the prompt
at its index plus the prompt's delta (its last position + 1 - its length). Checkpoints name the tower ``visual.``
(the released ones, and transformers 5's saves) or ``model.visual.``, the decoder ``model.`` or
``model.language_model.``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.runs import Runs, kernel_pays
from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model.arch import ArchConfig
from pagellm.model.hf_config import with_defaults
from pagellm.model.layers.linear import ReplicatedLinear
from pagellm.model.layers.norm import RMSNorm
from pagellm.model.layers.rotary import rotate_half
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.vit import act, activation

if TYPE_CHECKING:
    from pagellm.multimodal import MultiModalInputs


class _RMSNorm(RMSNorm):
    """Qwen2.5-VL's tower norm: the decoder's RMSNorm (its fused pass in bfloat16), without a residual."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0]


def _norm(width: int, qwen25: bool, dtype: torch.dtype) -> nn.Module:
    return _RMSNorm(width, 1e-6, dtype) if qwen25 else nn.LayerNorm(width, eps=1e-6, dtype=dtype)


class VisionAttention(nn.Module):
    def __init__(self, width: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = ReplicatedLinear(width, 3 * width, dtype, bias=True)
        self.proj = ReplicatedLinear(width, width, dtype, bias=True)

    def forward(self, x: torch.Tensor, runs: Runs, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``runs``: the runs of patches that attend to one another (made once for all the tower's blocks)."""
        q, k, v = self.qkv(x).view(len(x), 3, self.heads, -1).unbind(1)
        q, k = (((t.float() * cos) + rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))  # in float32
        return self.proj(runs.attend(q.contiguous(), k.contiguous(), v.contiguous()))


class VisionBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any], qwen25: bool, dtype: torch.dtype) -> None:
        super().__init__()
        width = int(cfg["hidden_size" if qwen25 else "embed_dim"])
        self.norm1, self.norm2 = _norm(width, qwen25, dtype), _norm(width, qwen25, dtype)
        self.attn = VisionAttention(width, int(cfg["num_heads"]), dtype)
        self.mlp = nn.Module()
        self.gated = qwen25
        if qwen25:  # SwiGLU (its activation the config's), biased
            inner = int(cfg["intermediate_size"])
            for name, shape in (("gate_proj", (width, inner)), ("up_proj", (width, inner)),
                                ("down_proj", (inner, width))):
                setattr(self.mlp, name, ReplicatedLinear(*shape, dtype, bias=True))
            if cfg.get("hidden_act", "silu") != "silu":
                raise ValueError(f"Qwen2.5-VL's tower activation {cfg['hidden_act']!r} is not supported: silu")
        else:
            inner = int(width * float(cfg["mlp_ratio"]))
            self.mlp.fc1 = ReplicatedLinear(width, inner, dtype, bias=True)
            self.mlp.fc2 = ReplicatedLinear(inner, width, dtype, bias=True)
            self.kind = activation(cfg.get("hidden_act", "quick_gelu"))

    def forward(self, x: torch.Tensor, runs: Runs, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), runs, cos, sin)
        h, mlp = self.norm2(x), self.mlp
        if self.gated:
            return x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        return x + mlp.fc2(act(mlp.fc1(h), self.kind))


class Merger(nn.Module):
    """Each 2 x 2 block of patches (consecutive rows, as the processor orders them) normed, then one row."""

    def __init__(self, width: int, out: int, merge: int, qwen25: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.ln_q = _norm(width, qwen25, dtype)
        self.inner = width * merge * merge
        self.mlp = nn.ModuleDict({"0": ReplicatedLinear(self.inner, self.inner, dtype, bias=True),
                                  "2": ReplicatedLinear(self.inner, out, dtype, bias=True)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp["2"](F.gelu(self.mlp["0"](self.ln_q(x).view(-1, self.inner))))


class RunsOnKernel(nn.Module):
    """A tower whose attention runs through ``attention/runs.Runs``: the C++ kernel where the runner points it
    there (``native_attention``) and the kernel pays for its heads."""

    native_attention = False
    head_size = 0

    def runs(self, bounds: np.ndarray, dtype: torch.dtype) -> Runs:
        return Runs(bounds, self.native_attention and kernel_pays(dtype, self.head_size))


class VisionTower(RunsOnKernel):
    """The patch embedding, the blocks and the merger (see the module doc)."""

    def __init__(self, vision: dict[str, Any], qwen25: bool, dtype: torch.dtype) -> None:
        super().__init__()
        kind = "qwen2_5_vl_vision" if qwen25 else "qwen2_vl_vision"  # (the released configs name none)
        cfg = self.config = with_defaults({"model_type": kind, **(vision.get("vision_config") or {})})
        width = int(cfg["hidden_size" if qwen25 else "embed_dim"])
        self.qwen25, self.merge = qwen25, int(cfg["spatial_merge_size"])
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(int(cfg.get("in_channels", 3)), width, bias=False, dtype=dtype,
                                          kernel_size=(int(cfg["temporal_patch_size"]), *[int(cfg["patch_size"])] * 2))
        self.blocks = nn.ModuleList(VisionBlock(cfg, qwen25, dtype) for _ in range(int(cfg["depth"])))
        self.merger = Merger(width, int(cfg["out_hidden_size" if qwen25 else "hidden_size"]), self.merge, qwen25,
                             dtype)
        self.inv_freq, self.head_size = vision_inv_freq(cfg, width), width // int(cfg["num_heads"])

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """[image tokens, text width] of ``pixels`` [patches, 3 · 2 · 14 · 14] and ``grids`` [images, 3]."""
        weight = self.patch_embed.proj.weight
        x = F.linear(pixels.to(weight.dtype), weight.flatten(1))
        cos, sin, whole = rotary_and_frames(grids, self.merge, self.inv_freq)
        order, windows = (None, whole) if not self.qwen25 else window_order(grids, self.merge, self.config)
        if order is not None:  # Qwen2.5-VL's windows: the patches window by window, merge blocks kept whole
            x, cos, sin = (t.view(len(order), -1, *t.shape[1:])[order].flatten(0, 1) for t in (x, cos, sin))
        full = set(self.config.get("fullatt_block_indexes", ())) if self.qwen25 else None
        whole_runs, window_runs = self.runs(whole, x.dtype), self.runs(windows, x.dtype)
        for i, block in enumerate(self.blocks):
            x = block(x, whole_runs if full is None or i in full else window_runs, cos, sin)
        rows = self.merger(x)
        return rows if order is None else rows[torch.argsort(order)]


def vision_inv_freq(cfg: dict[str, Any], width: int) -> torch.Tensor:
    """The 2-D rotary embedding's frequencies: a quarter head's (each of a patch's row and column turns half)."""
    half = width // int(cfg["num_heads"]) // 2
    base = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    return 1.0 / (base ** (torch.arange(0, half, 2, dtype=torch.float) / half))


def rotary_and_frames(grids: torch.Tensor, merge: int,
                      inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """A tower's 2-D rotary tables ([patches, 1, head] cos and sin, float32: each patch's row angles, then its
    column's, twice) and the cumulative patch counts of its frames (each frame's patches attend to one another)."""
    freqs = grid_positions(grids, merge)[..., None].float() * inv_freq  # [patches, 2, head / 4]
    angles = torch.cat([freqs.flatten(1)] * 2, -1)[:, None]
    frames = (grids[:, 1] * grids[:, 2]).repeat_interleave(grids[:, 0]).numpy()
    return angles.cos(), angles.sin(), np.concatenate([[0], np.cumsum(frames)])


def grid_positions(grids: torch.Tensor, merge: int) -> torch.Tensor:
    """[patches, 2] each patch's (row, column) in its image, the patches in the processor's order (merge blocks of
    ``merge`` x ``merge`` consecutive, frame after frame)."""
    out = []
    for t, h, w in grids.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        pair = torch.stack([axis.reshape(shape).transpose(1, 2).flatten() for axis in (rows, cols)], -1)
        out.append(pair.repeat(t, 1))
    return torch.cat(out)


def window_order(grids: torch.Tensor, merge: int, cfg: dict[str, Any]) -> tuple[torch.Tensor, np.ndarray]:
    """Qwen2.5-VL's windows: the merge blocks' order window by window (each frame's grid of merge blocks cut into
    windows of ``window_size`` pixels, row-major, the last ones short), and the windows' cumulative patch counts."""
    side = int(cfg["window_size"]) // merge // int(cfg["patch_size"])  # merge blocks along a window's side
    order, bounds, offset = [], [0], 0
    for t, h, w in grids.tolist():
        bh, bw = h // merge, w // merge
        index = torch.arange(t * bh * bw).reshape(t, bh, bw)
        pad_h, pad_w = -bh % side, -bw % side
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        tiles = padded.reshape(t, (bh + pad_h) // side, side, (bw + pad_w) // side, side).permute(0, 1, 3, 2, 4)
        tiles = tiles.reshape(-1, side * side)
        for tile in tiles:
            kept = tile[tile >= 0]
            if len(kept):
                order.append(kept + offset)
                bounds.append(bounds[-1] + len(kept) * merge * merge)
        offset += t * bh * bw
    return torch.cat(order), np.asarray(bounds, dtype=np.int64)


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    QWEN25 = False
    TOWER = re.compile(r"^(model\.)?visual\.")
    DECODER = re.compile(r"^model\.language_model\.")

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        super().__init__(cfg, dtype, parallel)
        self.vision = None if cfg.vision is None else self.tower(cfg.vision, dtype)

    def tower(self, vision: dict[str, Any], dtype: torch.dtype) -> nn.Module:
        return VisionTower(vision, self.QWEN25, dtype)

    @property
    def merge_size(self) -> int:
        """Patches merged along each side into one image token."""
        return int(((self.cfg.vision or {}).get("vision_config") or {}).get("spatial_merge_size", 2))

    def image_rows(self, images: MultiModalInputs, skip: int = 0, last: int | None = None) -> torch.Tensor:
        """The tower's rows of images ``skip`` to ``last`` (None: the last one), or precomputed embeddings' own."""
        grids, embeds = images.tensor("image_grid_thw"), images.tensor("image_embeds")
        assert grids is not None
        last = len(grids) if last is None else last
        if embeds is not None:  # one row an image token: each image's merged blocks
            ends = [0, *(grids.prod(-1) // self.merge_size ** 2).cumsum(0).tolist()]
            return embeds[ends[skip]:ends[last]].to(self.model.norm.weight.dtype)
        pixels = images.tensor("pixel_values")
        assert pixels is not None and self.vision is not None
        ends = [0, *grids.prod(-1).cumsum(0).tolist()]  # each image's first patch
        return self.vision(pixels[ends[skip]:ends[last]], grids[skip:last]).to(self.model.norm.weight.dtype)

    def mrope_positions(self, prompt_ids: list[int], images: MultiModalInputs) -> tuple[np.ndarray, int]:
        """The prompt's [3, length] positions and its delta (see the module doc)."""
        grids = images.tensor("image_grid_thw")
        assert grids is not None
        return mrope_positions(np.asarray(prompt_ids), self.cfg.image_token_id, grids.tolist(), self.merge_size)

    def _target(self, name: str) -> tuple[str | None, str | int | None]:
        if match := self.TOWER.match(name):
            return (f"vision.{name[match.end():]}" if self.vision is not None else None), None
        if match := self.DECODER.match(name):
            name = f"model.{name[match.end():]}"
        return super()._target(name)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    QWEN25 = True


def mrope_positions(ids: np.ndarray, image_token: int | None, grids: list[list[int]],
                    merge: int) -> tuple[np.ndarray, int]:
    """[3, len(ids)] positions of a prompt whose images (their ``grids``: t, h, w in patches) take runs of
    ``image_token``, one token a merge block, in order; and the prompt's delta."""
    table = np.empty((3, len(ids)), dtype=np.int64)
    at = np.flatnonzero(ids == image_token)
    done = tokens = current = 0  # prompt positions placed, image tokens passed, the next position
    for t, h, w in grids:
        bh, bw = h // merge, w // merge
        count = t * bh * bw
        if tokens + count > len(at) or at[tokens + count - 1] - at[tokens] != count - 1:
            raise ValueError(f"the prompt's image tokens do not make runs of {count} for its image of {h} x {w} "
                             "patches; send the processor's token ids")
        start = int(at[tokens])
        table[:, done:start] = current + np.arange(start - done)
        current += start - done
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(bh), np.arange(bw), indexing="ij")).reshape(3, -1)
        table[:, start:start + count] = current + grid
        current += max(bh, bw)
        done, tokens = start + count, tokens + count
    table[:, done:] = current + np.arange(len(ids) - done)
    return table, int(table.max()) + 1 - len(ids) if len(ids) else 0
