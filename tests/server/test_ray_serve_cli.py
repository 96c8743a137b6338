"""``pagellm ray-serve``: with no Ray cluster around, the command starts a local Ray instance, deploys the app
behind Serve's proxy on --port, answers the OpenAI SDK, and on SIGTERM exits 0 leaving no Ray process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
from server_utils import _free_port, wait_until

USES_RAY = True  # one such module at a time across make test's workers (tests/conftest.py: Ray takes one local
# instance, and some of these tests check that none runs)


def _ray_processes() -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
        except OSError:
            continue
        if cmdline.startswith(b"ray::") or b"/ray/core/src/ray/" in cmdline:  # actors, raylet, gcs_server
            pids.append(int(proc.name))
    return pids


def test_the_command_serves_and_stops_with_its_ray_instance(tiny_llama: Path, tmp_path: Path) -> None:
    assert not _ray_processes(), "a Ray instance from elsewhere is running"
    port = _free_port()
    log = tmp_path / "ray-serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pagellm.cli", "ray-serve", str(tiny_llama), "--port",
                                 str(port), "--served-model-name", "tiny", "--dtype", "float32"],
                                stdout=out, stderr=subprocess.STDOUT,
                                env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    try:
        wait_until(lambda: b"is serving on Ray Serve" in log.read_bytes() or proc.poll() is not None, 120,
                   "pagellm ray-serve to be ready")
        assert proc.poll() is None, log.read_text()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        reply = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]
    wait_until(lambda: not _ray_processes(), 30, "every process of the command's Ray instance to exit")
