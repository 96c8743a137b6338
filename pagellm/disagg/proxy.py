"""``pagellm disagg-proxy``: one OpenAI-compatible endpoint in front of a prefill server and a decode server that
share a KV store (``--kv-transfer-config``, ``kv_producer`` and ``kv_consumer``; see ``connector.py``).

Contract:
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: the request first goes to the prefill server as a
  one-token, one-sample, unstreamed request (its prompt's full blocks land in the store), then unchanged to the
  decode server, which loads those blocks instead of computing them and generates; the decode server's answer
  (streamed or whole) is the client's. A refusal of the prefill server (4xx/5xx) is returned as it is, and the
  decode server is not asked.
- ``GET /v1/models`` and ``GET /health`` answer from the decode server. The client's ``Authorization`` header goes
  to both servers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

# Fields a one-token prefill must not carry (they ask for more than one token or sample)
_NOT_FOR_PREFILL = ("stream", "stream_options", "n", "best_of", "min_tokens", "logprobs", "top_logprobs", "echo")


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The request the prefill server runs: the same prompt and settings, one token, one sample, not streamed."""
    first = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    first["max_tokens"] = 1
    if chat and "max_completion_tokens" in body:
        first["max_completion_tokens"] = 1
    return first


def build_proxy(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> FastAPI:
    app = FastAPI(title="pagellm disagg-proxy", docs_url=None, redoc_url=None)
    client = httpx.AsyncClient(timeout=timeout_s)

    def headers(request: Request) -> dict[str, str]:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    async def route(request: Request, path: str, chat: bool) -> Response:
        body = await request.json()
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the request body must be a JSON object",
                                           "type": "invalid_request_error", "param": None, "code": None}}, 400)
        first = await client.post(f"{prefill_url}{path}", json=prefill_body(body, chat), headers=headers(request))
        if first.status_code != 200:
            return Response(first.content, first.status_code, media_type="application/json")
        if body.get("stream"):
            upstream = client.build_request("POST", f"{decode_url}{path}", json=body, headers=headers(request))
            reply = await client.send(upstream, stream=True)
            return StreamingResponse(_relay(reply), reply.status_code, media_type="text/event-stream")
        reply = await client.post(f"{decode_url}{path}", json=body, headers=headers(request))
        return Response(reply.content, reply.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        reply = await client.get(f"{decode_url}/v1/models", headers=headers(request))
        return Response(reply.content, reply.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        prefill, decode = await client.get(f"{prefill_url}/health"), await client.get(f"{decode_url}/health")
        return Response(status_code=200 if prefill.status_code == decode.status_code == 200 else 503)

    return app


async def _relay(reply: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in reply.aiter_raw():
            yield chunk
    finally:
        await reply.aclose()


def run_proxy(prefill_url: str, decode_url: str, host: str, port: int) -> int:
    import uvicorn

    uvicorn.run(build_proxy(prefill_url.rstrip("/"), decode_url.rstrip("/")), host=host, port=port,
                log_level="warning")
    return 0
