"""Response bodies of the OpenAI API (completions, chat completions and their stream chunks, the model list), as
pydantic models: OpenAI's field names and ``object`` strings, so the ``openai`` SDK parses them unchanged, plus
vLLM's extras (``prompt_logprobs``, ``stop_reason``, ``reasoning_content``, and ``token_ids`` /
``prompt_token_ids``, which appear only where a request asked for them with ``return_token_ids``). The requests are
``protocol.py``'s."""

from __future__ import annotations

import time
from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from pagellm.server.openai import tools as tooling
from pagellm.server.openai.protocol import omitted_when_none
from pagellm.server.openai.request_metrics import PerRequestMetrics

# ---- completions -------------------------------------------------------------------------------------------

class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per generated token its text, its logprob, the top alternatives (text →
    logprob, the sampled token always included) and its character offset in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` item: one alternative at one prompt position."""

    logprob: float
    rank: int
    decoded_token: str


# One entry per prompt token: None for the first, then token id (as a string) → its logprob.
PromptLogprobs = list[Optional[dict[str, PromptLogprob]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length", "abort", "repetition"]] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[list[int]] = omitted_when_none()  # the choice's prompt (a stream: its first chunk)
    token_ids: Optional[list[int]] = omitted_when_none()  # the choice's tokens (a stream: those of the chunk)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(BaseModel):
    """Predicted outputs (chat ``prediction``): the draft tokens that held and those rejected."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    completion_tokens_details: Optional[CompletionTokensDetails] = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens
                   + completion_tokens, prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None
    metrics: Optional[PerRequestMetrics] = omitted_when_none()  # --enable-per-request-metrics (request_metrics.py)


# ---- chat completions -------------------------------------------------------------------------------------------

class ChatResponseMessage(BaseModel):
    role: str = "assistant"  # --response-role
    content: Optional[str] = None
    tool_calls: Optional[list[tooling.ToolCall]] = None
    reasoning_content: Optional[str] = None  # a reasoning model's thinking (--reasoning-parser)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[Literal["stop", "length", "abort", "tool_calls", "repetition"]] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = omitted_when_none()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[list[int]] = omitted_when_none()
    metrics: Optional[PerRequestMetrics] = omitted_when_none()


class ChatDelta(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[tooling.DeltaToolCall]] = None
    reasoning_content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[Literal["stop", "length", "abort", "tool_calls", "repetition"]] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = omitted_when_none()  # the tokens since the choice's last chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = omitted_when_none()  # the first chunk's, with return_token_ids
    metrics: Optional[PerRequestMetrics] = omitted_when_none()  # the usage chunk's, with per-request metrics


# ---- models ------------------------------------------------------------------------------------------------

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagellm"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
