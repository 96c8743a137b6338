"""Helpers for black-box server tests: a ``pagellm serve`` subprocess, polling waits (never fixed sleeps)."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
from proc_utils import without_trackers

STARTUP_TIMEOUT_S = 120.0
# A small KV pool (~2k blocks on the tiny model) keeps each server's memory low; plenty for 64 streams.
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "16000000", "--max-model-len", "512"]


class ServerProcess:
    def __init__(self, model: Path, extra_args: list[str], log_path: Path, ca: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        """``ca``: the server speaks HTTPS with a certificate from this CA (PEM), which ``verify`` then trusts;
        ``env``: variables over the defaults (one thread, INFO logs)."""
        self.model = model
        # --uds PATH: the server listens on that Unix socket only (``client()`` talks over it)
        self.uds = extra_args[extra_args.index("--uds") + 1] if "--uds" in extra_args else None
        self.scheme = "https" if ca else "http"
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca)) if ca else True
        self.api_key = extra_args[extra_args.index("--api-key") + 1] if "--api-key" in extra_args else None
        self.extra_args = extra_args
        self.env = {**os.environ, "PAGELLM_NUM_THREADS": "1", "PAGELLM_LOG_LEVEL": "INFO", **(env or {})}
        self.log_path = log_path
        self._launch()

    def _launch(self) -> None:
        """Start the server on a port free a moment ago (``wait_healthy`` starts it again on another when some other
        process took that one in between: the port is chosen seconds before the server binds it)."""
        self.port = _free_port()
        self.base_url = "http://localhost" if self.uds else f"{self.scheme}://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagellm.cli", "serve", str(self.model), "--port", str(self.port), *ENGINE_FLAGS,
               *self.extra_args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline, relaunches = time.monotonic() + timeout, 3
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "(Address already in use)" in self.log() and relaunches and not self.uds:
                    relaunches -= 1
                    self._log.close()
                    self._launch()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-5000:]}")
            try:
                with self.client(timeout=1.0) as client:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()[-5000:]}")

    def client(self, **kwargs: object) -> httpx.Client:
        """An HTTP client of this server (over its Unix socket with ``--uds``)."""
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        return httpx.Client(transport=transport, verify=self.verify, **kwargs)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> list[int]:
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            pids += [int(p) for p in (task / "children").read_text().split()]
        return pids

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def engine_cores(server: ServerProcess) -> set[int]:
    """The server's engine-core processes (its children but the resource tracker)."""
    return without_trackers(set(server.child_pids()))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def engine_idle(base_url: str) -> bool:
    stats = httpx.get(f"{base_url}/stats", timeout=5).json()
    return stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0 and stats["kv_cache_usage"] == 0


def think_first(**fields: object) -> dict:
    """Request fields that make the ``thinker`` model write "<think>a</think>" first (the bias orders the three
    tokens, each bad word stops a repeat), then follow ``fields`` (a constraint waits for ``</think>``)."""
    a = 64  # the byte token of "a"
    return {"logit_bias": {"260": 60, str(a): 50, "261": 40}, **fields,
            "bad_words": ["<think><think>", "<think></think>", "a<think>", "aa"]}
