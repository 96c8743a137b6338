"""Parallel state, passed explicitly to the layers that shard (never a global).

With ``tp_size == 1`` every collective is the identity, so a single-process engine pays nothing for it. With more
ranks the collectives go through ``comm`` (``shm_comm.ShmComm``: shared memory, the ranks of one machine) when it is
set and the tensor fits, else through ``torch.distributed`` (gloo on CPU), which is also the fast path's oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    comm: Any = field(default=None, compare=False, repr=False)  # a ShmComm, or None: gloo only

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside [0, {self.tp_size})")

    def shard(self, size: int, what: str) -> int:
        """This rank's share of a dimension that must split evenly."""
        if size % self.tp_size:
            raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({self.tp_size})")
        return size // self.tp_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return tensor
        if self.comm is not None and self.comm.all_reduce(tensor) is not None:
            return tensor
        torch.distributed.all_reduce(tensor)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return tensor
        if self.comm is not None and (gathered := self.comm.all_gather_last_dim(tensor)) is not None:
            return gathered
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = ParallelState()
