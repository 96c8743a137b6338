"""One streamed OpenAI request (``/v1/completions`` or ``/v1/chat/completions``), timed chunk by chunk.

``send`` never raises for a failed request: it returns a ``RequestResult`` with ``success=False`` and the error,
so a benchmark counts failures instead of dying on the first one. Timings use ``time.perf_counter``:
TTFT = first chunk with content; ITL = the gaps between later content chunks; latency = last byte.

Output tokens come from the server's streamed ``usage`` (``stream_options.include_usage``); servers that do not
stream usage (llama.cpp's) are counted with ``count_tokens`` (a tokenizer) when given, else one token per content
chunk (what those servers send).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import httpx

from pagellm.bench.datasets import BenchRequest


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

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for one-token outputs)."""
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


@dataclass
class ClientOptions:
    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    close_connections: bool = False  # send `Connection: close` (llama-server drops reused streams under load)
    extra_body: dict[str, Any] = field(default_factory=dict)
    count_tokens: Callable[[str], int] | None = None


def request_body(req: BenchRequest, opts: ClientOptions) -> tuple[str, dict[str, Any]]:
    """The endpoint path and JSON body for ``req``."""
    body: dict[str, Any] = {"model": opts.model, "max_tokens": req.output_len, "temperature": opts.temperature,
                            "top_p": opts.top_p, "stream": True, "stream_options": {"include_usage": True}}
    if req.ignore_eos:
        body["ignore_eos"] = True
    body.update(opts.extra_body)
    if req.is_chat:
        return "/v1/chat/completions", {**body, "messages": req.messages}
    return "/v1/completions", {**body, "prompt": req.prompt}


def _chunk_text(chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        parts.append((delta.get("content") or "") if delta is not None else (choice.get("text") or ""))
    return "".join(parts)


async def send(http: httpx.AsyncClient, req: BenchRequest, opts: ClientOptions) -> RequestResult:
    path, body = request_body(req, opts)
    headers = {"Connection": "close"} if opts.close_connections else {}
    result = RequestResult(prompt_len=req.prompt_len or 0, start=time.perf_counter())
    last = result.start
    chunks = 0
    usage_tokens: int | None = None
    texts: list[str] = []
    try:
        async with http.stream("POST", path, json=body, headers=headers) as response:
            if response.status_code != 200:
                raw = await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {raw.decode(errors='replace')[:300]}")
            async for line in _sse_lines(response):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"].get("message", chunk["error"])))
                now = time.perf_counter()
                text = _chunk_text(chunk)
                if text:
                    if chunks == 0:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    chunks += 1
                    last = now
                    texts.append(text)
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.latency = time.perf_counter() - result.start
        return result
    result.latency = time.perf_counter() - result.start
    result.text = "".join(texts)
    result.output_len = _output_tokens(usage_tokens, result.text, chunks, opts)
    result.success = chunks > 0 or result.output_len > 0
    if not result.success:
        result.error = "the stream carried no tokens"
    return result


async def _sse_lines(response: httpx.Response) -> AsyncIterator[bytes]:
    """Lines of an SSE body split on b"\n" only: ``aiter_lines`` also splits on U+2028, U+0085 and friends, which
    servers may leave unescaped inside a JSON string (random token ids decode to anything)."""
    buffer = b""
    async for data in response.aiter_bytes():
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if buffer:
        yield buffer


def _output_tokens(usage_tokens: int | None, text: str, chunks: int, opts: ClientOptions) -> int:
    if usage_tokens is not None:
        return usage_tokens
    if opts.count_tokens is not None:
        return opts.count_tokens(text)
    return chunks


async def first_model(http: httpx.AsyncClient) -> str:
    """The first model the server lists (what to send when the user names none)."""
    response = await http.get("/v1/models")
    response.raise_for_status()
    data = response.json()["data"]
    if not data:
        raise ValueError("the server lists no models; pass --model")
    return data[0]["id"]
