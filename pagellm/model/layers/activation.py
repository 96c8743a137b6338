"""SwiGLU's gating, ``silu(gate) * up`` over the fused gate/up projection ``[gate | up]`` (and Gemma's GeGLU, and
gpt-oss's clamped SwiGLU).

bfloat16 rows take one fused native pass (``pagellm/ops/fused.py``); ``forward_torch`` is the plain-PyTorch twin
(and the path for every other dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.ops.fused import clamped_swiglu, gelu_tanh_and_mul, silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        fused = silu_and_mul(gate_up)
        return fused if fused is not None else self.forward_torch(gate_up)

    @staticmethod
    def forward_torch(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """GeGLU, Gemma's gating: ``gelu(gate) * up`` (``approximate``: "tanh" for ``gelu_pytorch_tanh``, "none" for
    the exact ``gelu``); the tanh form's bfloat16 rows in one native pass (the one the native decoder stack makes),
    ``forward_torch`` its plain-PyTorch twin (and the path of the exact form and every other dtype)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        fused = gelu_tanh_and_mul(gate_up) if self.approximate == "tanh" else None
        return fused if fused is not None else self.forward_torch(gate_up)

    def forward_torch(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


class ClampedSwiGLU(nn.Module):
    """gpt-oss's experts' gating over ``[gate | up]``: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``
    with ``g = min(gate, limit)``: bfloat16 rows in one native pass (rounded where transformers' bfloat16 ops round),
    ``forward_torch`` its plain-PyTorch twin, in the order transformers computes it (and every other dtype's path)."""

    def __init__(self, limit: float, alpha: float) -> None:
        super().__init__()
        self.limit, self.alpha = limit, alpha

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        fused = clamped_swiglu(gate_up, self.limit, self.alpha)
        return fused if fused is not None else self.forward_torch(gate_up)

    def forward_torch(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
