"""The attention layer a model file sees: q/k/v in, attention output out.

Where the KV cache lives and how the step's tokens map to requests come from the forward context that the model
runner opens around each forward pass; the layer holds only its own cache tensor, bound by the runner.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.base import current_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # each token sees only the keys of its last this many positions
        self.softcap = softcap  # Gemma 2's: scores become softcap * tanh(score / softcap) (every backend caps)
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, kv_heads, head_dim]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] → [T, H * D]. ``sinks`` (gpt-oss's): [H] float32 logits, one per head, each
        joining its head's softmax denominator."""
        if self.kv_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the model runner binds it at start-up")
        ctx = current_forward_context()
        extra = {} if self.softcap is None else {"softcap": self.softcap}
        if sinks is not None:
            extra["sinks"] = sinks
        return ctx.backend.forward(q, k, v, self.kv_cache, ctx.metadata, self.scale, self.sliding_window, **extra)
