"""The streaming client against a scripted server (httpx.MockTransport): chunk parsing, token counts, errors."""

from __future__ import annotations

import asyncio
import json

import httpx

from pagellm.bench.client import ClientOptions, send
from pagellm.bench.datasets import BenchRequest


def _sse(*chunks: dict, done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n" for c in chunks)
    return body + (b"data: [DONE]\n\n" if done else b"")


def _run(body: bytes, req: BenchRequest, status: int = 200, **opts) -> tuple:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append({"path": request.url.path, **json.loads(request.content)})
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as http:
            return await send(http, req, ClientOptions(model="m", **opts))

    return asyncio.run(go()), seen


def test_completion_stream_with_usage_and_a_line_separator_inside_the_text() -> None:
    body = _sse({"choices": [{"text": "a\u2028b"}]}, {"choices": [{"text": "c"}]}, {"choices": [{"text": "\x85"}]},
                {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
    result, seen = _run(body, BenchRequest([101, 102, 103, 104], output_len=3, prompt_len=4))
    assert result.success and result.error == ""
    assert result.text == "a\u2028bc\x85"  # SSE lines end at \n only, not at U+2028 / U+0085
    assert (result.prompt_len, result.output_len, len(result.itl)) == (4, 3, 2)
    assert 0 < result.ttft <= result.latency
    assert seen[0]["path"] == "/v1/completions" and seen[0]["prompt"] == [101, 102, 103, 104]
    assert seen[0]["ignore_eos"] is True and seen[0]["stream_options"] == {"include_usage": True}


def test_chat_stream_without_usage_counts_with_the_tokenizer_or_chunks() -> None:
    body = _sse({"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "hi "}}]},
                {"choices": [{"delta": {"content": "there"}}]})
    req = BenchRequest(None, output_len=8, messages=[{"role": "user", "content": "hello"}])
    result, seen = _run(body, req)
    assert seen[0]["path"] == "/v1/chat/completions" and seen[0]["messages"] == req.messages
    assert (result.success, result.text, result.output_len) == (True, "hi there", 2)  # one token per chunk
    result, _ = _run(body, req, count_tokens=lambda text: len(text))
    assert result.output_len == 8


def test_http_errors_and_error_events_fail_the_request() -> None:
    result, _ = _run(b'{"error": "bad"}', BenchRequest("x", 2), status=400)
    assert not result.success and result.error.startswith("RuntimeError: HTTP 400")
    result, _ = _run(_sse({"error": {"message": "engine died"}}), BenchRequest("x", 2))
    assert not result.success and "engine died" in result.error
    result, _ = _run(_sse(done=True), BenchRequest("x", 2))
    assert not result.success and result.error == "the stream carried no tokens"
