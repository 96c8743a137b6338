"""Middleware for the tests of ``pagellm serve --middleware`` (importable by name: tests/ is on the path)."""

from __future__ import annotations

from typing import Any, Callable


class StampClass:
    """A pure ASGI middleware: every HTTP response gets ``X-Stamp-Class``."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-stamp-class", b"yes")]
            await send(message)

        await self.app(scope, receive, stamped)


async def stamp_function(request: Any, call_next: Callable) -> Any:
    """An HTTP middleware function: every response gets ``X-Stamp-Function`` (the path it answered)."""
    response = await call_next(request)
    response.headers["X-Stamp-Function"] = request.url.path
    return response


NOT_MIDDLEWARE = 42
