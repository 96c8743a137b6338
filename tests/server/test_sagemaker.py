"""SageMaker's contract: ``/ping`` is the health check, ``POST /invocations`` serves every kind of request on one
path, each exactly as its own route does (validation, streaming and errors included)."""

from __future__ import annotations

import httpx
import pytest
from server_utils import ServerProcess

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
        "ignore_eos": True}
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
EMBEDDING = {"model": "tiny", "input": ["one text", "another"]}
RERANK = {"model": "tiny", "query": "a query", "documents": ["first", "second"]}


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_is_the_health_check(server: ServerProcess, method: str) -> None:
    assert httpx.request(method, f"{server.base_url}/ping").status_code == 200


@pytest.mark.parametrize("body,route", [(CHAT, "/v1/chat/completions"), (COMPLETION, "/v1/completions"),
                                        (EMBEDDING, "/v1/embeddings"), (RERANK, "/rerank")])
def test_invocations_answer_as_the_route_of_their_kind(server: ServerProcess, body: dict, route: str) -> None:
    direct = httpx.post(server.base_url + route, json=body, timeout=60)
    invoked = httpx.post(f"{server.base_url}/invocations", json=body, timeout=60)
    assert direct.status_code == invoked.status_code == 200
    assert _comparable(invoked.json()) == _comparable(direct.json())


def _comparable(reply: dict) -> dict:
    """A reply without what differs between two identical requests: its id, time and prefix-cache hits. Scores and
    embeddings compare to 1e-5: a request batched beside another (or over a cached prefix) sums in another order."""
    reply = {k: v for k, v in reply.items() if k not in ("id", "created")}
    if isinstance(reply.get("usage"), dict):
        reply["usage"] = {k: v for k, v in reply["usage"].items() if k != "prompt_tokens_details"}
    return _floats_approx(reply)


def _floats_approx(value):
    if isinstance(value, float):
        return pytest.approx(value, abs=1e-5)
    if isinstance(value, dict):
        return {k: _floats_approx(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats_approx(v) for v in value]
    return value


def test_invocations_stream(server: ServerProcess) -> None:
    with httpx.stream("POST", f"{server.base_url}/invocations", json={**CHAT, "stream": True}, timeout=60) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


@pytest.mark.parametrize("content,message", [
    (b'{"model": "tiny"}', "one of the kinds chat (messages), completion"),
    (b"[1, 2]", "one of the kinds"),
    (b"not json", "one of the kinds"),
])
def test_bodies_of_no_kind_are_400s(server: ServerProcess, content: bytes, message: str) -> None:
    reply = httpx.post(f"{server.base_url}/invocations", content=content, timeout=60,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400 and message in reply.json()["error"]["message"]


def test_the_routes_own_validation_applies(server: ServerProcess) -> None:
    reply = httpx.post(f"{server.base_url}/invocations", json={**COMPLETION, "max_tokens": -1}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
