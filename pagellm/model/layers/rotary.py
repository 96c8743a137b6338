"""Rotary position embeddings (the "rotate half" layout of Hugging Face checkpoints), with the default,
``linear``, Llama-3, LongRoPE (Phi-3 128k, Phi-3.5) and YaRN (Qwen2.5 and Qwen3's long contexts, OLMo 3) frequency
scalings. cos/sin are computed once for every
position in float32, exactly as transformers computes them, and looked up by each token's position.

LongRoPE has two sets of per-frequency factors: transformers takes the long ones for a forward pass whose
sequence is longer than the original context, the short ones otherwise. pagellm picks one set per engine, as
llama.cpp does: the long factors when ``max_model_len`` exceeds the original context (``use_long_factors``), so
every cached key of every request shares one rotary embedding (prefix caching stays sound). It equals
transformers for every sequence when ``max_model_len`` is at most the original context, and for prompts longer
than it otherwise. A partial rotary embedding (Phi-4-mini's ``partial_rotary_factor``) rotates the first
``rotary_dim`` dimensions of each head, its frequencies spread over those, and passes the rest through, as
transformers' Phi-3 does. bfloat16 q/k take one fused native pass (``pagellm/ops/fused.py``); ``forward_torch`` is
the plain-PyTorch twin (and the path for every other dtype)."""

from __future__ import annotations

import math

import torch
from torch import nn

from pagellm.model.arch import LONGROPE, rope_kind
from pagellm.ops.fused import rotary


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    wavelengths = base ** exponents
    inv_freq = 1.0 / wavelengths
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    if kind in LONGROPE:
        factors = scaling["long_factor" if scaling.get("use_long_factors") else "short_factor"]  # type: ignore
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * wavelengths)
    if kind == "yarn":
        return _yarn_inv_freq(wavelengths, head_dim, base, scaling)  # type: ignore[arg-type]
    raise ValueError(f"rope scaling {kind!r} is not supported; supported: default, linear, llama3, longrope, yarn")


def _yarn_inv_freq(wavelengths: torch.Tensor, dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN: each frequency interpolated (divided by ``factor``) or kept, by how many turns it makes over the original
    context: kept above ``beta_fast`` turns, interpolated below ``beta_slow``, blended linearly between (the bounds
    rounded outwards unless ``truncate`` is false), as transformers computes it."""
    factor, original = float(scaling["factor"]), int(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(turns: float) -> float:  # the dimension whose frequency makes `turns` turns over the original context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where the frequency is kept (extrapolated), 0 where it is interpolated
    return (1.0 / (factor * wavelengths)) * (1 - keep) + (1.0 / wavelengths) * keep


def rope_attention_factor(scaling: dict | None, max_positions: int) -> float:
    """The scale of cos/sin: LongRoPE's ``attention_factor`` (by default sqrt(1 + ln(s) / ln(original)), s the
    context's extension over the original), YaRN's (by default its mscale, 0.1 ln(factor) + 1, or DeepSeek's ratio of
    two: ``mscale`` over ``mscale_all_dim``), 1.0 for the other scalings."""
    if rope_kind(scaling) == "yarn":
        assert scaling is not None
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor = float(scaling["factor"])
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        return _yarn_mscale(factor)
    if rope_kind(scaling) not in LONGROPE:
        return 1.0
    assert scaling is not None
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def use_long_factors(scaling: dict | None, max_model_len: int) -> dict | None:
    """``scaling`` with LongRoPE's set of factors chosen for an engine of ``max_model_len`` (see the module
    docstring); other scalings as they are."""
    if rope_kind(scaling) not in LONGROPE:
        return scaling
    assert scaling is not None
    return {**scaling, "use_long_factors": max_model_len > int(scaling["original_max_position_embeddings"])}


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, interpolate smoothly in between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None,
                 dtype: torch.dtype, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim  # cos and sin are this wide
        inv_freq = rope_inv_freq(self.rotary_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        factor = rope_attention_factor(scaling, max_positions)
        if factor != 1.0:  # as transformers scales them (in float32, before the cast)
            cos, sin = cos * factor, sin * factor
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]; positions: [T]."""
        fused = rotary(positions, q, k, self.cos, self.sin)
        return fused if fused is not None else self.forward_torch(positions, q, k)

    def forward_torch(self, positions: torch.Tensor, q: torch.Tensor,
                      k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if self.rotary_dim < self.head_dim:  # rotate the first rotary_dim, pass the rest through
            rot = self.rotary_dim
            return tuple(torch.cat([x[..., :rot] * cos + rotate_half(x[..., :rot]) * sin, x[..., rot:]], dim=-1)
                         for x in (q, k))  # type: ignore[return-value]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal rotary embedding (M-RoPE): each token has three positions (temporal, height, width: an
    image token's place in its image's grid, offset past the text before it), and each of the ``sections`` (their sum
    half the head) of a head's frequencies turns by one of them, as transformers' ``Qwen2VLRotaryEmbedding``
    recomposes them. [3, T] positions take the per-token tables; [T] positions (a step of text alone, whose three
    positions agree) the plain embedding, fused kernel and all. ``interleaved`` (Qwen3-VL's): the sections'
    frequencies alternate (t, h, w, t, h, w, ..., then t alone past the shorter sections), as Qwen3-VL recomposes
    them; else each section's frequencies are consecutive."""

    def __init__(self, head_dim: int, max_positions: int, base: float, sections: tuple[int, ...],
                 dtype: torch.dtype, interleaved: bool = False) -> None:
        super().__init__(head_dim, max_positions, base, None, dtype)
        if len(sections) != 3 or sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section {list(sections)} must be three counts adding up to half the head "
                             f"({head_dim // 2})")
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
        if interleaved:
            axis = torch.zeros(head_dim // 2, dtype=torch.int64)
            for dim in (1, 2):
                axis[dim:3 * sections[dim]:3] = dim
        self.register_buffer("axis", torch.cat([axis, axis]), persistent=False)  # [head_dim]: each column's position

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        cos, sin = self.tables(positions)
        fused = rotary(torch.arange(len(cos)), q, k, cos, sin)
        if fused is not None:
            return fused
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, head_dim] cos and sin of [3, T] positions: each column from its section's position's row."""
        index = self.axis.expand(1, positions.shape[1], -1)
        return tuple(table[positions].gather(0, index)[0] for table in (self.cos, self.sin))  # type: ignore
