"""Clients of the engine core. ``InprocClient`` runs the core in the caller's process (used by ``LLM``); a
multiprocess client with the same methods talks to a core in its own process."""

from __future__ import annotations

from pagellm.config import EngineConfig
from pagellm.engine.core import EngineCore
from pagellm.engine.wire import EngineCoreOutputs, EngineCoreRequest
from pagellm.worker.worker import RuntimeInfo


class InprocClient:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)

    @property
    def runtime(self) -> RuntimeInfo:
        return self.core.runtime

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs, stats = self.core.step()
        return EngineCoreOutputs(outputs, stats)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()
