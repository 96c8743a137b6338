"""The executor interface: how the engine core reaches its workers (in-process today; multiprocess TP/PP and Ray
executors implement the same members)."""

from __future__ import annotations

from typing import Protocol

from pagellm.sched.output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.runtime import RuntimeInfo


class Executor(Protocol):
    runtime: RuntimeInfo

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def set_idle(self, idle: bool) -> None:
        """Whether the engine core is idle: the workers' idle-time work (populating the KV cache) runs only then."""

    def start_profile(self) -> bool:
        """Start every worker's torch profiler session (metrics/profiler.py); False when one records already."""

    def stop_profile(self) -> list[str]:
        """Stop the sessions; the trace and summary files they wrote (none when nothing was recording)."""

    def shutdown(self) -> None: ...
