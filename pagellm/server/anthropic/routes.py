"""Anthropic's Messages API routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
(``serving_messages.py``). Every error they answer, a malformed body's included, is in Anthropic's shape
(``errors.py``). With an API key the key is taken as Anthropic's clients send it (``x-api-key``) or as OpenAI's do
(``Authorization: Bearer``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Optional

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from pagellm.server.anthropic.errors import error_response
from pagellm.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagellm.server.anthropic.serving_messages import AnthropicServingMessages
from pagellm.server.openai.chat_images import fetch_images
from pagellm.server.openai.errors import describe_validation_error
from pagellm.server.openai.protocol import RequestDefaults
from pagellm.server.openai.route_utils import auth, body_size, json_unless_disconnected, session_from_header
from pagellm.server.openai.serving_chat import OpenAIServingChat
from pagellm.server.openai.serving_engine import prepared
from pagellm.server.openai.sse import sse_response


class _AnthropicRoute(APIRoute):
    """A route whose errors (the body's validation, the key's check, the handler's) answer in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return error_response(describe_validation_error(list(exc.errors())))
            except Exception as exc:
                return error_response(exc)

        return route


def messages_router(chat: OpenAIServingChat, api_key: Optional[str],
                    defaults: Optional[RequestDefaults]) -> APIRouter:
    router = APIRouter(prefix="/v1/messages", route_class=_AnthropicRoute, dependencies=auth(api_key, x_api_key=True))
    messages = AnthropicServingMessages(chat)

    @router.post("")
    async def create_message(body: MessagesRequest, raw: Request) -> Response:
        session_from_header(body, raw)
        await fetch_images(body, chat.engine)
        job = await prepared(messages.prepare, body, body_size(raw))
        if body.stream:
            return sse_response(messages.stream(job), defaults)
        return await json_unless_disconnected(raw, messages.create(job))

    @router.post("/count_tokens")
    async def count_tokens(body: CountTokensRequest, raw: Request) -> dict[str, Any]:
        await fetch_images(body, chat.engine)
        return await prepared(messages.count_tokens, body, body_size(raw))

    return router
