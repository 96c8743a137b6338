"""Server load tracking (vLLM's ``--enable-server-load-tracking``): ``GET /load`` answers ``{"server_load": N}``,
the number of inference requests the server is serving now, for a load balancer that routes to the least loaded
replica.

A request counts from the moment it arrives until its response has been sent whole (a stream: its last event), or
until its client leaves; requests to the other routes (health, metrics, tokenization, ...) do not count. The count
is kept by an ASGI middleware around the app, so every inference route counts alike, including ``/invocations``.
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI

# The routes that run the model (and /invocations, which passes a request on to one of them).
INFERENCE_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/invocations",
    "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify", "/v1/classify", "/pooling",
    "/v1/pooling",
})


def route_path(scope: dict) -> str:
    """A request's path as the app's routes see it (without ``--root-path``'s prefix, when the path carries it)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


def install(app: FastAPI) -> None:
    """Count ``app``'s inference requests in flight and answer ``GET /load`` with the count."""
    app.state.server_load = 0

    async def load() -> dict[str, int]:
        return {"server_load": app.state.server_load}

    app.add_api_route("/load", load, methods=["GET"])
    app.add_middleware(_LoadCounter, state=app.state)  # type: ignore[arg-type]


class _LoadCounter:
    def __init__(self, app: Callable, state: object) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in INFERENCE_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.server_load += 1  # type: ignore[attr-defined]
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1  # type: ignore[attr-defined]
