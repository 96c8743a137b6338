"""``--api-key``: every ``/v1`` route needs the Bearer key (401 in OpenAI's shape otherwise); ops routes stay open."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import anthropic
import httpx
import openai
import pytest
from server_utils import ServerProcess

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def auth_server(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    return start_server(tiny_llama, "--api-key", KEY)


def test_right_key_works(auth_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{auth_server.base_url}/v1", api_key=KEY, max_retries=0)
    assert client.models.list().data[0].id == str(auth_server.model)
    out = client.completions.create(model=str(auth_server.model), prompt="a", max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": "Basic " + KEY}])
@pytest.mark.parametrize("method,route", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("POST", "/v1/chat/completions"), ("POST", "/score"),
                                          ("POST", "/v2/rerank"), ("POST", "/invocations")])
def test_missing_or_wrong_key_is_401(auth_server: ServerProcess, headers: dict, method: str, route: str) -> None:
    response = httpx.request(method, auth_server.base_url + route, headers=headers, json={"prompt": "x"})
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"


def test_sdk_sees_authentication_error(auth_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{auth_server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])


def test_anthropics_messages_take_the_key_as_its_clients_send_it(auth_server: ServerProcess) -> None:
    model, ask = str(auth_server.model), [{"role": "user", "content": "x"}]
    for client in (anthropic.Anthropic(base_url=auth_server.base_url, api_key=KEY, max_retries=0),  # x-api-key
                   anthropic.Anthropic(base_url=auth_server.base_url, auth_token=KEY, max_retries=0)):  # Bearer
        assert client.messages.create(model=model, messages=ask, max_tokens=2).usage.output_tokens >= 1
        assert client.messages.count_tokens(model=model, messages=ask).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as raised:
        anthropic.Anthropic(base_url=auth_server.base_url, api_key="nope", max_retries=0).messages.create(
            model=model, messages=ask, max_tokens=2)
    assert raised.value.body["error"] == {"type": "authentication_error", "message": "Incorrect API key provided."}
    missing = httpx.post(f"{auth_server.base_url}/v1/messages", json={"model": model, "messages": ask})
    assert missing.status_code == 401 and "x-api-key" in missing.json()["error"]["message"]


def test_ops_routes_stay_open(auth_server: ServerProcess) -> None:
    assert httpx.get(f"{auth_server.base_url}/health").status_code == 200
    assert httpx.get(f"{auth_server.base_url}/stats").status_code == 200
    assert httpx.get(f"{auth_server.base_url}/ping").status_code == 200  # SageMaker's health check
    assert httpx.get(f"{auth_server.base_url}/kv_event_sources").json() == {}  # no KV events published


def test_no_key_configured_means_open(server: ServerProcess) -> None:
    response = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Bearer anything"})
    assert response.status_code == 200
