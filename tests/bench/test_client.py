"""The streaming client against a scripted local aiohttp server: chunk parsing across reads, token counts, errors."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest
from aiohttp import web

from pagellm.bench.client import ClientOptions, SseLines, connect, first_model, profile, send, wait_ready
from pagellm.bench.datasets import BenchRequest


def _sse(*chunks: dict, done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n" for c in chunks)
    return body + (b"data: [DONE]\n\n" if done else b"")


async def _serve(pieces: list[bytes], status: int, seen: list[dict]) -> web.AppRunner:
    """A server answering each POST with ``pieces``, written (and drained) one by one: one network read each."""

    async def stream(request: web.Request) -> web.StreamResponse:
        seen.append({"path": request.path, "headers": dict(request.headers), **json.loads(await request.read())})
        response = web.StreamResponse(status=status, headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0.001)  # lets the client read each piece on its own (the parser must not care)
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "served"}]})

    app = web.Application()
    app.add_routes([web.post("/v1/completions", stream), web.post("/v1/chat/completions", stream),
                    web.get("/v1/models", models)])
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def _run(body: bytes | list[bytes], req: BenchRequest, status: int = 200, **opts) -> tuple:
    seen: list[dict] = []

    async def go():
        runner = await _serve(body if isinstance(body, list) else [body], status, seen)
        host, port = runner.addresses[0][:2]
        try:
            async with connect(f"http://{host}:{port}/", close_connections=opts.get("close_connections", False)) \
                    as server:
                return await send(server, req, ClientOptions(model="m", **opts)), await first_model(server)
        finally:
            await runner.cleanup()

    (result, model) = asyncio.run(go())
    assert model == "served"
    return result, seen


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
    assert seen[0]["headers"].get("Connection", "").lower() != "close"


def test_events_split_across_reads_anywhere_are_reassembled() -> None:
    body = _sse({"choices": [{"text": "x\u2028y"}]}, {"choices": [{"text": "z"}]},
                {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}).replace(b"\n\n", b"\r\n\r\n")
    cut = body.index("\u2028".encode()) + 1  # inside the three UTF-8 bytes of U+2028
    pieces = [body[:7], body[7:cut], body[cut:cut + 30], body[cut + 30:]]
    result, _ = _run(pieces, BenchRequest([1, 2], output_len=2, prompt_len=2))
    assert (result.success, result.text, result.output_len, len(result.itl)) == (True, "x\u2028yz", 2, 1)
    splitter = SseLines()
    lines = [line for i in range(len(body)) for line in splitter.feed(body[i:i + 1])] + splitter.close()
    assert lines == body.decode().replace("\r\n", "\n").encode().split(b"\n")[:-1]  # byte by byte, same lines


def test_a_body_without_done_or_final_newline_still_counts_its_last_event() -> None:
    body = _sse({"choices": [{"text": "p"}]}, done=False) + b'data: {"choices": [{"text": "q"}]}'
    result, _ = _run(body, BenchRequest("x", 2), close_connections=True)
    assert (result.success, result.text, result.output_len) == (True, "pq", 2)


def test_chat_stream_without_usage_counts_with_the_tokenizer_or_chunks() -> None:
    body = _sse({"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "hi "}}]},
                {"choices": [{"delta": {"content": "there"}}]})
    req = BenchRequest(None, output_len=8, messages=[{"role": "user", "content": "hello"}])
    result, seen = _run(body, req)
    assert seen[0]["path"] == "/v1/chat/completions" and seen[0]["messages"] == req.messages
    assert (result.success, result.text, result.output_len) == (True, "hi there", 2)  # one token per chunk
    result, seen = _run(body, req, count_tokens=lambda text: len(text), close_connections=True)
    assert result.output_len == 8
    assert seen[0]["headers"]["Connection"].lower() == "close"


def test_tokens_without_text_take_their_first_token_time_from_the_finishing_chunk() -> None:
    finish = {"choices": [{"text": "", "finish_reason": "length"}]}  # every token an unfinished UTF-8 sequence
    usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}
    result, _ = _run([_sse(finish, done=False), _sse(usage)], BenchRequest([1, 2], output_len=3, prompt_len=2))
    assert (result.success, result.text, result.output_len, result.itl) == (True, "", 3, [])
    assert 0 < result.ttft < result.latency  # the finishing chunk's time, read before the usage chunk's
    result, _ = _run(_sse(usage), BenchRequest([1, 2], output_len=3, prompt_len=2))
    assert result.success and result.ttft == result.latency  # no chunk with a choice: the stream's end


def test_http_errors_and_error_events_fail_the_request() -> None:
    result, _ = _run(b'{"error": "bad"}', BenchRequest("x", 2), status=400)
    assert not result.success and result.error.startswith("RuntimeError: HTTP 400") and "bad" in result.error
    result, _ = _run(_sse({"choices": [{"text": "a"}]}, {"error": {"message": "engine died"}}), BenchRequest("x", 2))
    assert not result.success and result.error == "RuntimeError: engine died" and result.latency > 0
    result, _ = _run(_sse({"error": "plain text error"}), BenchRequest("x", 2))
    assert not result.success and result.error == "RuntimeError: plain text error"
    result, _ = _run(b"data: {not json\n\n", BenchRequest("x", 2))
    assert not result.success and result.error.startswith("DecodeError")
    result, _ = _run(_sse(done=True), BenchRequest("x", 2))
    assert not result.success and result.error == "the stream carried no tokens"


def test_headers_key_and_extra_body_fields_reach_the_server() -> None:
    async def go(headers: dict[str, str]) -> dict:
        seen: list[dict] = []
        runner = await _serve([_sse({"choices": [{"text": "a"}]})], 200, seen)
        host, port = runner.addresses[0][:2]
        try:
            async with connect(f"http://{host}:{port}", api_key="sk-1", headers=headers) as server:
                opts = ClientOptions(model="m", temperature=0.5, extra_body={"top_k": 3, "max_tokens": 9})
                assert (await send(server, BenchRequest([1], output_len=2, prompt_len=1), opts)).success
        finally:
            await runner.cleanup()
        return seen[0]

    seen = asyncio.run(go({"X-Tenant": "blue"}))
    assert seen["headers"]["X-Tenant"] == "blue" and seen["headers"]["Authorization"] == "Bearer sk-1"
    assert (seen["temperature"], seen["top_k"], seen["max_tokens"]) == (0.5, 3, 9)  # extra fields win
    assert "top_p" not in seen  # sampling fields nobody gave are left to the server's defaults
    seen = asyncio.run(go({"authorization": "Token abc"}))
    assert seen["headers"]["Authorization"] == "Token abc"  # a header given by name beats --api-key


@asynccontextmanager
async def _site(app: web.Application) -> AsyncIterator[str]:
    """``app`` served on a free loopback port for the block; its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def _readiness(statuses: list[int], timeout_s: float) -> tuple[str | None, int]:
    """``wait_ready`` against /v1/models answering ``statuses`` in turn (the last one from then on): the error it
    raised (None when it returned) and how many times it asked."""
    asked: list[int] = []

    async def models(request: web.Request) -> web.Response:
        asked.append(1)
        status = statuses[min(len(asked), len(statuses)) - 1]
        return web.json_response({"data": [{"id": "m"}]} if status == 200 else {"error": "loading"}, status=status)

    async def go() -> str | None:
        app = web.Application()
        app.add_routes([web.get("/v1/models", models)])
        async with _site(app) as base_url, connect(base_url) as server:
            try:
                await wait_ready(server, timeout_s, poll_s=0.02)
            except ValueError as exc:
                return str(exc)
        return None

    return asyncio.run(go()), len(asked)


