"""All-reduce and all-gather between the tensor-parallel ranks of one machine through shared memory: the CPU fast
path of ``ParallelState``'s collectives (gloo over loopback TCP is its twin and oracle, and takes what does not fit).

Contract:
- ``ShmComm.create(rank, size, group)`` is called by every rank of a group after ``torch.distributed`` is
  initialised: the group's rank 0 creates the segment and shares its name over the group; each rank owns ``SLOT_BYTES`` in each of two slots.
- ``all_reduce(t)`` (in place) and ``all_gather_last_dim(t)`` each: copy this rank's tensor into its part of the
  current slot, publish a sequence number, wait until every rank has published it, then read every part (a sum in
  float32 in rank order, rounded once to the tensor's dtype; or the parts side by side). Calls alternate between the
  two slots, so a rank writes a slot only after every rank has finished reading it (they all passed the barrier of
  the call in between). Tensors larger than a part return ``None``: the caller uses gloo.
- Waiting spins on the other ranks' sequence numbers, yielding the CPU between reads (the ranks are busy computing
  the same step, so the waits are short). Every few thousand reads it checks that the rank it waits for still lives
  (its process id, shared at ``create``): a rank killed mid-step makes the others raise ``RuntimeError`` naming it
  instead of spinning forever.
- ``close()`` detaches (rank 0 also unlinks).
"""

from __future__ import annotations

import os
from multiprocessing import shared_memory
from typing import Any, Optional

import numpy as np
import torch

SLOT_BYTES = 16 << 20  # per rank and slot: a prefill chunk of 2048 tokens x 2048 float32 fits
_FLAGS_BYTES = 4096
_LIVENESS_SPINS = 4096  # reads of a peer's flag between checks that its process lives (a few ms)


class ShmComm:
    def __init__(self, rank: int, size: int, shm: shared_memory.SharedMemory, owner: bool,
                 pids: list[int]) -> None:
        self.rank, self.size, self.shm, self.owner, self.pids = rank, size, shm, owner, pids
        self.flags = np.ndarray((size,), dtype=np.int64, buffer=shm.buf[:size * 8])
        self.data = torch.frombuffer(shm.buf[_FLAGS_BYTES:], dtype=torch.uint8)
        self.seq = 0

    @classmethod
    def create(cls, rank: int, size: int, group: Any = None) -> ShmComm:
        """``rank`` of ``size`` in ``group`` (a ``torch.distributed`` group; None: every rank)."""
        import torch.distributed as dist

        segment = shared_memory.SharedMemory(create=True, size=_FLAGS_BYTES + 2 * size * SLOT_BYTES) \
            if rank == 0 else None
        name = [segment.name if segment is not None else None]
        dist.broadcast_object_list(name, group=group, group_src=0)
        if segment is None:
            segment = shared_memory.SharedMemory(name=name[0])
        else:
            np.ndarray((size,), dtype=np.int64, buffer=segment.buf[:size * 8])[:] = 0
        pids: list[int] = [0] * size
        dist.all_gather_object(pids, os.getpid(), group=group)  # also the barrier: every rank attached, the flags zeroed
        return cls(rank, size, segment, rank == 0, pids)

    def _part(self, slot: int, rank: int, nbytes: int) -> torch.Tensor:
        start = (slot * self.size + rank) * SLOT_BYTES
        return self.data[start:start + nbytes]

    def _exchange(self, tensor: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Every rank's copy of ``tensor``'s shape and dtype (views into shared memory), or None when too large."""
        flat = tensor.contiguous().view(-1)
        nbytes = flat.numel() * flat.element_size()
        if nbytes > SLOT_BYTES:
            return None
        self.seq += 1
        slot = self.seq % 2
        self._part(slot, self.rank, nbytes).copy_(flat.view(torch.uint8))
        self.flags[self.rank] = self.seq  # published after the data (x86 keeps stores in order)
        for other in range(self.size):
            spins = 0
            while self.flags[other] < self.seq:
                os.sched_yield()
                spins += 1
                if spins % _LIVENESS_SPINS == 0:
                    self._check_alive(other)
        return [self._part(slot, r, nbytes).view(tensor.dtype).view(tensor.shape) for r in range(self.size)]

    def _check_alive(self, rank: int) -> None:
        try:
            with open(f"/proc/{self.pids[rank]}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except FileNotFoundError:
            state = b"X"
        if state in (b"Z", b"X"):  # a zombie is dead too (its parent has not reaped it yet)
            raise RuntimeError(f"tensor-parallel rank {rank} (pid {self.pids[rank]}) is gone; its collective cannot "
                               "complete")

    def all_reduce(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        parts = self._exchange(tensor)
        if parts is None:
            return None
        total = parts[0].float() if tensor.dtype != torch.float32 else parts[0].clone()
        for part in parts[1:]:
            total += part
        tensor.copy_(total)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        parts = self._exchange(tensor)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        del self.flags, self.data
        try:
            self.shm.close()
        except BufferError:  # a tensor still views the mapping: it goes with the process
            pass
        if self.owner:
            self.shm.unlink()
