"""The vision transformer layers the vision-language models' encoders share (SigLIP's and CLIP's), in plain PyTorch.

Contract: ``EncoderLayer`` is one pre-LayerNorm encoder layer under transformers' names (``layer_norm1``,
``self_attn.{q,k,v,out}_proj`` with biases, ``layer_norm2``, ``mlp.fc1`` / ``mlp.fc2``): bidirectional attention over a
tile's patches (keys maskable; whole tiles through ``attention/runs.Runs``: the C++ kernel on the ``cpu_paged``
backend, SDPA its twin), then an MLP (its matrices, as the attention's, through the packed GEMM in bfloat16:
``ReplicatedLinear``) with the config's activation (``hidden_act``: GELU exact or tanh, or CLIP's
quick GELU). ``vision_config(cfg)`` is a vision config with transformers' defaults for what its ``config.json`` left
out (a released CLIP tower's says nothing of its activation or norm epsilon).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.runs import Runs, kernel_pays
from pagellm.model.layers.linear import ReplicatedLinear

_ACTIVATIONS = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh",
                "quick_gelu": "quick"}


def activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


def act(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` through an ``activation`` kind."""
    return x * torch.sigmoid(1.702 * x) if kind == "quick" else F.gelu(x, approximate=kind)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.native_attention = False  # whole tiles through the C++ kernel (``attention/runs.native_attention``)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (ReplicatedLinear(width, width, dtype, bias=True)
                                                                for _ in range(4))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """``key_mask`` [n, length]: the keys each query sees (None: all of them, the faster kernel)."""
        n, length, width = x.shape
        if key_mask is None:  # whole tiles: each one a run of tokens that see all of it
            q, k, v = (proj(x).view(n * length, self.heads, -1) for proj in (self.q_proj, self.k_proj, self.v_proj))
            native = self.native_attention and kernel_pays(q.dtype, q.shape[-1])
            out = Runs.equal(n, length, native).attend(q, k, v)
            return self.out_proj(out.view(n, length, width))
        q, k, v = (proj(x).view(n, length, self.heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        mask = key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, width))


class MLP(nn.Module):
    def __init__(self, width: int, inner: int, hidden_act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1, self.fc2 = ReplicatedLinear(width, inner, dtype, bias=True), ReplicatedLinear(inner, width, dtype,
                                                                                               bias=True)
        self.kind = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(act(self.fc1(x), self.kind))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        width, eps = int(cfg["hidden_size"]), float(cfg.get("layer_norm_eps", 1e-6))
        self.layer_norm1 = nn.LayerNorm(width, eps=eps, dtype=dtype)
        self.self_attn = Attention(width, int(cfg["num_attention_heads"]), dtype)
        self.layer_norm2 = nn.LayerNorm(width, eps=eps, dtype=dtype)
        self.mlp = MLP(width, int(cfg["intermediate_size"]), cfg.get("hidden_act", "gelu_pytorch_tanh"), dtype)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))
