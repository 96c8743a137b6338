"""HTTP middleware of the app: ``X-Request-Id`` headers (``--enable-request-id-headers``) and the operator's own
(``--middleware``, vLLM's flag).

``--middleware pkg.module:name`` (repeatable; ``pkg.module.name`` works too) names either an ASGI middleware class,
added with ``app.add_middleware`` (Starlette calls it with the app, as ``cls(app)``), or an ``async def (request,
call_next)`` function, added as FastAPI's ``@app.middleware("http")``; anything else, or a name that does not import,
stops the server before it starts with a message that says so. Each one added later wraps those added before it,
so the last one named sees a request first.
"""

from __future__ import annotations

import importlib
import inspect
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request, Response


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
        target = _import(name)
        if inspect.isclass(target):
            app.add_middleware(target)
        elif inspect.iscoroutinefunction(target):
            app.middleware("http")(target)
        else:
            raise ValueError(f"--middleware {name}: give an ASGI middleware class or an async def (request, "
                             f"call_next) function, not {type(target).__name__}")


def _import(name: str) -> Any:
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"--middleware {name!r}: name it as package.module:name")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--middleware {name!r} cannot be imported ({type(exc).__name__}: {exc}); it must be "
                         "importable by the server (on PYTHONPATH)") from None
