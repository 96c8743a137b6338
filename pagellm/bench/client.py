"""One streamed OpenAI request (``/v1/completions`` or ``/v1/chat/completions``), timed chunk by chunk.

``connect`` opens a ``Server`` (an aiohttp session bound to a base URL); ``send`` never raises for a failed
request: it returns a ``RequestResult`` with ``success=False`` and the error (HTTP status, an in-stream ``{"error":
...}`` event, a dropped connection, a stream without tokens), so a benchmark counts failures instead of dying on the
first one. Timings use ``time.perf_counter``, taken once per network read: TTFT = the first chunk with content
(when tokens came but no text, as a tiny model's broken UTF-8 may, the first chunk with a choice, which is then
the finishing one); ITL = the gaps between later content chunks; latency = ``data: [DONE]`` or, without it, the end
of the body.

The client runs on the cores it measures, so each streamed chunk must cost little: aiohttp's C HTTP parser, one
Python pass per network read (``SseLines`` splits at b"\\n" only: U+2028 and friends may sit unescaped inside a
JSON string) and msgspec for the JSON.

Output tokens come from the server's streamed ``usage`` (``stream_options.include_usage``); servers that do not
stream usage (llama.cpp's) are counted with ``count_tokens`` (a tokenizer) when given, else one token per content
chunk (what those servers send).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import aiohttp
import msgspec

from pagellm.bench.datasets import BenchRequest

_decode = msgspec.json.Decoder().decode


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, whole request
    itl: list[float] = field(default_factory=list)  # seconds between content chunks after the first
    start: float = 0.0  # perf_counter at send
    text: str = ""
    streamed: bool = True  # False: one JSON response (TTFT is then the whole request; no TPOT, no ITL)

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for one-token outputs and unstreamed requests)."""
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 and self.streamed else 0.0


@dataclass
class ClientOptions:
    model: str
    temperature: float = 1.0
    close_connections: bool = False  # send `Connection: close` (llama-server drops reused streams under load)
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every body last (sampling flags too)
    count_tokens: Callable[[str], int] | None = None
    stream: bool = True  # False: ask for one JSON response per request


@dataclass
class Server:
    """An open HTTP session to one OpenAI-compatible server; request paths are appended to ``base_url``."""
    session: aiohttp.ClientSession
    base_url: str


@asynccontextmanager
async def connect(base_url: str, max_connections: int = 100, close_connections: bool = False,
                  api_key: str | None = None, headers: dict[str, str] | None = None) -> AsyncIterator[Server]:
    """A ``Server`` with at most ``max_connections`` sockets (0: no cap), no keep-alive if ``close_connections``,
    every request carrying ``headers`` and ``Authorization: Bearer api_key`` when a key is given (a header named
    Authorization in ``headers`` wins).

    No overall deadline: an hour per read and for a free connection, 30 s to connect."""
    connector = aiohttp.TCPConnector(limit=max_connections, force_close=close_connections)
    timeout = aiohttp.ClientTimeout(total=None, connect=3600, sock_connect=30, sock_read=3600)
    sent = dict(headers or {})
    if api_key and not any(name.lower() == "authorization" for name in sent):
        sent["Authorization"] = f"Bearer {api_key}"
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=sent or None) as session:
        yield Server(session, base_url.rstrip("/"))


def request_body(req: BenchRequest, opts: ClientOptions) -> tuple[str, dict[str, Any]]:
    """The endpoint path and JSON body for ``req``."""
    body: dict[str, Any] = {"model": opts.model, "max_tokens": req.output_len, "temperature": opts.temperature,
                            "stream": opts.stream}
    if opts.stream:
        body["stream_options"] = {"include_usage": True}
    if req.ignore_eos:
        body["ignore_eos"] = True
    body.update(opts.extra_body)
    if req.is_chat:
        return "/v1/chat/completions", {**body, "messages": req.messages}
    return "/v1/completions", {**body, "prompt": req.prompt}


