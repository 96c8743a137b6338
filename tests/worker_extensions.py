"""A worker extension for the collective_rpc tests (``worker_extension_cls="worker_extensions:WeightTools"``), and a
function they send to the workers; both importable by every rank (the tests folder is on their path)."""

from __future__ import annotations

import time

import torch


class WeightTools:
    """Methods every worker gains: what an RL trainer's weight sync asks of each rank."""

    def weight_shape(self, name: str) -> tuple[int, ...]:
        return tuple(dict(self.runner.model.named_parameters())[name].shape)

    def scale_weight(self, name: str, factor: float) -> float:
        """Scale one weight in place (this rank's shard); returns the shard's new sum of squares."""
        weight = dict(self.runner.model.named_parameters())[name]
        with torch.no_grad():
            weight.mul_(factor)
        return float(weight.float().pow(2).sum())

    def fail(self) -> None:
        raise RuntimeError(f"rank {self.parallel.tp_rank} refuses")


class Clashing:
    def execute_model(self, sched: object) -> None:  # would replace the worker's own
        raise AssertionError("never called")


def ranks(worker, offset: int = 0) -> tuple[int, int, int]:
    """A function sent by value: the worker's place (tensor-parallel rank and size) plus ``offset``."""
    return worker.parallel.tp_rank + offset, worker.parallel.tp_size, worker.parallel.pp_rank


def fail_on(worker, rank: int) -> int:
    """Raises on tensor-parallel rank ``rank`` only; the others answer their rank."""
    if worker.parallel.tp_rank == rank:
        raise ValueError(f"rank {rank} was told to fail")
    return worker.parallel.tp_rank


def slow_on(worker, rank: int, seconds: float) -> int:
    """A slow rank: rank ``rank`` takes ``seconds`` before it answers its rank."""
    if worker.parallel.tp_rank == rank:
        time.sleep(seconds)
    return worker.parallel.tp_rank
