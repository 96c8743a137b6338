"""``POST /v1/chat/completions``: messages → the model's chat template → assistant replies, streamed or whole.

Contract:
- The conversation is rendered with the tokenizer's chat template (text content parts are joined; other parts
  are refused with a 400) and checked against ``max_model_len`` before anything is queued.
- ``max_completion_tokens`` wins over the older ``max_tokens``; neither means "up to the context length".
- Streaming: the first chunk of every choice carries ``delta.role = "assistant"`` (and empty content), then
  content deltas; the chunk that finishes a choice carries its ``finish_reason``. With
  ``stream_options.include_usage`` a last chunk carries the usage and no choices; then ``data: [DONE]``.
- ``response_format`` (``json_object`` / ``json_schema``) and the vLLM structured-output fields constrain the
  reply; ``prompt_logprobs: k`` (vLLM) adds the prompt's logprobs to the (non-streamed) response.
- ``logprobs: true`` (with ``top_logprobs: k`` alternatives) fills ``choices[i].logprobs.content`` (see
  ``logprobs.py``); a stream sends each token's logprobs with the chunk that carries its text (or the next one).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

from pagellm.sampling_params import SamplingParams
from pagellm.server.openai.chunks import ChunkWriter
from pagellm.server.openai import tools as tooling
from pagellm.server.openai.errors import sse_error
from pagellm.server.openai.logprobs import chat_logprobs, prompt_logprobs_body
from pagellm.server.openai.protocol import (ChatChunkChoice, ChatCompletionChoice, ChatCompletionChunk,
                                            ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprobs,
                                            ChatResponseMessage, UsageInfo)
from pagellm.server.openai.serving_engine import ChoiceState as _Choice
from pagellm.server.openai.serving_engine import OpenAIServing, random_id


@dataclass
class _Job:
    request: ChatCompletionRequest
    request_id: str
    model: str
    prompt: list[int]
    params: SamplingParams
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, choices: dict[int, _Choice]) -> UsageInfo:
        completion_tokens = sum(c.num_tokens for c in choices.values())
        return UsageInfo(prompt_tokens=len(self.prompt), completion_tokens=completion_tokens,
                         total_tokens=len(self.prompt) + completion_tokens)


class OpenAIServingChat(OpenAIServing):

    def prepare(self, request: ChatCompletionRequest) -> _Job:
        """Validate and render the conversation (raises APIError / ValueError → 4xx before anything is queued)."""
        model, params = self.check_request(request)
        messages = [m.to_template_dict(i) for i, m in enumerate(request.messages)]
        prompt = self.tokenizer.apply_chat_template(messages, request.add_generation_prompt, _template_kwargs(request))
        return _Job(request, random_id("chatcmpl"), model, self.check_prompt(prompt), params)

    async def create(self, job: _Job) -> ChatCompletionResponse:
        choices: dict[int, _Choice] = {}
        prompt_logprobs = None
        async for _, output in self.generate([job.prompt], job.params, job.request_id, job.request.priority):
            choices.setdefault(output.outputs[0].index, _Choice()).add(output)
            prompt_logprobs = prompt_logprobs or output.prompt_logprobs
        result = [_choice(job, i, c) for i, c in sorted(choices.items())]
        return ChatCompletionResponse(id=job.request_id, created=job.created, model=job.model, choices=result,
                                      usage=job.usage(choices), prompt_logprobs=prompt_logprobs_body(prompt_logprobs))

    async def stream(self, job: _Job) -> AsyncIterator[str]:
        choices: dict[int, _Choice] = {}
        writer = ChunkWriter("chat", job.request_id, job.created, job.model)
        name = tooling.named(job.request.tools, job.request.tool_choice)
        required = job.request.tool_choice == "required"  # its calls go out whole, once the list has closed
        try:
            # The role goes first, before any token exists, as OpenAI does: clients see the reply has begun.
            yield _chunk(job, [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant",
                                                                        content=None if name or required else ""))
                               for i in range(job.request.n)])
            async for _, output in self.generate([job.prompt], job.params, job.request_id, job.request.priority):
                index = output.outputs[0].index
                choice = choices.setdefault(index, _Choice())
                text = choice.add(output)
                if required and choice.finish_reason:
                    yield _chunk(job, [_required_choice(job, index, choice)])
                elif (text or choice.finish_reason) and not required:
                    if job.params.logprobs is None and name is None:  # the common chunk: no pydantic model per token
                        yield writer.text_choice(index, text, choice.finish_reason, choice.stop_reason)
                        continue
                    delta = _delta(text, name, choice)
                    yield _chunk(job, [ChatChunkChoice(index=index, delta=delta, logprobs=_logprobs(job, choice),
                                                       finish_reason=choice.finish_reason,
                                                       stop_reason=choice.stop_reason)])
            if job.request.include_usage:
                yield _chunk(job, [], job.usage(choices))
        except Exception as exc:
            yield sse_error(exc)
        yield "data: [DONE]\n\n"


def _logprobs(job: _Job, choice: _Choice) -> ChatLogprobs | None:
    """The logprobs of the choice's tokens not sent yet (None when the request did not ask for them)."""
    if job.params.logprobs is None:
        return None
    return chat_logprobs(*choice.take_logprobs(), num_top=job.params.logprobs)


