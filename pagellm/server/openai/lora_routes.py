"""vLLM's runtime LoRA adapter routes (``pagellm serve --enable-lora --allow-runtime-lora-updating``):
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` checks the adapter against the model (a 400 that says what
does not fit) and serves it under its name from the next request on; ``POST /v1/unload_lora_adapter
{"lora_name"}`` stops serving it (404 when no adapter has that name). A name the server already answers to is a
400. Ids are never reused, so an id names one adapter directory for the engine's lifetime (the worker keeps an
unloaded adapter's weights until the server stops). These routes read paths on the server: give it an API key."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Optional

from fastapi import APIRouter
from pydantic import Field

from pagellm.lora import LoRARequest
from pagellm.server.openai.errors import APIError
from pagellm.server.openai.protocol import OpenAIModel
from pagellm.server.openai.serving_engine import EngineClient


class LoadLoRARequest(OpenAIModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(OpenAIModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None  # vLLM's body carries it; the name decides


def lora_router(engine: EngineClient, names: Sequence[str], loras: dict[str, LoRARequest],
                dependencies: list[Any]) -> APIRouter:
    """The two routes over ``loras``, the served adapters by name (the dict the request handlers read)."""
    router = APIRouter(prefix="/v1", dependencies=dependencies)
    ids = itertools.count(max((lora.lora_int_id for lora in loras.values()), default=0) + 1)

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> dict[str, str]:
        if body.lora_name in names or body.lora_name in loras:
            raise APIError(f"a model named {body.lora_name!r} is served already; unload it or pick another name", 400,
                           param="lora_name")
        lora = LoRARequest(body.lora_name, next(ids), body.lora_path)
        engine.check_lora(lora)  # ValueError (what does not fit) → 400
        loras[body.lora_name] = lora
        return {"status": "loaded", "lora_name": body.lora_name}

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> dict[str, str]:
        if loras.pop(body.lora_name, None) is None:
            raise APIError(f"no LoRA adapter named {body.lora_name!r} is served", 404, param="lora_name")
        return {"status": "unloaded", "lora_name": body.lora_name}

    return router
