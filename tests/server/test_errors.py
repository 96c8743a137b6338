"""Every bad request gets a 4xx in OpenAI's error shape, and the server keeps serving afterwards."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from server_utils import ServerProcess, engine_idle, wait_until

CHAT = [{"role": "user", "content": "hi"}]
COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": CHAT, "max_tokens": 2, **fields}


BAD_REQUESTS = [
    # (route, body, status, a fragment the message must contain, param)
    ("completions", {**COMPLETION, "temperature": 3}, 400, "temperature", "temperature"),
    ("completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature", "temperature"),
    ("completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": "5"}, 400, "max_tokens", "max_tokens"),
    ("completions", {**COMPLETION, "n": 0}, 400, "n", "n"),
    ("completions", {**COMPLETION, "top_p": 0}, 400, "top_p", "top_p"),
    ("completions", {**COMPLETION, "top_k": -5}, 400, "top_k", "top_k"),
    ("completions", {**COMPLETION, "stop": [""]}, 400, "stop", None),
    ("completions", {**COMPLETION, "min_tokens": 5}, 400, "min_tokens", None),
    ("completions", {**COMPLETION, "presence_penalty": 2.5}, 400, "presence_penalty", "presence_penalty"),
    ("completions", {**COMPLETION, "frequency_penalty": -3}, 400, "frequency_penalty", "frequency_penalty"),
    ("completions", {**COMPLETION, "repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty"),
    ("completions", {**COMPLETION, "logprobs": 21}, 400, "logprobs=21 ", None),
    ("completions", {**COMPLETION, "logprobs": -1}, 400, "logprobs", "logprobs"),
    ("completions", {**COMPLETION, "logprobs": 21, "stream": True}, 400, "max_logprobs (20)", None),
    ("chat/completions", _chat(logprobs=True, top_logprobs=21, stream=True), 400, "max_logprobs (20)", None),
    ("completions", {**COMPLETION, "logit_bias": {"5": 101}}, 400, "logit_bias values must be in [-100, 100]", None),
    ("completions", {**COMPLETION, "logit_bias": {"five": 1}}, 400, "logit_bias keys must be token ids", None),
    ("completions", {**COMPLETION, "logit_bias": {"99999": 1}}, 400, "logit_bias: token ids must be in [0, 320)",
     None),
    ("completions", {**COMPLETION, "allowed_token_ids": [400]}, 400, "allowed_token_ids: token ids", None),
    ("completions", {**COMPLETION, "allowed_token_ids": []}, 400, "allowed_token_ids must not be empty", None),
    ("completions", {**COMPLETION, "n": 3, "best_of": 2}, 400, "best_of must be >= n", None),
    ("completions", {**COMPLETION, "best_of": 3, "stream": True}, 400, "best_of > n cannot be streamed", "best_of"),
    ("completions", {**COMPLETION, "guided_json": {"type": "foo"}}, 400, "invalid structured_outputs.json", None),
    ("completions", {**COMPLETION, "guided_json": "{not json"}, 400, "not valid JSON", None),
    ("completions", {**COMPLETION, "response_format": {"type": "yaml"}}, 400, "response_format type must be", None),
    ("completions", {**COMPLETION, "repetition_detection": {"max_pattern_size": 3, "min_count": 1}}, 400,
     "repetition_detection: min_count must be >= 2", None),
    ("completions", {**COMPLETION, "thinking_token_budget": 8}, 400,
     "thinking_token_budget needs the model's thinking tags: start the server with --reasoning-parser", None),
    ("completions", {**COMPLETION, "thinking_token_budget": -2}, 400, "greater than or equal to -1",
     "thinking_token_budget"),
    ("completions", {**COMPLETION, "guided_regex": "a+", "response_format": {"type": "json_object"}}, 400,
     "give at most one structured-output constraint, got guided_regex, response_format", None),
    ("completions", {**COMPLETION, "guided_regex": "(ab"}, 400, "invalid structured_outputs.regex", None),
    ("completions", {**COMPLETION, "guided_grammar": "root ::= undefined_rule"}, 400,
     "invalid structured_outputs.grammar", None),
    ("completions", {**COMPLETION, "guided_choice": []}, 400, "choice must be a non-empty list", None),
    ("completions", {**COMPLETION, "guided_regex": "a", "guided_choice": ["b"]}, 400, "at most one", None),
    ("completions", {**COMPLETION, "structured_outputs": {"xml": "<a/>"}}, 400, "unknown keys ['xml']", None),
    ("completions", {**COMPLETION, "no_such_field": 1}, 400, "no_such_field", "no_such_field"),
    ("completions", {**COMPLETION, "model": "gpt-4"}, 404, "gpt-4", "model"),
    ("completions", {**COMPLETION, "prompt": "x" * 600}, 400, "max_model_len is 512", "prompt"),
    ("completions", {**COMPLETION, "prompt": ""}, 400, "empty", "prompt"),
    ("completions", {**COMPLETION, "prompt": []}, 400, "empty", "prompt"),
    ("completions", {**COMPLETION, "prompt": [1, 99999]}, 400, "token ids", "prompt"),
    ("completions", {"model": "tiny"}, 400, "prompt", "prompt"),
    # a value that fits none of a union's types: named by where it went wrong in the type it came closest to
    ("completions", {**COMPLETION, "prompt": [1, -2]}, 400, "prompt.1: Input should be greater than or equal to 0",
     "prompt.1"),
    ("completions", {**COMPLETION, "prompt": [[1], [2, -1]]}, 400, "prompt.1.1: Input should be greater", "prompt.1.1"),
    ("completions", {**COMPLETION, "stop": 5}, 400, "stop: Input should be a valid string or a valid list", "stop"),
    ("chat/completions", _chat(messages=[]), 400, "messages", "messages"),
    ("chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "role", "messages.0.role"),
    ("chat/completions", _chat(messages=[{"content": "x"}]), 400, "role", "messages.0.role"),
    ("chat/completions", _chat(messages="hello"), 400, "messages", "messages"),
    ("chat/completions", _chat(messages=[{"role": "user", "content": "x" * 600}]), 400,
     "max_model_len is 512", "prompt"),
    ("chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "text parts", None),
    ("chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400,
     "messages[0].content[0]: a text part needs its text", None),
    ("chat/completions", _chat(messages=[{"role": "user"}]), 400, "messages.0: a user message needs its content",
     "messages.0"),
    ("chat/completions", _chat(top_logprobs=3), 400, "needs logprobs: true", "top_logprobs"),
    ("chat/completions", _chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs", "top_logprobs"),
    ("chat/completions", _chat(logprobs=True, top_logprobs=21), 400, "more than this engine's max_logprobs (20)",
     None),
    ("chat/completions", _chat(tools=[{"type": "function"}]), 400, "each tool must be", "tools"),
    ("chat/completions", _chat(presence_penalty=2.5), 400, "presence_penalty", "presence_penalty"),
    ("chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "json_schema needs", None),
    ("chat/completions", _chat(response_format={"type": "yaml"}), 400, "response_format type must be", None),
    ("chat/completions", _chat(response_format={"type": "structural_tag", "structures": [], "triggers": ["<f>"]}),
     400, "invalid structured_outputs.structural_tag", None),
    ("chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}), 400,
     "invalid structured_outputs.json", None),
    ("chat/completions", _chat(max_completion_tokens=-1), 400, "max_completion_tokens", "max_completion_tokens"),
    ("chat/completions", _chat(stream="yes"), 400, "stream", "stream"),
    ("chat/completions", _chat(stream=True, stream_options={"include_usage": "x"}), 400, "include_usage",
     "stream_options.include_usage"),
    ("chat/completions", _chat(model="other"), 404, "other", "model"),
]


@pytest.mark.parametrize("route,body,status,fragment,param", BAD_REQUESTS,
                         ids=[f"{r}-{i}" for i, (r, *_) in enumerate(BAD_REQUESTS)])
def test_bad_request_gets_openai_error(server: ServerProcess, route: str, body: dict, status: int, fragment: str,
                                       param: str | None) -> None:
    response = httpx.post(f"{server.base_url}/v1/{route}", json=body, timeout=10)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"", b'"text"'])
def test_malformed_bodies(server: ServerProcess, content: bytes) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=content,
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("route,body", [
    ("completions", {**COMPLETION, "prompt": "a\ud800b"}),
    ("chat/completions", _chat(messages=[{"role": "user", "content": "x\udfff"}])),
])
def test_lone_surrogates_are_refused(server: ServerProcess, route: str, body: dict) -> None:
    # JSON's \ud800 escapes can carry text that is not Unicode; the tokenizer takes only Unicode
    response = httpx.post(f"{server.base_url}/v1/{route}", content=json.dumps(body).encode(),
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400, response.text
    assert "lone surrogate" in response.json()["error"]["message"]


def test_unknown_route_and_method(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/v1/nothing").json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/v1/completions").status_code == 405


def test_sdk_raises_typed_errors(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="needs a tool-call parser"):
        client.chat.completions.create(model="tiny", messages=CHAT, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="x")
    with pytest.raises(openai.BadRequestError, match="512"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y" * 1000}],
                                       stream=True)


def test_bad_requests_do_not_disturb_a_running_stream(server: ServerProcess) -> None:
    body = _chat(max_tokens=200, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            for route, bad, status, *_ in BAD_REQUESTS:
                assert http.post(f"{server.base_url}/v1/{route}", json=bad).status_code == status
            events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 200
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    wait_until(lambda: engine_idle(server.base_url), 20, "the engine to go idle")
