"""``POST /v1/chat/completions/batch`` (vLLM's): several conversations in one request, each answered as chat answers
it, in one response whose choices are their replies in order.

Contract:
- The body is a chat request whose ``messages`` is a list of conversations (each a non-empty list of messages);
  every other field applies to each conversation. Streaming, tools, beam search, ``n`` other than 1 and
  ``prompt_logprobs`` are a 400 that says so (vLLM's batch takes none of them either).
- Every conversation is checked and rendered as chat's (a 400 names the conversation) before any runs; then all
  run at once through the scheduler (a prefix they share is prefix-cached), as requests ``{id}_{i}``. If the client
  goes away, or one conversation fails, every one still running is aborted (one task group).
- The response is chat's: one ``chatcmpl-`` id, choice ``i`` the reply to conversation ``i``, ``usage`` summed over
  the conversations (their prefix-cache hits too).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from pagellm.server.openai.errors import APIError
from pagellm.server.openai.protocol import ChatCompletionRequest, ChatMessage
from pagellm.server.openai.replies import ChatCompletionResponse, PromptTokensDetails, UsageInfo
from pagellm.server.openai.serving_chat import OpenAIServingChat, _Job
from pagellm.server.openai.serving_engine import random_id

REFUSED = {"stream": "streaming", "tools": "tools", "use_beam_search": "beam search", "n": "n other than 1",
           "prompt_logprobs": "prompt_logprobs"}


class BatchChatCompletionRequest(ChatCompletionRequest):
    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(min_length=1)  # type: ignore[assignment]

    def refusals(self) -> list[tuple[str, str]]:
        given = {"stream": self.stream, "tools": self.tools, "use_beam_search": self.use_beam_search,
                 "n": self.n != 1, "prompt_logprobs": self.prompt_logprobs is not None}
        return [(name, f"batch chat completions do not support {REFUSED[name]}; send each conversation to "
                       "/v1/chat/completions for it") for name, value in given.items() if value]

    def conversation(self, index: int) -> ChatCompletionRequest:
        """Conversation ``index`` as a chat request of its own."""
        fields: dict[str, Any] = {name: getattr(self, name) for name in self.model_fields_set if name != "messages"}
        return ChatCompletionRequest.model_construct(set(fields) | {"messages"}, messages=self.messages[index],
                                                     **fields)


@dataclass
class _BatchJob:
    request_id: str
    model: str
    jobs: list[_Job]


class OpenAIServingChatBatch:

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def prepare(self, request: BatchChatCompletionRequest) -> _BatchJob:
        """Check and render every conversation (APIError / ValueError → 4xx before anything is queued)."""
        for name, why in request.refusals():
            raise APIError(why, 400, param=name, code="unsupported_parameter")
        base = random_id("chatcmpl", request.request_id)
        jobs = []
        for index in range(len(request.messages)):
            try:
                job = self.chat.prepare(request.conversation(index))
            except (APIError, ValueError) as exc:
                status = exc.status if isinstance(exc, APIError) else 400
                raise APIError(f"messages[{index}]: {exc}", status, param="messages") from None
            job.request_id = f"{base}_{index}"
            jobs.append(job)
        return _BatchJob(base, jobs[0].model, jobs)

    async def create(self, batch: _BatchJob) -> ChatCompletionResponse:
        try:
            async with asyncio.TaskGroup() as group:  # one failing cancels (aborts) the others
                tasks = [group.create_task(self.chat.create(job)) for job in batch.jobs]
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None  # what the client sees is the first failure's error
        replies = [task.result() for task in tasks]
        choices = []
        for index, reply in enumerate(replies):
            (choice,) = reply.choices
            choices.append(choice.model_copy(update={"index": index}))
        prompt = sum(r.usage.prompt_tokens for r in replies)  # type: ignore[union-attr]  # chat's replies carry it
        completion = sum(r.usage.completion_tokens for r in replies)  # type: ignore[union-attr]
        cached = sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)  # type: ignore[union-attr]
        usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                          prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
        return ChatCompletionResponse(id=batch.request_id, created=batch.jobs[0].created, model=batch.model,
                                      choices=choices, usage=usage)
