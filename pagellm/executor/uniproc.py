"""One worker in the engine core's own process."""

from __future__ import annotations

from typing import Any

from pagellm.config import EngineConfig
from pagellm.sched.output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.runtime import RuntimeInfo
from pagellm.worker.worker import worker_class


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = worker_class(config.model_config.worker_extension_cls)(
            config.model_config, config.cache_config, config.speculative_config,
            profiler_config=config.profiler_config, kv_transfer=config.kv_transfer_config)
        self.runtime: RuntimeInfo = self.worker.runtime

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def set_idle(self, idle: bool) -> None:
        self.worker.set_idle(idle)

    def set_asleep(self, asleep: bool, level: int = 1) -> None:
        self.worker.set_asleep(asleep, level)

    def update_weights(self, model: str | None) -> None:
        self.worker.update_weights(model)

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        return [self.worker.rpc(method, args, kwargs)]

    def start_profile(self) -> bool:
        return self.worker.start_profile()

    def stop_profile(self) -> list[str]:
        return self.worker.stop_profile()

    def shutdown(self) -> None:
        self.worker.shutdown()
