"""What the route modules share: the API-key check, the session header, a body's size, and a whole (non-streamed)
reply that is cancelled, aborting its request, when the client goes away first."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable
from typing import Any, Optional

from fastapi import Depends, Request, Response
from fastapi.responses import JSONResponse

from pagellm.server.openai.errors import APIError
from pagellm.server.openai.serving_engine import INLINE_BYTES

logger = logging.getLogger(__name__)
SESSION_HEADER = "X-Session-ID"  # vLLM's: the session of a request whose body names none


def auth(api_key: Optional[str], x_api_key: bool = False) -> list[Any]:
    """The dependencies that guard a router: the key check when there is an API key (``Authorization: Bearer``;
    with ``x_api_key``, Anthropic's ``x-api-key`` header too)."""
    return [Depends(_key_check(api_key, x_api_key))] if api_key else []


def _key_check(api_key: str, x_api_key: bool) -> Any:
    expected = api_key.encode()
    how = "'x-api-key: YOUR_KEY' (or 'Authorization: Bearer YOUR_KEY')" if x_api_key else \
        "'Authorization: Bearer YOUR_KEY'"

    async def check(request: Request) -> None:
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        token = bearer.strip() if scheme.lower() == "bearer" else ""
        if x_api_key:
            token = request.headers.get("x-api-key", "").strip() or token
        if not token:
            raise APIError(f"You didn't provide an API key. Send it as {how}.", 401, code="invalid_api_key")
        if not hmac.compare_digest(token.encode(), expected):
            raise APIError("Incorrect API key provided.", 401, code="invalid_api_key")

    return check


def session_from_header(body: Any, raw: Request) -> None:
    """vLLM's ``X-Session-ID`` header names the request's session where its body does not."""
    header = raw.headers.get(SESSION_HEADER)
    if header and body.session_id is None:
        body.session_id = header[:256]


def body_size(raw: Request) -> int:
    """The request body's bytes (by its Content-Length; a body without one counts as large)."""
    length = raw.headers.get("content-length", "")
    return int(length) if length.isdigit() else INLINE_BYTES + 1


async def json_unless_disconnected(request: Request, work: Awaitable[Any]) -> Response:
    """Await ``work`` (a response model) unless the client disconnects first; then cancel it (aborting)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        logger.info("client disconnected; its request was aborted")
        return Response(status_code=499)
    return JSONResponse(task.result().model_dump(mode="json"))


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
