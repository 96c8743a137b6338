"""Killing the engine core process: ``/health`` turns 503, every request fails fast with a 5xx (no hang), and the
server exits non-zero; a stop signal that reaches the core too is a clean exit."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest
from server_utils import ServerProcess, wait_until

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def doomed_server(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    return start_server(tiny_llama, "--served-model-name", "tiny")


def _engine_core_pid(server: ServerProcess) -> int:
    """The child running the engine core (not multiprocessing's resource tracker)."""
    for pid in server.child_pids():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"resource_tracker" not in cmdline:
            return pid
    raise AssertionError(f"no engine core child among {server.child_pids()}")


def test_killed_core_gives_503_fast(doomed_server: ServerProcess) -> None:
    base = doomed_server.base_url
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 480, "n": 8, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{base}/v1/chat/completions", json=body) as in_flight:
            lines = in_flight.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(_engine_core_pid(doomed_server), signal.SIGKILL)
            started = time.monotonic()
            events = [line for line in lines if line.startswith("data: ")]
            assert time.monotonic() - started < 10
        errors = [json.loads(e[6:])["error"] for e in events if e.startswith('data: {"error"')]
        assert errors and errors[0]["code"] == "engine_dead" and events[-1] == "data: [DONE]"
        wait_until(lambda: http.get(f"{base}/health").status_code == 503, 10, "/health to report 503")
        started = time.monotonic()
        response = http.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4})
        assert response.status_code == 503 and time.monotonic() - started < 5
        assert response.json()["error"]["code"] == "engine_dead"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3)
    # Then it stops, so a supervisor restarts it: non-zero exit, one ERROR line naming the cause.
    wait_until(lambda: doomed_server.proc.poll() is not None, 30, "the server to exit")
    assert doomed_server.proc.returncode == 1
    assert "ERROR pagellm.server.launch: the engine core died (the engine core process died (exit code -9))" \
        in doomed_server.log()


def test_stop_signal_to_server_and_core_is_clean(start_server: Callable[..., ServerProcess],
                                                   tiny_llama: Path) -> None:
    """SIGTERM to the whole process group (both processes at once) is a shutdown, not an engine crash."""
    server = start_server(tiny_llama, "--served-model-name", "tiny")
    core = _engine_core_pid(server)
    os.kill(core, signal.SIGTERM)
    os.kill(server.proc.pid, signal.SIGTERM)
    wait_until(lambda: server.proc.poll() is not None, 30, "the server to exit")
    assert server.proc.returncode == 0
    assert "ERROR" not in server.log()
