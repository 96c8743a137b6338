"""SwiGLU's gating, ``silu(gate) * up`` over the fused gate/up projection ``[gate | up]``.

bfloat16 rows take one fused native pass (``pagellm/ops/fused.py``); ``forward_torch`` is the plain-PyTorch twin
(and the path for every other dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.ops.fused import silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        fused = silu_and_mul(gate_up)
        return fused if fused is not None else self.forward_torch(gate_up)

    @staticmethod
    def forward_torch(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
