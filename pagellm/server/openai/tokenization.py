"""Bodies of ``POST /tokenize`` and ``POST /detokenize`` (vLLM's extra routes): text or a chat conversation to token
ids and back, validated as strictly as the OpenAI bodies in ``protocol.py``."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel

from pagellm.server.openai.protocol import ChatMessage, OpenAIModel, TokenId


class TokenizeRequest(OpenAIModel):
    """Either ``prompt`` (plain text) or ``messages`` (rendered through the chat template)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
