"""The FastAPI app: OpenAI routes under ``/v1`` (completions, chat and vLLM's batch chat, embeddings, models,
responses), Anthropic's ``/v1/messages`` (``server/anthropic/``), vLLM's ``/score`` and ``/rerank`` (also under
``/v1``; ``/v2/rerank``) and ``/generative_scoring``, plus ``/health``, ``/version``, ``/stats``,
``/kv_event_sources``, ``/tokenize``, ``/detokenize``, ``/start_profile``, ``/stop_profile`` and
``/reset_prefix_cache``, SageMaker's ``/ping`` and ``/invocations`` (``sagemaker.py``), ``/load`` with
``server_load_tracking`` (``server_load.py``), and (given an ``Observability``) ``/metrics``, ``/dashboard`` and
trace-context propagation; with ``PAGELLM_SERVER_DEV_MODE=1``, ``/collective_rpc`` (``dev_routes.py``).

Contract:
- ``build_app(engine, model_names, api_key)`` builds the app over an ``EngineClient``; it starts nothing. With
  ``tool_parser`` (a name in ``tool_parsers.PARSERS``) chat requests may leave ``tool_choice`` to the model ("auto");
  with ``reasoning_parser`` (``reasoning.PARSERS``) chat replies carry a reasoning model's thinking apart.
- With ``api_key`` every ``/v1`` route (and ``/score``, ``/rerank``) needs ``Authorization: Bearer <key>``, else 401
  in OpenAI's error shape.
- ``POST /start_profile`` starts the engine core's torch profiler and ``POST /stop_profile`` stops it, answering
  ``{"files": [trace, summary]}`` (metrics/profiler.py): 400 when the server has no ``--profiler-dir``, 409 when a
  profile records already (start) or none does (stop). They write files on the server, so ``api_key`` guards them
  as it does ``/v1``.
- ``POST /reset_prefix_cache`` forgets every cached block (vLLM's route, for benchmarks that must start cold):
  409 while requests hold blocks; guarded by ``api_key`` as the profile routes are.
- ``GET /health`` is 200 while the engine core lives and 503 once it is dead; ``GET /stats`` is the engine's
  latest ``SchedulerStats`` with every field present (running/waiting requests, KV-cache usage, ...).
- A large request's preparation (validation, chat template, tokenization, grammar compilation: ``prepare``) runs on
  one worker thread, not on the event loop, so a long prompt's tokenization does not stall the streams being sent
  (``serving_engine.prepared``).
- A client that goes away loses its requests: a stream's generator is cancelled by the server on disconnect, and a
  non-streamed request is cancelled by a watcher on the connection; either way the engine aborts the request and
  frees its KV blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional

import msgspec
from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.convertors import Convertor, register_url_convertor

import pagellm
from pagellm import envs
from pagellm.lora import LoRARequest
from pagellm.server.observability import Observability
from pagellm.server.observability import install as install_observability
from pagellm.server.options import Cors
from pagellm.server.openai import sagemaker, server_load
from pagellm.server.openai.errors import APIError, install_error_handlers
from pagellm.server.openai.dev_routes import dev_router
from pagellm.server.openai.lora_routes import lora_router
from pagellm.server.openai.middleware import add_request_id_headers, add_user_middleware
from pagellm.server.openai.protocol import ChatCompletionRequest, CompletionRequest, RequestDefaults
from pagellm.server.openai.replies import ModelCard, ModelList
from pagellm.server.openai.chat_images import fetch_images
from pagellm.server.openai.serving_chat import OpenAIServingChat
from pagellm.server.openai.serving_chat_batch import BatchChatCompletionRequest, OpenAIServingChatBatch
from pagellm.server.openai.serving_completion import OpenAIServingCompletion
from pagellm.server.openai.responses_protocol import ResponseObject, ResponsesRequest
from pagellm.server.openai.serving_classification import (ClassificationRequest, OpenAIServingClassification,
                                                          OpenAIServingPooling, PoolingRequest)
from pagellm.server.openai.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from pagellm.server.openai.serving_generative_scoring import (GenerativeScoringRequest,
                                                              OpenAIServingGenerativeScoring)
from pagellm.server.openai.serving_score import OpenAIServingScore, RerankRequest, ScoreRequest
from pagellm.server.openai.serving_responses import OpenAIServingResponses
from pagellm.server.openai.route_utils import auth, body_size, json_unless_disconnected, session_from_header
from pagellm.server.openai.serving_engine import EngineClient, OpenAIServing, prepared
from pagellm.server.openai.sse import EventStream, sse_response
from pagellm.server.openai import tokenization


class _ModelId(Convertor):
    """A model name in a path: anything but empty (served names may hold slashes; ``/v1/models/`` stays the
    trailing-slash redirect to the list)."""

    regex = ".+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("model_id", _ModelId())


def build_app(engine: EngineClient, model_names: Sequence[str], api_key: Optional[str] = None,
              model_root: Optional[str] = None, observability: Optional[Observability] = None,
              cors: Optional[Cors] = None, tool_parser: Optional[str] = None,
              reasoning_parser: Optional[str] = None, loras: Optional[dict[str, LoRARequest]] = None,
              runtime_lora_updating: bool = False, defaults: Optional[RequestDefaults] = None,
              request_id_headers: bool = False, server_load_tracking: bool = False, fastapi_docs: bool = True,
              middleware: Sequence[str] = (), tokenizer_info: bool = False, tokens_only: bool = False,
              scale_out: bool = False) -> FastAPI:
    if not model_names:
        raise ValueError("give at least one served model name")
    docs = {} if fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pagellm", version=pagellm.__version__, **docs)  # type: ignore[arg-type]
    install_error_handlers(app)
    if cors is not None:
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                           allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)
    served = _Served(model_names, model_root, loras if loras is not None else {})  # shared with the caller
    from pagellm.server.anthropic.routes import messages_router
    from pagellm.server.openai.scale_out_routes import install_scale_out

    chat = None if tokens_only else \
        OpenAIServingChat(engine, served.names, tool_parser, reasoning_parser, served.loras, defaults)
    responses = OpenAIServingResponses(chat) if chat is not None else None
    install_scale_out(app, engine, served, api_key, defaults, chat, responses, reasoning_parser,
                      "tokens_only" if tokens_only else "on" if scale_out else "off")
    if chat is not None and responses is not None:  # vLLM's --tokens-only: the tokens-in, tokens-out API alone
        app.include_router(_v1_router(engine, served, api_key, chat, defaults))
        app.include_router(_responses_router(responses, api_key))
        app.include_router(messages_router(chat, api_key, defaults))  # Anthropic's Messages API
        app.include_router(_score_router(engine, served, api_key))
    if runtime_lora_updating:
        app.include_router(lora_router(engine, served.names, served.loras, auth(api_key)))
    app.include_router(_admin_router(engine, served, tokenizer_info, defaults))
    app.include_router(_operations_router(engine, api_key))
    app.include_router(_pause_router(engine, api_key))
    if envs.server_dev_mode():
        app.include_router(dev_router(engine, auth(api_key)))
    if observability is not None:
        install_observability(app, observability)
    if request_id_headers:
        add_request_id_headers(app)
    add_user_middleware(app, middleware)
    if not tokens_only:
        sagemaker.install(app, engine)
    if server_load_tracking:
        server_load.install(app)
    return app


@dataclass(frozen=True)
class _Served:
    """What the server answers to: its model names, where the model came from, and LoRA adapters by name."""

    names: Sequence[str]
    root: Optional[str]
    loras: dict[str, LoRARequest]


def _v1_router(engine: EngineClient, served: _Served, api_key: Optional[str], chat: OpenAIServingChat,
               defaults: Optional[RequestDefaults]) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=auth(api_key))
    completion = OpenAIServingCompletion(engine, served.names, served.loras, defaults)
    embedding = OpenAIServingEmbedding(engine, served.names, served.loras)
    max_model_len = completion.max_model_len

    @router.get("/models")
    async def list_models() -> ModelList:
        base = [ModelCard(id=name, root=served.root, max_model_len=max_model_len) for name in served.names]
        return ModelList(data=base + [ModelCard(id=name, root=lora.lora_path, parent=served.names[0],
                                                max_model_len=max_model_len) for name, lora in served.loras.items()])

    @router.get("/models/{model_id:model_id}")
    async def retrieve_model(model_id: str) -> ModelCard:  # OpenAI's GET /v1/models/{model}
        cards = (await list_models()).data
        for card in cards:
            if card.id == model_id:
                return card
        raise APIError(f"The model `{model_id}` does not exist (this server serves "
                       f"{', '.join(c.id for c in cards)})", 404, param="model", code="model_not_found")

    @router.post("/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        session_from_header(body, raw)
        job = await prepared(completion.prepare, body, body_size(raw))
        if body.stream:
            return sse_response(completion.stream(job), defaults)
        return await json_unless_disconnected(raw, completion.create(job))

    @router.post("/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        job = await prepared(embedding.prepare, body, body_size(raw))
        return await json_unless_disconnected(raw, embedding.create(job))

    @router.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        session_from_header(body, raw)
        await fetch_images(body, chat.engine)
        job = await prepared(chat.prepare, body, body_size(raw))
        if body.stream:
            return sse_response(chat.stream(job), defaults)
        return await json_unless_disconnected(raw, chat.create(job))

    batch = OpenAIServingChatBatch(chat)

    @router.post("/chat/completions/batch")
    async def create_batch_chat_completion(body: BatchChatCompletionRequest, raw: Request) -> Response:
        session_from_header(body, raw)
        job = await prepared(batch.prepare, body, body_size(raw))
        return await json_unless_disconnected(raw, batch.create(job))

    return router


def _score_router(engine: EngineClient, served: _Served, api_key: Optional[str]) -> APIRouter:
    """vLLM's scoring APIs (``serving_score.py``): ``/score`` and ``/rerank``, also under ``/v1``, and
    ``/v2/rerank`` (Cohere's path); ``/classify`` and ``/pooling`` (``serving_classification.py``), also under
    ``/v1``; and ``/generative_scoring`` (``serving_generative_scoring.py``: label tokens' next-token odds)."""
    router = APIRouter(dependencies=auth(api_key))
    scoring = OpenAIServingScore(engine, served.names, served.loras)
    classification = OpenAIServingClassification(engine, served.names, served.loras)

    async def classify(body: ClassificationRequest, raw: Request) -> Response:
        job = await prepared(classification.prepare, body, body_size(raw))
        return await json_unless_disconnected(raw, classification.create(job))

    for path in ("/classify", "/v1/classify"):
        router.add_api_route(path, classify, methods=["POST"])
    pooling = OpenAIServingPooling(engine, served.names, served.loras)

    async def pool(body: PoolingRequest, raw: Request) -> Response:
        job = await prepared(pooling.prepare, body, body_size(raw))
        return await json_unless_disconnected(raw, pooling.create(job))

    for path in ("/pooling", "/v1/pooling"):
        router.add_api_route(path, pool, methods=["POST"])

    async def score(body: ScoreRequest, raw: Request) -> Response:
        job = await prepared(scoring.prepare, body, body_size(raw))
        return await json_unless_disconnected(raw, scoring.score(job))

    async def rerank(body: RerankRequest, raw: Request) -> Response:
        job = await prepared(scoring.prepare, body, body_size(raw))
        return await json_unless_disconnected(raw, scoring.rerank(job))

    for path in ("/score", "/v1/score"):
        router.add_api_route(path, score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        router.add_api_route(path, rerank, methods=["POST"])
    generative = OpenAIServingGenerativeScoring(engine, served.names, served.loras)

    @router.post("/generative_scoring")
    async def generative_scoring(body: GenerativeScoringRequest, raw: Request) -> Response:
        job = await prepared(generative.prepare, body, body_size(raw))
        return await json_unless_disconnected(raw, generative.create(job))

    return router


def _responses_router(responses: OpenAIServingResponses, api_key: Optional[str]) -> APIRouter:
    """OpenAI's Responses API (``serving_responses.py``)."""
    router = APIRouter(prefix="/v1/responses", dependencies=auth(api_key))

    @router.post("")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        session_from_header(body, raw)
        await fetch_images(body, responses.chat.engine)
        job = await prepared(responses.prepare, body, body_size(raw))
        if body.background:
            return JSONResponse(responses.start_background(job).model_dump(mode="json"))
        if body.stream:
            return EventStream(responses.stream(job))
        return await json_unless_disconnected(raw, responses.create(job))

    @router.get("/{response_id}")
    async def get_response(response_id: str) -> ResponseObject:
        return responses.get(response_id)

    @router.get("/{response_id}/input_items")
    async def list_input_items(response_id: str, after: Optional[str] = None, limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
        return responses.input_items(response_id, after, limit, order)

    @router.delete("/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)

    @router.post("/{response_id}/cancel")
    async def cancel_response(response_id: str) -> ResponseObject:
        return await responses.cancel(response_id)

    return router


def _admin_router(engine: EngineClient, served: _Served, tokenizer_info: bool = False,
                  defaults: Optional[RequestDefaults] = None) -> APIRouter:
    router = APIRouter()
    serving = OpenAIServing(engine, served.names, served.loras, defaults)  # /tokenize takes an adapter's name too

    @router.get("/health")
    async def health() -> Response:
        await engine.check_health()  # EngineDeadError → 503
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagellm.__version__}

    @router.get("/kv_event_sources")
    async def kv_event_sources() -> dict[str, Any]:  # vLLM's: each data-parallel rank's KV-event publisher
        hidden = {"data_parallel_rank"}  # in the key already (vLLM's config has no such field)
        return {str(rank): {k: v for k, v in asdict(config).items() if k not in hidden}
                for rank, config in engine.kv_event_sources().items()}

    @router.get("/stats")
    async def stats() -> dict[str, Any]:
        current = await engine.get_stats()
        return {name: msgspec.to_builtins(getattr(current, name)) for name in current.__struct_fields__}

    router.include_router(tokenization.tokenizer_router(serving, tokenizer_info))
    return router


def _operations_router(engine: EngineClient, api_key: Optional[str]) -> APIRouter:
    """Routes that act on the engine (profiling, the prefix cache, sleep mode, weights): behind the API key when
    there is one."""
    router = APIRouter(dependencies=auth(api_key))

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        if not await engine.reset_prefix_cache():
            raise APIError("requests hold KV blocks: the prefix cache can be reset only while no request runs", 409)
        return {"reset": True}

    @router.post("/start_profile")
    async def start_profile() -> dict[str, str]:
        if not await engine.start_profile():  # a ValueError (profiling off) → 400
            raise APIError("a profile is recording already: POST /stop_profile ends it", 409)
        return {"status": "recording"}

    @router.post("/stop_profile")
    async def stop_profile() -> dict[str, list[str]]:
        files = await engine.stop_profile()
        if not files:
            raise APIError("no profile is recording: POST /start_profile starts one", 409)
        return {"files": files}

    @router.post("/sleep")
    async def sleep(level: int = Query(1)) -> dict[str, bool]:  # vLLM's sleep mode (--enable-sleep-mode)
        await engine.sleep(level)
        return {"is_sleeping": True}

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: dict[str, Any]) -> dict[str, Any]:  # SGLang's route
        path = body.get("model_path")
        if path is not None and (not isinstance(path, str) or not path):
            raise APIError("model_path must be a checkpoint folder or .gguf file (omit it to read the served model's "
                           "own weights again)", 400, param="model_path")
        await engine.update_weights_from_disk(path)
        return {"success": True, "message": f"weights updated from {path or 'the served model'}"}

    @router.post("/wake_up")
    async def wake_up(tags: Optional[list[str]] = Query(None)) -> dict[str, bool]:  # vLLM's ?tags=weights
        await engine.wake_up(tags)
        return {"is_sleeping": await engine.is_sleeping()}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await engine.is_sleeping()}

    return router


def _pause_router(engine: EngineClient, api_key: Optional[str]) -> APIRouter:
    """vLLM's pausing routes (an RL loop's weight sync), behind the API key when there is one."""
    router = APIRouter(dependencies=auth(api_key))

    @router.post("/pause")  # vLLM's: new requests wait; those in flight end (abort), finish (wait) or freeze (keep)
    async def pause(mode: str = Query("abort"), clear_cache: bool = Query(True)) -> dict[str, bool]:
        await engine.pause_generation(mode=mode, clear_cache=clear_cache)  # a bad mode's ValueError → 400
        return {"is_paused": True}

    @router.post("/resume")
    async def resume() -> dict[str, bool]:
        await engine.resume_generation()
        return {"is_paused": False}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": await engine.is_paused()}

    return router
