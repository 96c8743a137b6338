"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extra routes; ``tokenizer_router``, with ``GET
/tokenizer_info`` under ``--enable-tokenizer-info-endpoint``): text or a chat conversation to token ids and
back, validated as strictly as the OpenAI bodies in ``protocol.py``. A conversation is rendered as a chat request's
would be: its ``tools``, ``chat_template_kwargs`` and (on a server started with ``--trust-request-chat-template``)
its own ``chat_template`` reach the template, so the count is the prompt's; ``return_token_strs`` adds each token's
string."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter
from pydantic import BaseModel

from pagellm.server.openai.errors import APIError
from pagellm.server.openai.protocol import ChatMessage, OpenAIModel, TokenId
from pagellm.server.openai.serving_engine import OpenAIServing


class TokenizeRequest(OpenAIModel):
    """Either ``prompt`` (plain text) or ``messages`` (rendered through the chat template)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[dict[str, Any]]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: Optional[bool] = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


def tokenize(serving: OpenAIServing, body: TokenizeRequest) -> TokenizeResponse:
    """The body's token ids (a 400 for what a chat or completion request would be refused for)."""
    serving.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("send exactly one of prompt or messages", 400, param="prompt")
    if body.messages is None:
        if body.tools or body.chat_template or body.chat_template_kwargs:
            raise APIError("tools, chat_template and chat_template_kwargs go with messages, not a prompt", 400,
                           param="prompt")
        tokens = serving.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
    else:
        serving.check_request_template(body.chat_template)
        kwargs = {**(body.chat_template_kwargs or {}), **({"tools": body.tools} if body.tools else {})}
        tokens = serving.tokenizer.apply_chat_template(
            [m.to_template_dict() for m in body.messages], body.add_generation_prompt, kwargs or None,
            body.chat_template, continue_final_message=body.continue_final_message)
    strings = serving.tokenizer.hf.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=serving.max_model_len, tokens=tokens, token_strs=strings)


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenizer_router(serving: OpenAIServing, tokenizer_info: bool) -> APIRouter:
    router = APIRouter()

    async def describe_tokenizer() -> dict[str, Any]:  # vLLM's --enable-tokenizer-info-endpoint
        return {**serving.tokenizer.info(), "model_max_length": serving.max_model_len}

    if tokenizer_info:
        router.add_api_route("/tokenizer_info", describe_tokenizer, methods=["GET"])

    @router.post("/tokenize")
    def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:  # plain def: FastAPI runs it off the event loop
        return tokenize(serving, body)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        return DetokenizeResponse(prompt=serving.detokenize(body.tokens))

    return router
