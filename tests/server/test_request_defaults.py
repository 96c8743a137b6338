"""vLLM's serve flags for what requests leave unset, for request logging and for the app: ``--enable-force-include-
usage``, ``--return-tokens-as-token-ids``, ``--default-chat-template-kwargs``, ``--response-role``,
``--exclude-tools-when-tool-choice-none``, ``--enable-request-id-headers``, ``--enable-log-requests`` with
``--max-log-len`` and ``--enable-log-outputs``, ``--middleware``, ``--disable-fastapi-docs``; and their absence on the
shared server."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest
from server_utils import ServerProcess

TEMPLATE = ("{% if tools %}(tools){% endif %}{% if greeting %}[{{ greeting }}]{% endif %}"
            "{% for m in messages %}{{ m.content }}{% endfor %}")
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
TESTS = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def defaults_server(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    return start_server(tiny_llama, "--served-model-name", "tiny", "--chat-template", TEMPLATE,
                        "--enable-force-include-usage", "--return-tokens-as-token-ids",
                        "--default-chat-template-kwargs", json.dumps({"greeting": "HELLO"}),
                        "--enable-request-id-headers", "--enable-log-requests", "--max-log-len", "12",
                        "--enable-log-outputs", "--response-role", "bot", "--exclude-tools-when-tool-choice-none",
                        "--middleware", "app_middleware:StampClass", "--middleware", "app_middleware.stamp_function",
                        "--disable-fastapi-docs", "--enable-tokenizer-info-endpoint", env={"PYTHONPATH": str(TESTS)})


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_streams_end_with_usage_unasked(defaults_server: ServerProcess, server: ServerProcess) -> None:
    for stream in (_client(defaults_server).completions.create(model="tiny", prompt="abc", max_tokens=3,
                                                               stream=True),
                   _client(defaults_server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=3,
                                                                    stream=True)):
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    plain = list(_client(server).completions.create(model="tiny", prompt="abc", max_tokens=3, stream=True))
    assert all(chunk.usage is None for chunk in plain)


def test_logprobs_name_token_ids_unless_a_request_says_otherwise(defaults_server: ServerProcess) -> None:
    client = _client(defaults_server)
    named = client.completions.create(model="tiny", prompt="abc", max_tokens=3, logprobs=1, temperature=0)
    assert all(re.fullmatch(r"token_id:\d+", token) for token in named.choices[0].logprobs.tokens)
    texts = client.completions.create(model="tiny", prompt="abc", max_tokens=3, logprobs=1, temperature=0,
                                      extra_body={"return_tokens_as_token_ids": False})
    assert not any(token.startswith("token_id:") for token in texts.choices[0].logprobs.tokens)
    assert texts.choices[0].logprobs.token_logprobs == named.choices[0].logprobs.token_logprobs  # the same tokens


def test_chat_template_kwargs_default_under_the_requests_own(defaults_server: ServerProcess) -> None:
    client = _client(defaults_server)
    default = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    assert default.usage.prompt_tokens == len("[HELLO]hi")  # one byte, one token
    own = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"greeting": "BYE"}})
    assert own.usage.prompt_tokens == len("[BYE]hi")


def test_responses_carry_x_request_id(defaults_server: ServerProcess, server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 1}
    sent = httpx.post(f"{defaults_server.base_url}/v1/completions", json=body, headers={"X-Request-Id": "trace-7"})
    assert sent.headers["X-Request-Id"] == "trace-7"
    made = httpx.post(f"{defaults_server.base_url}/v1/completions", json=body)
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["X-Request-Id"])
    assert httpx.get(f"{defaults_server.base_url}/health").headers["X-Request-Id"]
    assert "X-Request-Id" not in httpx.post(f"{server.base_url}/v1/completions", json=body).headers


def test_requests_are_logged_cut_to_max_log_len(defaults_server: ServerProcess) -> None:
    _client(defaults_server).completions.create(model="tiny", prompt="The quick brown fox jumps", max_tokens=1,
                                                extra_body={"cache_salt": "tenant-secret"})
    logged = [line for line in defaults_server.log().splitlines() if "Received request" in line]
    line = next(line for line in logged if "'The quick br'" in line)
    assert "prompt_token_ids: [" in line and "(25 tokens)" in line and "cache_salt: set" in line
    assert "jumps" not in line and "tenant-secret" not in line and "max_tokens=1" in line


def test_bad_values_are_refused(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> None:
    with pytest.raises(RuntimeError, match="give a JSON object"):
        start_server(tiny_llama, "--default-chat-template-kwargs", "[1]")
    with pytest.raises(RuntimeError, match="--max-log-len must be >= 0"):
        start_server(tiny_llama, "--enable-log-requests", "--max-log-len", "-1")
    with pytest.raises(RuntimeError, match="--enable-log-outputs goes with --enable-log-requests"):
        start_server(tiny_llama, "--enable-log-outputs")
    with pytest.raises(RuntimeError, match="--middleware 'app_middleware:NOT_MIDDLEWARE'|give an ASGI middleware"):
        start_server(tiny_llama, "--middleware", "app_middleware:NOT_MIDDLEWARE", env={"PYTHONPATH": str(TESTS)})
    with pytest.raises(RuntimeError, match="--middleware 'nowhere:thing' cannot be imported"):
        start_server(tiny_llama, "--middleware", "nowhere:thing")


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server: ServerProcess) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): each chunk's usage counts the
    tokens sent so far (counted here by the ids each chunk carries, ``return_token_ids``, since the server may send
    several tokens in one chunk); the last usage-only chunk counts them all."""
    client = _client(server)
    options = {"include_usage": True, "continuous_usage_stats": True}
    extra = {"ignore_eos": True, "return_token_ids": True}
    for stream in (client.completions.create(model="tiny", prompt="abc", max_tokens=5, stream=True,
                                             stream_options=options, extra_body=extra),
                   client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, stream=True,
                                                  stream_options=options, extra_body=extra)):
        chunks, sent = list(stream), 0
        for chunk in chunks:
            sent += sum(len(choice.model_extra.get("token_ids") or []) for choice in chunk.choices)
            assert chunk.usage is not None and chunk.usage.completion_tokens == sent
        assert sent == 5 and len({chunk.usage.prompt_tokens for chunk in chunks}) == 1
    plain = list(client.completions.create(model="tiny", prompt="abc", max_tokens=5, stream=True,
                                           stream_options={"include_usage": True}))
    assert [chunk.usage is not None for chunk in plain] == [False] * (len(plain) - 1) + [True]


