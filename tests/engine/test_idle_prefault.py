"""The engine core populates its KV cache while idle (worker/kv_prefault.py): the loop tells the workers when it
has waited a while for inputs with nothing to run, and a core left idle gets every block populated, then serves as
before."""

from __future__ import annotations

import queue
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pagellm.engine import core_proc
from pagellm.engine.core import EngineCore
from pagellm.engine.wire import AddRequests, EngineCoreOutputs
from tests.engine.test_core_proc import SMALL_KV, TIMEOUT_S, config, request


class _Stop(Exception):
    pass


class _RecordingCore:
    """What the loop asks of a core, in order; a request arrives when it goes idle; its second step ends the loop."""

    scheduler = SimpleNamespace(make_stats=None, kv=None)  # read by the loop's utility table only
    reset_prefix_cache = start_profile = stop_profile = sleep = wake_up = is_sleeping = update_weights = None
    collective_rpc_pickled = pause = resume = None
    paused = False

    def __init__(self, inputs: queue.Queue[Any]) -> None:
        self.inputs = inputs
        self.log: list[str] = []
        self.unfinished = 0

    def has_unfinished_requests(self) -> bool:
        return self.unfinished > 0

    def set_idle(self, idle: bool) -> None:
        self.log.append("idle" if idle else "busy")
        if idle:
            self.inputs.put(AddRequests([request("b", [1, 2])]))

    def add_request(self, req: Any) -> None:
        self.log.append(f"add {req.request_id}")
        self.unfinished += 1

    def step(self) -> tuple[Any, Any]:
        self.log.append("step")
        if self.log.count("step") == 2:
            raise _Stop
        return None, None


def _run_loop(queued: list[Any]) -> list[str]:
    inputs: queue.Queue[Any] = queue.Queue()
    for message in queued:
        inputs.put(message)
    core = _RecordingCore(inputs)
    with pytest.raises(_Stop):
        core_proc.EngineCoreLoop(core, inputs, lambda out: None, idle_grace_s=0.01).run()  # type: ignore[arg-type]
    return core.log


def test_the_loop_is_idle_only_after_a_grace_with_nothing_to_run() -> None:
    # Work within the grace: never idle. None within it: idle until an input comes, busy before the step.
    assert _run_loop([AddRequests([request("a", [1, 2])])]) == ["add a", "step", "step"]
    assert _run_loop([]) == ["idle", "add b", "busy", "step", "step"]


def test_an_idle_core_populates_its_cache_then_serves(tiny_llama: Path) -> None:
    core = EngineCore(config(tiny_llama))
    prefaulter = core.executor.worker.prefaulter
    try:
        assert prefaulter is not None and prefaulter.populated_blocks == 0 and prefaulter.num_blocks == 256
        core.set_idle(True)
        assert prefaulter.wait(TIMEOUT_S) and prefaulter.populated_blocks == 256
        core.set_idle(False)
        emitted: list[EngineCoreOutputs] = []
        inputs: queue.Queue[Any] = queue.Queue()
        inputs.put(AddRequests([request("a", [1, 2, 3], max_tokens=3)]))
        loop = core_proc.EngineCoreLoop(core, inputs, emitted.append)
        loop.apply_inputs(block=True)
        while core.has_unfinished_requests():
            step, _ = core.step()
            emitted.append(EngineCoreOutputs(step))
        assert sum(len(out.step.new_token_ids) for out in emitted) == 3
        assert core.scheduler.kv.num_free_blocks == 256  # every block back
    finally:
        core.shutdown()


def test_the_prefault_can_be_turned_off(tiny_llama: Path) -> None:
    from pagellm.config import EngineConfig

    core = EngineCore(EngineConfig.from_kwargs(model=str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
                                               kv_cache_prefault=False))
    assert core.executor.worker.prefaulter is None
    core.set_idle(True)  # nothing to do, nothing fails
    core.shutdown()
