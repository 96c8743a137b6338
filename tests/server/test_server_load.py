"""``--enable-server-load-tracking``: ``GET /load`` counts the inference requests in flight, a stream until its last
event or until its client leaves; other routes do not count, and without the flag there is no ``/load``.

The counting is checked on the middleware itself with requests held open at will (a real model finishes on its own
time); the live servers show the route end to end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable

import httpx
import pytest
from fastapi import FastAPI
from server_utils import ServerProcess

from pagellm.server.openai import server_load


class _Held:
    """An app whose routes stay in flight until released (or fail when told to)."""

    def __init__(self) -> None:
        self.app = FastAPI()
        self.release = asyncio.Event()
        server_load.install(self.app)

        async def held() -> dict:
            await self.release.wait()
            return {}

        async def broken() -> dict:
            await self.release.wait()
            raise RuntimeError("the route failed")

        for path in ("/v1/completions", "/invocations", "/tokenize"):
            self.app.add_api_route(path, held, methods=["POST"])
        self.app.add_api_route("/v1/embeddings", broken, methods=["POST"])

    async def call(self, path: str, root_path: str = "") -> None:
        """One request, as uvicorn hands it to the app; returns when the app is done with it."""
        scope = {"type": "http", "method": "POST", "path": root_path + path, "raw_path": (root_path + path).encode(),
                 "root_path": root_path, "query_string": b"", "headers": [], "http_version": "1.1",
                 "scheme": "http", "server": ("test", 80), "client": ("test", 1)}
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.Event().wait()  # the client never goes away by itself
            return {}

        async def send(message: dict) -> None:
            pass

        await self.app(scope, receive, send)

    def load(self) -> int:
        return self.app.state.server_load


def test_in_flight_requests_are_counted_until_done() -> None:
    async def scenario() -> None:
        held = _Held()
        tasks = [asyncio.create_task(held.call(path)) for path in ("/v1/completions", "/invocations", "/tokenize")]
        tasks.append(asyncio.create_task(held.call("/v1/completions", root_path="/llm")))  # behind a proxy prefix
        await asyncio.sleep(0)  # nothing is awaited but the app's own first steps
        for _ in range(50):
            if held.load() == 3:
                break
            await asyncio.sleep(0.01)
        assert held.load() == 3  # /tokenize runs no model: not counted
        held.release.set()
        await asyncio.gather(*tasks)
        assert held.load() == 0

    asyncio.run(scenario())


def test_a_failing_or_abandoned_request_stops_counting() -> None:
    async def scenario() -> None:
        held = _Held()
        failing = asyncio.create_task(held.call("/v1/embeddings"))
        abandoned = asyncio.create_task(held.call("/v1/completions"))
        while held.load() < 2:
            await asyncio.sleep(0.01)
        abandoned.cancel()  # what uvicorn does when the client disconnects mid-request
        await asyncio.gather(abandoned, return_exceptions=True)
        assert held.load() == 1
        held.release.set()
        await asyncio.gather(failing, return_exceptions=True)
        assert held.load() == 0

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def tracked(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    return start_server(tiny_llama, "--served-model-name", "tiny", "--enable-server-load-tracking")


def test_the_live_route(tracked: ServerProcess) -> None:
    load = f"{tracked.base_url}/load"
    assert httpx.get(load, timeout=10).json() == {"server_load": 0}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8}
    assert httpx.post(f"{tracked.base_url}/v1/completions", json=body, timeout=60).status_code == 200
    with httpx.stream("POST", f"{tracked.base_url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert list(r.iter_lines())[-2] == "data: [DONE]"
    assert httpx.post(f"{tracked.base_url}/v1/completions", json={**body, "max_tokens": -1}).status_code == 400
    assert httpx.get(load, timeout=10).json() == {"server_load": 0}  # every one was counted out again


def test_no_load_route_without_the_flag(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/load", timeout=10).status_code == 404