def test_chat_replies_take_the_response_role(defaults_server: ServerProcess, server: ServerProcess) -> None:
    client = _client(defaults_server)
    assert client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1).choices[0].message.role == "bot"
    first = next(iter(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, stream=True)))
    assert first.choices[0].delta.role == "bot"
    continued = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                               extra_body={"add_generation_prompt": False})
    assert continued.choices[0].message.role == "user"  # it continues the user's message
    assert _client(server).chat.completions.create(model="tiny", messages=CHAT,
                                                   max_tokens=1).choices[0].message.role == "assistant"


def test_tools_are_hidden_from_the_template_when_tool_choice_is_none(defaults_server: ServerProcess) -> None:
    client = _client(defaults_server)
    hidden = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, tools=TOOLS,
                                            tool_choice="none")
    assert hidden.usage.prompt_tokens == len("[HELLO]hi")
    shown = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "f"}})
    assert shown.usage.prompt_tokens == len("(tools)[HELLO]hi")


def test_outputs_are_logged_cut_to_max_log_len(defaults_server: ServerProcess) -> None:
    reply = _client(defaults_server).completions.create(model="tiny", prompt="log me", max_tokens=20,
                                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = reply.choices[0].token_ids
    lines = [line for line in defaults_server.log().splitlines()
             if "Generated response" in line and f"output_token_ids: {ids[:12]} (20 tokens)" in line]
    assert lines and "finish_reason: length" in lines[0]


def test_middleware_and_docs(defaults_server: ServerProcess, server: ServerProcess) -> None:
    reply = httpx.get(f"{defaults_server.base_url}/v1/models")
    assert reply.headers["X-Stamp-Class"] == "yes" and reply.headers["X-Stamp-Function"] == "/v1/models"
    assert "X-Stamp-Class" not in httpx.get(f"{server.base_url}/v1/models").headers
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(defaults_server.base_url + path).status_code == 404  # --disable-fastapi-docs
        assert httpx.get(server.base_url + path).status_code == 200
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/health"} <= set(schema["paths"])


def test_tokenizer_info(defaults_server: ServerProcess, server: ServerProcess, tiny_llama: Path) -> None:
    from pagellm.tokenizer import Tokenizer

    info = httpx.get(f"{defaults_server.base_url}/tokenizer_info").json()
    tokenizer = Tokenizer.from_dir(tiny_llama)
    assert info["model_max_length"] == 512 and info["vocab_size"] == tokenizer.vocab_size
    assert info["eos_token_ids"] == sorted(tokenizer.eos_token_ids) and info["tokenizer_class"]
    assert all(set(token) == {"content", "special"} for token in info["added_tokens_decoder"].values())
    assert info["chat_template"] == TEMPLATE  # the server's own (--chat-template)
    assert httpx.get(f"{server.base_url}/tokenizer_info").status_code == 404  # not without the flag