class SseLines:
    """Reassembles SSE lines from network reads; splits at b"\\n" only (``str.splitlines`` would also split at
    U+2028, U+0085 and friends, which servers may leave unescaped inside a JSON string) and drops a trailing \\r."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The lines completed by ``data``; an unfinished last line waits for the next read."""
        *lines, self._tail = (self._tail + data).split(b"\n") if self._tail else data.split(b"\n")
        return [line[:-1] if line.endswith(b"\r") else line for line in lines]

    def close(self) -> list[bytes]:
        """The unfinished last line (a body may end without a newline)."""
        tail, self._tail = self._tail, b""
        return [tail.rstrip(b"\r")] if tail else []


def _chunk_text(chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        parts.append((delta.get("content") or "") if delta is not None else (choice.get("text") or ""))
    return "".join(parts)


class _Stream:
    """The events of one response: timings into ``result``, the text pieces, the streamed usage."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.last = result.start
        self.chunks = 0
        self.usage_tokens: int | None = None
        self.texts: list[str] = []
        self.first_choice: float | None = None  # when the first chunk with a choice (text or not) arrived

    def events(self, lines: list[bytes], now: float) -> bool:
        """Handle the lines of one read (received at ``now``); True once ``data: [DONE]`` arrived."""
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return True
            self._chunk(_decode(payload), now)
        return False

    def _chunk(self, chunk: Any, now: float) -> None:
        if not isinstance(chunk, dict):
            raise ValueError(f"a stream event is not a JSON object: {chunk!r:.100}")
        if "error" in chunk:
            error = chunk["error"]
            raise RuntimeError(str(error.get("message", error) if isinstance(error, dict) else error))
        if self.first_choice is None and chunk.get("choices"):
            self.first_choice = now
        text = _chunk_text(chunk)
        if text:
            if self.chunks == 0:
                self.result.ttft = now - self.result.start
            else:
                self.result.itl.append(now - self.last)
            self.chunks += 1
            self.last = now
            self.texts.append(text)
        usage = chunk.get("usage")
        if usage:
            self.usage_tokens = usage.get("completion_tokens", self.usage_tokens)
            self.result.prompt_len = usage.get("prompt_tokens") or self.result.prompt_len


async def _receive(server: Server, path: str, body: dict[str, Any], headers: dict[str, str] | None,
                   stream: _Stream) -> None:
    async with server.session.post(server.base_url + path, json=body, headers=headers) as response:
        if response.status != 200:
            raw = await response.read()
            raise RuntimeError(f"HTTP {response.status}: {raw.decode(errors='replace')[:300]}")
        lines = SseLines()
        async for data in response.content.iter_any():
            if stream.events(lines.feed(data), time.perf_counter()):
                return
        stream.events(lines.close(), time.perf_counter())


# What a request may fail with: it is then counted as failed, with the error, instead of raised.
_REQUEST_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError)


def _failed(result: RequestResult, exc: Exception) -> RequestResult:
    result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - result.start
    return result


async def send(server: Server, req: BenchRequest, opts: ClientOptions) -> RequestResult:
    path, body = request_body(req, opts)
    headers = {"Connection": "close"} if opts.close_connections else None
    result = RequestResult(prompt_len=req.prompt_len or 0, start=time.perf_counter(), streamed=opts.stream)
    if not opts.stream:
        return await _send_whole(server, path, body, headers, result, opts)
    stream = _Stream(result)
    try:
        await _receive(server, path, body, headers, stream)
    except _REQUEST_ERRORS as exc:
        return _failed(result, exc)
    result.latency = time.perf_counter() - result.start
    result.text = "".join(stream.texts)
    result.output_len = _output_tokens(stream.usage_tokens, result.text, stream.chunks, opts)
    result.success = stream.chunks > 0 or result.output_len > 0
    if stream.chunks == 0 and result.success:  # tokens with no text (a UTF-8 sequence the server never finished)
        result.ttft = result.latency if stream.first_choice is None else stream.first_choice - result.start
    if not result.success:
        result.error = "the stream carried no tokens"
    return result


async def _send_whole(server: Server, path: str, body: dict[str, Any], headers: dict[str, str] | None,
                      result: RequestResult, opts: ClientOptions) -> RequestResult:
    """An unstreamed request: its whole answer at once, TTFT = latency (as ``vllm bench serve --no-stream``)."""
    try:
        async with server.session.post(server.base_url + path, json=body, headers=headers) as response:
            raw = await response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {raw.decode(errors='replace')[:300]}")
        answer = _decode(raw)
        if not isinstance(answer, dict) or "error" in answer:
            raise RuntimeError(f"not a completion: {raw.decode(errors='replace')[:300]}")
    except _REQUEST_ERRORS as exc:
        return _failed(result, exc)
    result.latency = result.ttft = time.perf_counter() - result.start
    choice = (answer.get("choices") or [{}])[0]
    result.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
    usage = answer.get("usage") or {}
    result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
    tokens = usage.get("completion_tokens")
    if tokens is None and opts.count_tokens is not None:
        tokens = opts.count_tokens(result.text)
    result.output_len = tokens or 0
    result.success = result.output_len > 0
    if not result.success:
        result.error = "the response carried no usage and no tokens (--tokenizer DIR counts its text)" \
            if tokens is None else "the response carried no tokens"
    return result


def _output_tokens(usage_tokens: int | None, text: str, chunks: int, opts: ClientOptions) -> int:
    if usage_tokens is not None:
        return usage_tokens
    if opts.count_tokens is not None:
        return opts.count_tokens(text)
    return chunks


async def first_model(server: Server) -> str:
    """The first model the server lists (what to send when the user names none)."""
    return first_listed(await wait_ready(server, 0))


def first_listed(listing: bytes) -> str:
    """The first model id of a ``GET /v1/models`` answer."""
    data = msgspec.json.decode(listing)["data"]
    if not data:
        raise ValueError("the server lists no models; pass --model")
    return data[0]["id"]


async def wait_ready(server: Server, timeout_s: float, poll_s: float = 0.5) -> bytes:
    """``GET /v1/models``'s answer once it is a 200 (the model list), trying for ``timeout_s`` seconds (0: once). A
    ValueError says why it never came: no answer at the address, or the last HTTP status (a 401 at once: a key
    will not appear)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, raw = await _get_models(server)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            why = f"nothing answers at {server.base_url} ({type(exc).__name__}: {exc}); is the server up?"
        else:
            if status == 200:
                return raw
            why = f"GET /v1/models: HTTP {status}: {raw.decode(errors='replace')[:300]}" \
                + (" (pass --api-key)" if status == 401 else "")
            if status == 401:
                raise ValueError(why)
        if time.monotonic() + poll_s > deadline:
            waited = f" after waiting {timeout_s:g} s" if timeout_s > 0 else " (--ready-check-timeout S waits for it)"
            raise ValueError(f"the server is not ready{waited}: {why}")
        await asyncio.sleep(poll_s)


async def profile(server: Server, action: str) -> dict[str, Any]:
    """``POST /start_profile`` or ``/stop_profile`` (``action``) on a pagellm or vLLM server with profiling on; its
    JSON answer (vLLM's is empty). A ValueError with the server's message when it refuses."""
    async with server.session.post(f"{server.base_url}/{action}", timeout=aiohttp.ClientTimeout(total=600)) as response:
        raw = await response.read()
        if response.status != 200:
            raise ValueError(f"POST /{action}: HTTP {response.status}: {raw.decode(errors='replace')[:300]}"
                             + (" (the server profiles only when started with a profiler folder: pagellm serve "
                                "--profiler-dir DIR; vllm serve --profiler-config with a torch_profiler_dir)"
                                if response.status in (400, 404) else ""))
    try:
        answer = msgspec.json.decode(raw) if raw.strip() else {}
    except msgspec.DecodeError:
        return {}
    return answer if isinstance(answer, dict) else {}


async def _get_models(server: Server) -> tuple[int, bytes]:
    async with server.session.get(server.base_url + "/v1/models",
                                  timeout=aiohttp.ClientTimeout(total=30)) as response:
        return response.status, await response.read()
