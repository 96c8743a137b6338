"""Fixtures for the benchmark tests: the black-box server helpers of tests/server (a real ``pagellm serve``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_utils import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def bench_server(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[ServerProcess]:
    """A tiny-model server with room for chat transcripts (2048-token context), behind an API key (``api_key``),
    profiling into ``<its folder>/traces`` when asked."""
    model = tiny_model_factory("llama", max_position_embeddings=2048)
    folder = tmp_path_factory.mktemp("bench-server")
    server = ServerProcess(model, ["--max-model-len", "2048", "--served-model-name", "tiny", "--api-key", "sk-bench",
                                   "--profiler-dir", str(folder / "traces")], folder / "server.log")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
