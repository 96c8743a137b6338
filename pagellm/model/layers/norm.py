"""RMSNorm, computed in float32 like Hugging Face's Llama (so float32 runs match it bit for bit), with the
residual add fused in: ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)``; and Cohere's
LayerNorm (its mean subtracted, a weight and no bias) with the same interface.

bfloat16 rows take one fused native pass (``pagellm/ops/fused.py``); ``forward_torch`` is the plain-PyTorch twin
(and the path for every other dtype)."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.ops.fused import add_layer_norm, add_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        fused = add_rms_norm(x, residual, self.weight, self.eps)
        return fused if fused is not None else self.forward_torch(x, residual)

    def forward_torch(self, x: torch.Tensor,
                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        return self._norm(x), x


class LayerNorm(RMSNorm):
    """Cohere's LayerNorm: (x - mean) / sqrt(var + eps) times the weight, in float32 as transformers computes it."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        fused = add_layer_norm(x, residual, self.weight, self.eps)
        return fused if fused is not None else self.forward_torch(x, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        centred = x32 - x32.mean(-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * normed).to(x.dtype)
