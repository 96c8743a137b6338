"""HTTP middleware of the app: ``X-Request-Id`` headers (``--enable-request-id-headers``) and the operator's own
(``--middleware``, vLLM's flag).

``--middleware pkg.module:name`` (repeatable; ``pkg.module.name`` works too) names either an ASGI middleware class,
added with ``app.add_middleware`` (Starlette calls it with the app, as ``cls(app)``), or an ``async def (request,
call_next)`` function, added as FastAPI's ``@app.middleware("http")``; anything else, or a name that does not import,
stops the server before it starts with a message that says so. Each one added later wraps those added before it,
so the last one named sees a request first.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request, Response

from pagellm.plugins import import_object


def add_request_id_headers(app: FastAPI) -> None:
    """Every response carries ``X-Request-Id``: the request's own header when it sent one, else a new id (vLLM's
    ``--enable-request-id-headers``)."""

    @app.middleware("http")
    async def request_id_header(request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        return response


def add_user_middleware(app: FastAPI, names: Sequence[str]) -> None:
    """Add each middleware ``names`` names, in order."""
    for name in names:
        target = import_object(name, "--middleware")
        if inspect.isclass(target):
            app.add_middleware(target)
        elif inspect.iscoroutinefunction(target):
            app.middleware("http")(target)
        else:
            raise ValueError(f"--middleware {name}: give an ASGI middleware class or an async def (request, "
                             f"call_next) function, not {type(target).__name__}")
