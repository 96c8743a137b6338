"""``POST /start_profile`` and ``/stop_profile``: a torch profile of the engine core under real requests, guarded by
the API key, 409 when said twice, 400 with the fix when the server has no profiler folder."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest
from server_utils import ServerProcess

KEY = "sk-profile"


@pytest.fixture(scope="module")
def profiled_server(start_server: Callable[..., ServerProcess], tiny_llama: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    traces = tmp_path_factory.mktemp("traces")
    return start_server(tiny_llama, "--api-key", KEY, "--profiler-dir", str(traces))


def _post(server: ServerProcess, route: str, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url + route, headers=headers, timeout=120)


def test_a_profile_records_the_requests_in_between(profiled_server: ServerProcess) -> None:
    assert _post(profiled_server, "/start_profile", key=None).status_code == 401  # it writes files: key needed
    refused = _post(profiled_server, "/stop_profile")
    assert refused.status_code == 409 and "no profile is recording" in refused.json()["error"]["message"]
    assert _post(profiled_server, "/start_profile").json() == {"status": "recording"}
    again = _post(profiled_server, "/start_profile")
    assert again.status_code == 409 and "POST /stop_profile" in again.json()["error"]["message"]
    client = openai.OpenAI(base_url=f"{profiled_server.base_url}/v1", api_key=KEY, max_retries=0)
    client.completions.create(model=str(profiled_server.model), prompt="hello", max_tokens=3)
    stopped = _post(profiled_server, "/stop_profile")
    assert stopped.status_code == 200
    trace, summary = map(Path, stopped.json()["files"])
    names = {e.get("name") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]}
    assert {"pagellm::schedule", "pagellm::forward", "pagellm::sample"} <= names
    assert "pagellm::forward" in summary.read_text()


def test_a_server_without_a_profiler_folder_says_how_to_get_one(server: ServerProcess) -> None:
    response = httpx.post(f"{server.base_url}/start_profile", timeout=30)
    assert response.status_code == 400
    assert "profiling is off" in response.json()["error"]["message"]
    assert "--profiler-dir" in response.json()["error"]["message"]
