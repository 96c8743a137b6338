"""``--uds PATH``: the server listens on a Unix domain socket instead of a TCP port (the OpenAI SDK over it), replaces
a stale socket file, refuses a path another server answers on, and removes its socket when it stops."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import openai
from server_utils import ENGINE_FLAGS, ServerProcess


def test_serves_over_a_unix_socket(tiny_llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "pagellm.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a socket file nobody listens on: what a killed server leaves
    stale.close()
    server = ServerProcess(tiny_llama, ["--served-model-name", "tiny", "--uds", str(path)], tmp_path / "log")
    try:
        server.wait_healthy()
        sdk = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0,
                            http_client=server.client(timeout=60))
        reply = sdk.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 4
        with socket.socket() as tcp:  # no TCP port is opened
            assert tcp.connect_ex(("127.0.0.1", server.port)) != 0
        second = subprocess.run([sys.executable, "-m", "pagellm.cli", "serve", str(tiny_llama), *ENGINE_FLAGS,
                                 "--uds", str(path)], capture_output=True, text=True, timeout=120)
        assert second.returncode != 0 and f"a server already listens on {path}" in second.stderr
        assert server.client(timeout=10).get("http://localhost/health").status_code == 200  # untouched
    finally:
        assert server.stop() == 0
    assert not path.exists()  # removed on the way out
