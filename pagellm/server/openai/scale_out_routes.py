"""vLLM 0.32's scale-out routes (``--enable-scale-out``; ``--tokens-only`` serves the tokens API alone): the
tokens-in, tokens-out ``POST /inference/v1/generate`` and ``/inference/v1/abort_requests`` (``serving_tokens.py``),
and the render endpoints, which answer a chat or completion request with the body that API takes. Off, every such
route answers 403 and says which flag turns it on, as vLLM's do."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from pagellm.server.anthropic.protocol import MessagesRequest
from pagellm.server.anthropic.serving_messages import AnthropicServingMessages
from pagellm.server.openai.errors import APIError
from pagellm.server.openai.protocol import ChatCompletionRequest, CompletionRequest, RequestDefaults
from pagellm.server.openai.route_utils import auth, body_size, json_unless_disconnected, session_from_header
from pagellm.server.openai.routes import _Served
from pagellm.server.openai.serving_chat import OpenAIServingChat
from pagellm.server.openai.responses_protocol import ResponsesRequest
from pagellm.server.openai.serving_completion import OpenAIServingCompletion
from pagellm.server.openai.serving_responses import OpenAIServingResponses
from pagellm.server.openai.serving_engine import EngineClient, prepared
from pagellm.server.openai.serving_tokens import AbortRequests, GenerateRequest, OpenAIServingTokens, rendered
from pagellm.server.openai.sse import sse_response


def install_scale_out(app: FastAPI, engine: EngineClient, served: _Served, api_key: Optional[str],
                      defaults: Optional[RequestDefaults], chat: Optional[OpenAIServingChat],
                      responses: Optional[OpenAIServingResponses], reasoning_parser: Optional[str],
                      mode: str) -> None:
    """``mode``: "on" (--enable-scale-out), "tokens_only" (--tokens-only: no render, no text) or "off"."""
    if mode == "off":
        app.include_router(_scale_out_off_router())
        return
    app.include_router(_tokens_router(engine, served, api_key, defaults, mode == "tokens_only", reasoning_parser))
    if chat is not None and responses is not None:
        app.include_router(_render_router(engine, served, api_key, chat, responses, defaults))


SCALE_OUT_OFF = "Scale-out endpoints are disabled. Restart pagellm serve with --enable-scale-out to enable them."


def _scale_out_off_router() -> APIRouter:
    """Without --enable-scale-out (or --tokens-only), vLLM's scale-out routes answer 403 and say how to turn them on,
    as vLLM's do."""
    router = APIRouter()

    async def disabled() -> Response:
        raise APIError(SCALE_OUT_OFF, 403, code="scale_out_disabled")

    for path in ("/inference/v1/generate", "/inference/v1/abort_requests", *RENDER_PATHS):
        router.add_api_route(path, disabled, methods=["POST"], include_in_schema=False)
    return router


RENDER_PATHS = ("/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render",
                "/v1/messages/render")


def _render_router(engine: EngineClient, served: _Served, api_key: Optional[str], chat: OpenAIServingChat,
                   responses: OpenAIServingResponses, defaults: Optional[RequestDefaults]) -> APIRouter:
    """vLLM's render endpoints (with --enable-scale-out): a chat, completion, Responses or Anthropic Messages request
    as the body of the tokens-in, tokens-out API (``serving_tokens.rendered``), rendered and checked as the routes
    would run it."""
    router = APIRouter(dependencies=auth(api_key))
    completion = OpenAIServingCompletion(engine, served.names, served.loras, defaults)

    @router.post(RENDER_PATHS[0])
    async def render_chat(body: ChatCompletionRequest, raw: Request) -> JSONResponse:
        session_from_header(body, raw)
        _no_beams(body)
        job = await prepared(chat.prepare, body, body_size(raw))
        return JSONResponse(rendered(job.request_id, job.prompt, job.params, body))

    @router.post(RENDER_PATHS[1])
    async def render_completion(body: CompletionRequest, raw: Request) -> JSONResponse:
        session_from_header(body, raw)
        _no_beams(body)
        job = await prepared(completion.prepare, body, body_size(raw))
        if any(not isinstance(prompt, list) for prompt in job.prompts):
            raise APIError("prompt_embeds cannot be rendered as token ids", 400, param="prompt_embeds")
        ids = [job.request_id] if len(job.prompts) == 1 else [f"{job.request_id}-{i}" for i in range(len(job.prompts))]
        return JSONResponse([rendered(i, p, job.params, body) for i, p in zip(ids, job.prompts)])

    @router.post(RENDER_PATHS[2])
    async def render_response(body: ResponsesRequest, raw: Request) -> JSONResponse:
        session_from_header(body, raw)
        job = (await prepared(responses.prepare, body, body_size(raw))).chat  # its conversation, as the chat request
        return JSONResponse(rendered(job.request_id, job.prompt, job.params, body))

    messages = AnthropicServingMessages(chat)

    @router.post(RENDER_PATHS[3])
    async def render_messages(body: MessagesRequest, raw: Request) -> JSONResponse:
        session_from_header(body, raw)
        job = (await prepared(messages.prepare, body, body_size(raw))).chat  # Anthropic's conversation, as chat's
        return JSONResponse(rendered(job.request_id, job.prompt, job.params, job.request))

    return router


def _no_beams(body: Any) -> None:
    if body.use_beam_search:
        raise APIError("beam search is not supported by the render endpoints", 400, param="use_beam_search")


def _tokens_router(engine: EngineClient, served: _Served, api_key: Optional[str],
                   defaults: Optional[RequestDefaults], tokens_only: bool = False,
                   reasoning_parser: Optional[str] = None) -> APIRouter:
    """vLLM 0.32's tokens-in, tokens-out API (``serving_tokens.py``), behind the API key; with ``tokens_only``
    (--tokens-only) also at vLLM's older ``/abort_requests`` path."""
    router = APIRouter(dependencies=auth(api_key))
    tokens = OpenAIServingTokens(engine, served.names, served.loras, defaults, no_detokenize=tokens_only,
                                 reasoning_parser=reasoning_parser)

    @router.post("/inference/v1/generate")
    async def generate(body: GenerateRequest, raw: Request) -> Response:
        job = await prepared(tokens.prepare, body, body_size(raw))
        if body.stream:
            return sse_response(tokens.stream(job), defaults)
        return await json_unless_disconnected(raw, tokens.create(job))

    async def abort_requests(body: AbortRequests) -> Response:
        await engine.abort(body.request_ids)
        return Response(status_code=200)

    for path in ("/inference/v1/abort_requests", *(("/abort_requests",) if tokens_only else ())):
        router.add_api_route(path, abort_requests, methods=["POST"])

    return router
