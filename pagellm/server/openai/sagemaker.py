"""Amazon SageMaker's serving contract, as vLLM serves it: ``GET``/``POST /ping`` (the container's health check) and
``POST /invocations`` (every inference request, of whatever kind, on one path).

Contract:
- ``/ping`` answers as ``/health`` does: 200 while the engine core lives, 503 once it is dead.
- ``/invocations`` reads the JSON body's keys and passes the request on, body and headers unchanged, to the route
  of its kind: ``messages`` → ``/v1/chat/completions``; ``prompt`` or ``prompt_embeds`` → ``/v1/completions``;
  ``input`` → ``/v1/embeddings`` (``/classify`` on a sequence classifier); ``text_1`` → ``/score``; ``query`` →
  ``/rerank``. That route validates, authenticates (``--api-key``), streams and fails as it always does. A body
  that is not a JSON object of one of these kinds is a 400 that lists them.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from pagellm.server.openai.errors import error_body
from pagellm.server.openai.server_load import route_path
from pagellm.server.openai.serving_engine import EngineClient

_KINDS = ("chat (messages), completion (prompt or prompt_embeds), embedding or classification (input), score "
          "(text_1, text_2) or rerank (query, documents)")


def route_for(body: Any, classifier: bool = False) -> Optional[str]:
    """The route that serves an invocation body, or None when it is of no kind served here."""
    if not isinstance(body, dict):
        return None
    if "messages" in body:
        return "/v1/chat/completions"
    if "prompt" in body or "prompt_embeds" in body:
        return "/v1/completions"
    if "input" in body:
        return "/classify" if classifier else "/v1/embeddings"
    if "text_1" in body:
        return "/score"
    if "query" in body:
        return "/rerank"
    return None


def install(app: FastAPI, engine: EngineClient) -> None:
    """Add ``/ping`` and ``/invocations`` to ``app``."""

    async def ping() -> Response:
        await engine.check_health()  # EngineDeadError → 503
        return Response(status_code=200)

    app.add_api_route("/ping", ping, methods=["GET", "POST"])
    app.add_middleware(_Invocations, classifier=bool(engine.runtime.labels))  # type: ignore[arg-type]


class _Invocations:
    """ASGI middleware: ``POST /invocations`` goes on to the route its body's kind names (the body replayed)."""

    def __init__(self, app: Callable, classifier: bool) -> None:
        self.app = app
        self.classifier = classifier

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) != "/invocations":
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            path = route_for(json.loads(body), self.classifier)
        except ValueError:  # not JSON
            path = None
        if path is None:
            response = JSONResponse(error_body(f"an invocation must be a JSON object of one of the kinds {_KINDS}"),
                                    400)
            await response(scope, receive, send)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # then whatever the client does next (a disconnect)
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        full = scope["path"][:len(scope["path"]) - len("/invocations")] + path  # under the same prefix, if any
        await self.app({**scope, "path": full, "raw_path": full.encode()}, replay, send)
