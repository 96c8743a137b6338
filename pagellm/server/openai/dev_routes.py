"""The server's development routes, only with ``PAGELLM_SERVER_DEV_MODE=1`` (or vLLM's ``VLLM_SERVER_DEV_MODE=1``,
for a ported launch script), behind the API key when there is one. They run code by name on the workers, so they
must not face untrusted clients.

``POST /collective_rpc {"method", "args", "kwargs", "timeout"}`` (vLLM's route, what an RL framework's weight sync
calls over HTTP): the workers' method ``method`` (one of theirs, or of ``--worker-extension-cls``) on every rank,
``{"results": [...]}`` in rank order. A result JSON can carry (null, a boolean, a finite number, a string, a list or
an object of them) comes back as it is, anything else as its ``str()`` (vLLM's route passes only null, lists and
objects through, so its numbers and booleans come back as strings). A method the workers do not have is a 400 that
names it; ``timeout`` (seconds) bounds the wait for the ranks.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from fastapi import APIRouter
from pydantic import Field

from pagellm.server.openai.protocol import OpenAIModel
from pagellm.server.openai.serving_engine import EngineClient


class CollectiveRpcRequest(OpenAIModel):
    method: str = Field(min_length=1)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: Optional[float] = Field(default=None, gt=0)


def dev_router(engine: EngineClient, dependencies: list[Any]) -> APIRouter:
    router = APIRouter(dependencies=dependencies)

    @router.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRpcRequest) -> dict[str, list[Any]]:
        results = await engine.collective_rpc(body.method, body.timeout, tuple(body.args), body.kwargs)
        return {"results": [_as_json(result) for result in results]}

    return router


def _as_json(value: Any) -> Any:
    """``value`` where JSON carries it as it is (finite numbers only), else its ``str()``."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return str(value)
    return value