def _chunk(job: _Job, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
    body = ChatCompletionChunk(id=job.request_id, created=job.created, model=job.model, choices=choices,
                               usage=usage)
    return f"data: {body.model_dump_json()}\n\n"


def _template_kwargs(request: ChatCompletionRequest) -> Optional[dict[str, Any]]:
    """What the chat template gets besides the messages: ``chat_template_kwargs``, and ``tools`` when sent."""
    if not request.tools:
        return request.chat_template_kwargs
    return {**(request.chat_template_kwargs or {}), "tools": request.tools}


def _choice(job: _Job, index: int, choice: _Choice) -> ChatCompletionChoice:
    """A whole reply: its text; with a named tool choice, a call of that function with the text as arguments; with
    'required', the calls its text lists ("tool_calls" when it ended on its own, OpenAI's reason for them)."""
    name, finish, text = tooling.named(job.request.tools, job.request.tool_choice), choice.finish_reason, choice.text
    message = ChatResponseMessage(content=text)
    if name is not None:
        call = tooling.ToolCall(id=tooling.call_id(), function=tooling.FunctionCall(name=name, arguments=text))
        message = ChatResponseMessage(content=None, tool_calls=[call])
    elif job.request.tool_choice == "required" and (calls := tooling.required_calls(text)) is not None:
        message, finish = ChatResponseMessage(content=None, tool_calls=calls), \
            "tool_calls" if finish == "stop" else finish
    return ChatCompletionChoice(index=index, message=message, logprobs=_logprobs(job, choice), finish_reason=finish,
                                stop_reason=choice.stop_reason)


def _required_choice(job: _Job, index: int, choice: _Choice) -> ChatChunkChoice:
    """The one streamed piece of a 'required' reply: its calls whole (or its text, when it was cut short)."""
    calls, finish = tooling.required_calls(choice.text), choice.finish_reason
    delta = ChatDelta(content=choice.text)
    if calls is not None:
        delta = ChatDelta(tool_calls=[tooling.DeltaToolCall(index=k, id=c.id, type="function", function=(
            tooling.DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments)))
            for k, c in enumerate(calls)])
        finish = "tool_calls" if finish == "stop" else finish
    return ChatChunkChoice(index=index, delta=delta, logprobs=_logprobs(job, choice), finish_reason=finish,
                           stop_reason=choice.stop_reason)


def _delta(text: str, name: Optional[str], choice: _Choice) -> ChatDelta:
    """A streamed piece: text, or argument text of the named call (its first piece with the call's id and name)."""
    if name is None:
        return ChatDelta(content=text) if text else ChatDelta()
    if not text and choice.started:  # the finishing chunk
        return ChatDelta()
    first, choice.started = not choice.started, True
    function = tooling.DeltaFunctionCall(name=name if first else None, arguments=text)
    return ChatDelta(tool_calls=[tooling.DeltaToolCall(id=tooling.call_id() if first else None,
                                                       type="function" if first else None, function=function)])
