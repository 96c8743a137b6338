"""The executor interface: how the engine core reaches its workers: ``uniproc`` (one worker in the core's process),
``multiproc`` (tensor-parallel ranks in worker processes, fed through a shared-memory ring) or ``ray`` (ranks in Ray
actors on a cluster's nodes); ``make_executor`` picks by the world size (tensor- times
pipeline-parallel size) and ``distributed_executor_backend``."""

from __future__ import annotations

from typing import Any, Protocol

from pagellm.config import EngineConfig
from pagellm.sched.output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.runtime import RuntimeInfo


class Executor(Protocol):
    runtime: RuntimeInfo

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def set_idle(self, idle: bool) -> None:
        """Whether the engine core is idle: the workers' idle-time work (populating the KV cache) runs only then."""

    def update_weights(self, model: str | None) -> None:
        """Every worker serves ``model``'s weights from now on (``Worker.update_weights``; checked on rank 0 first)."""

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        """``method`` (a worker method's name, or a function of the worker) on every rank; their results in rank
        order (``Worker.rpc``)."""

    def set_asleep(self, asleep: bool, level: int = 1) -> None:
        """Sleep mode on every worker: asleep, their KV caches' memory goes back to the OS, at ``level`` 2 their
        weights too; awake, dropped weights load again (``Worker.set_asleep``)."""

    def start_profile(self) -> bool:
        """Start every worker's torch profiler session (metrics/profiler.py); False when one records already."""

    def stop_profile(self) -> list[str]:
        """Stop the sessions; the trace and summary files they wrote (none when nothing was recording)."""

    def shutdown(self) -> None: ...


def make_executor(config: EngineConfig) -> Executor:
    if config.parallel_config.distributed_executor_backend == "ray":
        from pagellm.executor.ray import RayExecutor

        return RayExecutor(config)
    if config.parallel_config.world_size > 1:
        from pagellm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from pagellm.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
