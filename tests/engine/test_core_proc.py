"""The engine core in its own process, driven through ``MPClient`` with raw ``EngineCoreRequest``s: it serves,
refuses one bad request without dying, answers utility calls, reports a crash, and never outlives its parent.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from pagellm import SamplingParams
from pagellm.config import EngineConfig
from pagellm.engine import core_proc
from pagellm.engine.client import MPClient
from pagellm.engine.exceptions import EngineDeadError
from pagellm.engine.wire import (AddRequests, EngineCoreHandshake, EngineCoreOutputs, EngineCoreRequest,
                                 UtilityCall)
from pagellm.metrics.stats import SchedulerStats
from tests.unit.test_native_build import running  # alive and not a zombie

SMALL_KV = 256 * 16 * 512  # 256 blocks of the tiny llama
TIMEOUT_S = 20.0


def config(model_dir: Path) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", kv_cache_memory=SMALL_KV)


def request(request_id: str, prompt: list[int], max_tokens: int = 4) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, prompt, params, [257], time.time())


def test_core_process_serves_refuses_and_answers(tiny_llama: Path) -> None:
    received: queue.Queue[EngineCoreOutputs] = queue.Queue()
    deaths: list[EngineDeadError] = []
    client = MPClient(config(tiny_llama), received.put, deaths.append)
    assert client.runtime.num_blocks == 256 and client.runtime.vocab_size == 320
    try:
        # The bad request is refused by the core itself (the frontend would have caught it); the good one runs.
        client.add_requests([request("bad", [1, 999]), request("ok", [1, 2, 3], max_tokens=5)])
        client.add_requests([request("ok", [4, 5])])  # a duplicate id of a live request
        errors, tokens, finish = {}, [], None
        while finish is None:
            out = received.get(timeout=TIMEOUT_S)
            errors.update({e.request_id: e for e in out.errors})
            assert set(out.step.req_ids) <= {"ok"}
            tokens += out.step.new_token_ids
            finish = out.step.finish_reasons.get("ok")
        assert errors["bad"].error_type == "ValueError" and "must be in [0, 320)" in errors["bad"].message
        assert len(tokens) == 5 and str(finish) == "length"
        if "ok" in errors:  # refused as a duplicate, unless it arrived after the first "ok" finished
            assert "already in use" in errors["ok"].message
        assert client.call_utility_sync("num_free_blocks", TIMEOUT_S) == 256
        stats = client.call_utility_sync("get_stats", TIMEOUT_S)
        assert isinstance(stats, SchedulerStats) and stats.num_running_reqs == 0
        assert client.call_utility_sync("reset_prefix_cache", TIMEOUT_S) is True
        assert client.is_healthy and not deaths
    finally:
        client.shutdown()
    assert not client.process.is_alive() and client.process.exitcode == 0
    assert not os.path.exists(client.ipc_dir)
    assert len(deaths) == 1 and "shut down" in str(deaths[0]) and not client.is_healthy
    with pytest.raises(EngineDeadError):
        client.add_requests([request("late", [1])])
    with pytest.raises(EngineDeadError):
        client.call_utility_sync("get_stats", TIMEOUT_S)


def test_a_crashing_loop_reports_its_error(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: ``_serve`` answers the handshake, then sends the loop's error before giving up."""
    def boom(self: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(core_proc.EngineCoreLoop, "run", boom)
    inputs: queue.Queue[Any] = queue.Queue()
    outputs: queue.Queue[Any] = queue.Queue()
    assert core_proc._serve(config(tiny_llama), inputs, outputs) == 1
    handshake, report = outputs.get_nowait(), outputs.get_nowait()
    assert isinstance(handshake, EngineCoreHandshake) and handshake.runtime is not None
    assert isinstance(report, EngineCoreOutputs) and report.engine_error == "RuntimeError: boom"


def test_loop_applies_inputs_in_order(tiny_llama: Path) -> None:
    """In process: an add then a utility call queued together; the utility sees the request queued."""
    emitted: list[EngineCoreOutputs] = []
    inputs: queue.Queue[Any] = queue.Queue()
    from pagellm.engine.core import EngineCore

    core = EngineCore(config(tiny_llama))
    loop = core_proc.EngineCoreLoop(core, inputs, emitted.append)
    inputs.put(AddRequests([request("a", [1, 2, 3])]))
    inputs.put(None)  # a signal wake-up: ignored
    inputs.put(UtilityCall(7, "get_stats"))
    loop.apply_inputs(block=True)
    assert core.has_unfinished_requests()
    (result,) = emitted[0].utility_results
    assert result.call_id == 7 and result.error is None and result.result


def test_core_exits_when_its_parent_dies(tiny_llama: Path) -> None:
    script = textwrap.dedent(f"""
        import signal
        from pagellm.config import EngineConfig
        from pagellm.engine.client import MPClient
        config = EngineConfig.from_kwargs(model={str(tiny_llama)!r}, dtype="float32", kv_cache_memory={SMALL_KV})
        client = MPClient(config, lambda outputs: None, lambda error: None)
        print(client.process.pid, client.ipc_dir, flush=True)
        signal.pause()
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        assert line, "the parent failed to start its engine core"
        pid_text, ipc_dir = line.split()
        core_pid = int(pid_text)
        assert running(core_pid) and os.path.isdir(ipc_dir)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + TIMEOUT_S
    while running(core_pid):
        assert time.monotonic() < deadline, "the engine core outlived its parent"
        time.sleep(0.05)
    assert not os.path.exists(ipc_dir)


def _exit_at_once() -> None:
    pass


def test_stopping_a_core_reaped_elsewhere_is_quiet(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # MPClient's output thread may reap the core (its join) just before shutdown looks: this thread's waitpid then
    # fails with ECHILD. Stopping it must neither wait out the SIGTERM timeout nor log that it ignored SIGTERM.
    import logging
    import multiprocessing
    import multiprocessing.connection
    import multiprocessing.popen_fork

    from pagellm.engine import client

    process = multiprocessing.get_context("spawn").Process(target=_exit_at_once)
    process.start()
    multiprocessing.connection.wait([process.sentinel], TIMEOUT_S)  # it has exited (not yet reaped)
    real_waitpid = os.waitpid

    def reaped_elsewhere(pid: int, options: int) -> tuple[int, int]:
        if pid == process.pid:
            raise ChildProcessError(10, "No child processes")
        return real_waitpid(pid, options)

    monkeypatch.setattr(multiprocessing.popen_fork.os, "waitpid", reaped_elsewhere)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pagellm.engine.client"):
        client._stop_process(process, str(tmp_path / "ipc"), timeout=5.0)
    took = time.monotonic() - start
    monkeypatch.undo()
    process.join()  # reap it for real, so no other test sees a child left behind
    assert took < 2.0 and "ignored SIGTERM" not in caplog.text
