"""Parallel state, passed explicitly to the layers that shard (never a global).

Tensor parallelism (``tp_size``): every layer's heads, MLP width and vocabulary split over the ranks, which meet in
all-reduces and all-gathers. With ``tp_size == 1`` every collective is the identity, so a single-process engine pays
nothing for it. With more ranks the collectives go through ``comm`` (``shm_comm.ShmComm``: shared memory, the ranks
of one machine) when it is set and the tensor fits, else through ``torch.distributed`` (gloo on CPU), which is also
the fast path's oracle.

Pipeline parallelism (``pp_size``): the decoder layers split into consecutive stages, one per rank
(``layer_range``); a stage receives the previous stage's hidden states and residual, runs its layers and sends them
on (``recv_prev`` / ``send_next``), and the last stage's final hidden states reach every stage
(``broadcast_from_last``), so each samples alike, as tensor-parallel ranks do. Both combine: a stage's ranks split
its layers and meet in their own group (``tp_group``); rank ``tp_rank`` of a stage sends to rank ``tp_rank`` of the
next. A rank's global number is ``pp_rank * tp_size + tp_rank``.
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
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = field(default=None, compare=False, repr=False)  # this stage's ranks (None: every rank)
    # A mixture of experts' experts dealt out whole over the tensor-parallel ranks (``expert_range``), instead of
    # each split like a dense MLP.
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside [0, {self.tp_size})")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} is outside [0, {self.pp_size})")

    def expert_range(self, num_experts: int) -> range:
        """The experts this rank holds: all of them, or with ``expert_parallel`` its run of consecutive experts
        (the first ``num_experts mod tp_size`` ranks take one more)."""
        if not self.expert_parallel or self.tp_size == 1:
            return range(num_experts)
        share, extra = divmod(num_experts, self.tp_size)
        start = self.tp_rank * share + min(self.tp_rank, extra)
        return range(start, start + share + (self.tp_rank < extra))

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
        torch.distributed.all_reduce(tensor, group=self.tp_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return tensor
        if self.comm is not None and (gathered := self.comm.all_gather_last_dim(tensor)) is not None:
            return gathered
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    # pipeline stages

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> range:
        """This stage's decoder layers: consecutive, the first ``num_layers % pp_size`` stages one more."""
        if num_layers < self.pp_size:
            raise ValueError(f"the model's {num_layers} decoder layers cannot fill pipeline_parallel_size "
                             f"({self.pp_size}) stages; use at most {num_layers}")
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (self.pp_rank < extra))

    def _global(self, pp_rank: int) -> int:
        return pp_rank * self.tp_size + self.tp_rank

    def send_next(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        torch.distributed.send(torch.stack((x, residual)), self._global(self.pp_rank + 1))

    def recv_prev(self, shape: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.empty((2, *shape), dtype=dtype)
        torch.distributed.recv(both, self._global(self.pp_rank - 1))
        return both[0], both[1]

    def broadcast_from_last(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's first rank's ``hidden`` on every rank of every stage."""
        torch.distributed.broadcast(hidden, (self.pp_size - 1) * self.tp_size)
        return hidden


SINGLE = ParallelState()