def test_wait_ready_polls_until_the_server_lists_its_models() -> None:
    assert _readiness([503, 503, 200], timeout_s=30) == (None, 3)  # llama-server answers 503 while it loads
    error, asked = _readiness([503, 200], timeout_s=0)
    assert asked == 1 and "not ready (--ready-check-timeout S waits for it)" in error and "HTTP 503" in error
    error, asked = _readiness([401], timeout_s=30)
    assert asked == 1 and "HTTP 401" in error and "pass --api-key" in error  # a key will not appear by waiting


def test_wait_ready_says_when_nothing_answers() -> None:
    async def go() -> str:
        async with connect("http://127.0.0.1:9") as server:  # the discard port: nothing listens here
            with pytest.raises(ValueError) as info:
                await wait_ready(server, 0.05, poll_s=0.02)
        return str(info.value)

    error = asyncio.run(go())
    assert "after waiting 0.05 s" in error and "nothing answers at http://127.0.0.1:9" in error


def test_a_server_that_does_not_profile_is_a_clear_error() -> None:
    async def go() -> str:
        app = web.Application()  # no /start_profile route: a 404, as vLLM without --profiler-config answers
        async with _site(app) as base_url, connect(base_url) as server:
            with pytest.raises(ValueError) as info:
                await profile(server, "start_profile")
        return str(info.value)

    error = asyncio.run(go())
    assert error.startswith("POST /start_profile: HTTP 404") and "--profiler-dir DIR" in error


def test_unstreamed_requests_take_the_whole_answer_at_once() -> None:
    whole = json.dumps({"choices": [{"text": "abc", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 2, "completion_tokens": 3}}).encode()
    result, seen = _run(whole, BenchRequest([1, 2], output_len=3, prompt_len=2), stream=False)
    assert seen[0]["stream"] is False and "stream_options" not in seen[0]
    assert (result.success, result.text, result.output_len, result.prompt_len) == (True, "abc", 3, 2)
    assert result.ttft == result.latency > 0 and result.itl == [] and result.tpot == 0.0 and not result.streamed
    chat = json.dumps({"choices": [{"message": {"role": "assistant", "content": "hi there"}}]}).encode()
    req = BenchRequest(None, output_len=8, messages=[{"role": "user", "content": "hello"}])
    result, _ = _run(chat, req, stream=False, count_tokens=lambda text: len(text.split()))
    assert (result.success, result.text, result.output_len) == (True, "hi there", 2)  # no usage: the tokenizer
    result, _ = _run(chat, req, stream=False)
    assert not result.success and "--tokenizer DIR" in result.error
    result, _ = _run(b'{"error": {"message": "bad"}}', req, status=400, stream=False)
    assert not result.success and result.error.startswith("RuntimeError: HTTP 400")
