"""vLLM's ``/pause``, ``/resume`` and ``/is_paused``: a pause ends the streams in flight (``abort``, the default),
``keep`` and ``wait`` are taken, a bad mode is a 400 that names the modes, and requests run again after ``/resume``;
and ``--max-num-queued-reqs``: past it a request is a 503 at once."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
from server_utils import ServerProcess


@pytest.fixture(scope="module")
def paused_server(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    return start_server(tiny_llama, "--served-model-name", "tiny", "--max-num-queued-reqs", "1")


def _complete(server: ServerProcess) -> dict:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()


@contextlib.contextmanager
def _streaming(http: httpx.Client, url: str, max_tokens: int) -> Iterator[Iterator[dict]]:
    """A streamed completion that has sent its first chunk; yields its chunks from there on."""
    body = {"model": "tiny", "prompt": "a", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
        chunks = (json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {"))
        next(chunks)
        yield chunks


def test_pause_ends_the_streams_in_flight_and_resume_serves_again(paused_server: ServerProcess) -> None:
    url = paused_server.base_url
    with httpx.Client(timeout=60) as http:
        with _streaming(http, url, 500) as chunks:
            assert http.post(f"{url}/pause").json() == {"is_paused": True}
            rest = list(chunks)
        assert rest[-1]["choices"][0]["finish_reason"] == "abort" and len(rest) < 499
        assert http.get(f"{url}/is_paused").json() == {"is_paused": True}
        assert http.post(f"{url}/resume").json() == {"is_paused": False}
        assert http.get(f"{url}/is_paused").json() == {"is_paused": False}
    assert _complete(paused_server)["choices"][0]["finish_reason"] == "length"


def test_keep_and_wait_are_taken_and_a_bad_mode_is_a_400(paused_server: ServerProcess) -> None:
    url = paused_server.base_url
    for mode in ("keep", "wait"):
        assert httpx.post(f"{url}/pause", params={"mode": mode, "clear_cache": "false"}).json() == {"is_paused": True}
        assert httpx.post(f"{url}/resume").json() == {"is_paused": False}
        assert _complete(paused_server)["choices"][0]["finish_reason"] == "length"
    reply = httpx.post(f"{url}/pause", params={"mode": "drain"})
    assert reply.status_code == 400 and "abort, wait, keep" in reply.text
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": False}


def test_past_max_num_queued_reqs_a_request_is_a_503(paused_server: ServerProcess) -> None:
    url = paused_server.base_url
    with httpx.Client(timeout=60) as http:
        with _streaming(http, url, 200) as chunks:
            assert http.post(f"{url}/pause", params={"mode": "keep"}).json() == {"is_paused": True}
            refused = http.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "b", "max_tokens": 2})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "engine_overloaded"
            assert "--max-num-queued-reqs" in refused.json()["error"]["message"]
            http.post(f"{url}/resume")
            last = list(chunks)[-1]
        assert last["choices"][0]["finish_reason"] == "length"  # frozen, then on to its end
    assert _complete(paused_server)["choices"][0]["finish_reason"] == "length"  # room again
