"""Black-box server fixtures: start ``pagellm serve`` on a tiny model as a real subprocess, wait for ``/health``."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest
from server_utils import ServerProcess


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """Start a server (``start_server(model, *args)``); every server still running is stopped at the end."""
    started: list[ServerProcess] = []

    def start(model: Path, *args: str) -> ServerProcess:
        server = ServerProcess(model, list(args), tmp_path_factory.mktemp("server") / "server.log")
        started.append(server)
        server.wait_healthy()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    """The shared server (no API key) most tests talk to."""
    return start_server(tiny_llama, "--served-model-name", "tiny")
