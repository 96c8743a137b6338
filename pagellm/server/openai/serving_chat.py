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
- ``use_beam_search`` returns the ``n`` best beams instead of ``n`` samples (``serving_beam.py``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from pagellm.beam_search import BeamSearchParams
from pagellm.lora import LoRARequest
from pagellm.sampling_params import SamplingParams
from pagellm.server.openai.chunks import ChunkWriter
from pagellm.chat_content import image_urls
from pagellm.server.openai import chat_images, serving_beam
from pagellm.server.openai import tools as tooling
from pagellm.server.openai.errors import APIError, sse_error
from pagellm.server.openai.logprobs import chat_logprobs, num_alternatives, prompt_logprobs_body
from pagellm.server.openai.protocol import ChatCompletionRequest, RequestDefaults
from pagellm.server.openai.replies import (ChatChunkChoice, ChatCompletionChoice, ChatCompletionChunk,
                                           ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatResponseMessage,
                                           CompletionTokensDetails, UsageInfo)
from pagellm.server.openai.request_metrics import PerRequestMetrics
from pagellm.server.openai.serving_engine import ChoiceState as _Choice
from pagellm.server.openai import harmony
from pagellm.server.openai import harmony_calls
from pagellm.server.openai.harmony import HarmonyStream
from pagellm.server.openai.reasoning import ReasoningStream, closed_in_prompt, get_reasoning_parser
from pagellm.server.openai.serving_engine import EngineClient, OpenAIServing, random_id
from pagellm.server.openai.tool_call_stream import ToolCallStream
from pagellm.server.openai.tool_parsers import ToolParser, get_parser


@dataclass
class _Job:
    request: ChatCompletionRequest
    request_id: str
    model: str
    prompt: list[int]
    params: SamplingParams
    parser: Optional[ToolParser] = None  # tool_choice 'auto' on a server that parses calls
    reasoning: Optional[str] = None  # the reasoning parser, on a server with one
    closed: bool = False  # the prompt closed the think block: the reply is all answer
    created: int = field(default_factory=lambda: int(time.time()))
    streams: dict[int, ToolCallStream] = field(default_factory=dict)  # an 'auto' stream's per-choice parse
    thinking: dict[int, ReasoningStream] = field(default_factory=dict)  # a stream's per-choice thinking
    choices: dict[int, _Choice] = field(default_factory=dict)  # a stream's choices as they add up
    beam: Optional[BeamSearchParams] = None  # use_beam_search: the n best beams instead of n samples
    role: str = "assistant"  # the reply's role (--response-role; the last message's when continuing it)
    echoed: str = ""  # ``echo``: the last message's text, which the reply's content begins with
    harmony: bool = False  # gpt-oss's harmony messages (``harmony.py``): thinking, content and calls split here
    opened: Optional[str] = None  # ... and the header of a message the prompt left open
    messages: dict[int, HarmonyStream] = field(default_factory=dict)  # a harmony stream's per-choice parse

    def thoughts(self) -> ReasoningStream:
        return ReasoningStream(self.reasoning, self.closed)  # type: ignore[arg-type]

    @property
    def harmony_args(self) -> tuple[bool, bool, Optional[int], Optional[str]]:
        """How a harmony reply is read (``HarmonyStream``'s and ``harmony.split``'s arguments): calls surfaced for
        'auto' on a server that parses them, thinking with the reasoning parser."""
        calls = self.parser is not None or tooling.forces_call(self.request.tool_choice)
        return calls, self.reasoning is not None, self.limit, self.opened

    @property
    def name(self) -> Optional[str]:
        """The function a named tool choice calls."""
        return tooling.named(self.request.tools, self.request.tool_choice)

    @property
    def required(self) -> bool:
        return self.request.tool_choice == "required"

    @property
    def limit(self) -> Optional[int]:
        """How many calls a reply may make (``parallel_tool_calls: false``: one)."""
        return 1 if self.request.parallel_tool_calls is False else None

    def usage(self, choices: dict[int, _Choice]) -> UsageInfo:
        """The prompt counted once, its cached tokens as the first sample's request found them; with a prediction,
        the draft tokens accepted and rejected (all choices')."""
        first = choices.get(0)
        usage = UsageInfo.of(len(self.prompt), sum(c.num_tokens for c in choices.values()),
                             first.num_cached_tokens if first is not None else 0)
        if self.request.prediction is not None:
            accepted = sum(c.num_accepted_draft_tokens for c in choices.values())
            drafted = sum(c.num_draft_tokens for c in choices.values())
            usage.completion_tokens_details = CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                                                      rejected_prediction_tokens=drafted - accepted)
        return usage


class OpenAIServingChat(OpenAIServing):

    def __init__(self, engine: EngineClient, model_names: Sequence[str], tool_parser: Optional[str] = None,
                 reasoning_parser: Optional[str] = None, loras: Optional[dict[str, LoRARequest]] = None,
                 defaults: Optional[RequestDefaults] = None) -> None:
        super().__init__(engine, model_names, loras, defaults)
        self.tool_parser: Optional[ToolParser] = get_parser(tool_parser) if tool_parser is not None else None
        self.reasoning_parser = reasoning_parser
        tags = get_reasoning_parser(reasoning_parser) if reasoning_parser is not None else None  # unknown: fails now
        self.harmony = bool(self.tool_parser is not None and self.tool_parser.harmony or tags and tags.harmony)
        if tags is not None:
            self.think_tag = tags.end
            # A constraint (a tool call, JSON, a regex) shapes the answer: it waits for the reply's </think> (gpt-oss:
            # its final message's start).
            self.think_end = self.tokenizer.encode(tags.answer_start or tags.end, add_special_tokens=False)

    def prepare(self, request: ChatCompletionRequest) -> _Job:
        """Validate and render the conversation (raises APIError / ValueError → 4xx before anything is queued)."""
        for name, why in tooling.problems(request.tools, request.tool_choice, auto=self.tool_parser is not None):
            raise APIError(why, 400, param=name, code="unsupported_parameter")
        model, params = self.check_request(request)
        if self.harmony:  # the messages' markers are special tokens: the reply's text keeps them
            params.skip_special_tokens = False
        self.check_request_template(request.chat_template)
        if request.truncate_prompt_tokens is None:
            self.check_text_length(sum(len(m.text()) for m in request.messages))
        messages = [m.to_template_dict() for m in request.messages]
        urls = image_urls(messages) if self.engine.image_placeholder is not None else []  # else: text parts only
        kwargs = _template_kwargs(request, self.defaults)
        if urls:
            prompt = chat_images.prompt(self.engine, request, messages, urls, kwargs)
        else:
            prompt = self.truncate(self.tokenizer.apply_chat_template(
                messages, request.add_generation_prompt, kwargs, request.chat_template,
                continue_final_message=request.continue_final_message, add_special_tokens=request.add_special_tokens),
                request.truncate_prompt_tokens, request.truncation_side)
        parser = self.tool_parser.for_tools(request.tools) \
            if self.tool_parser is not None and tooling.is_auto(request.tools, request.tool_choice) else None
        if request.prediction is not None:
            params.prediction_token_ids = self._prediction(request.prediction)
        reasoning, closed = self.reasoning_parser, False
        forced = self.harmony and request.tools and tooling.forces_call(request.tool_choice)
        if forced:
            params.structured_outputs = harmony_calls.forced_call(self.tokenizer, request, params, prompt)
            self.check_params(model, params)
        elif reasoning is not None:
            tail = prompt[-16 - len(self.think_end):]  # the end tag and what a template puts after it
            closed = closed_in_prompt(self.tokenizer.decode(tail, skip_special_tokens=False), self.think_tag)
            if params.structured_outputs is not None and not closed:
                params.structured_outputs = msgspec.structs.replace(params.structured_outputs,
                                                                    begin_after=self.think_end)
        last = request.messages[-1]
        role = self.defaults.response_role if request.add_generation_prompt else last.role
        beam = serving_beam.beam_params(request, params.max_tokens, self.max_model_len)
        return _Job(request, random_id("chatcmpl", request.request_id), model, self.check_prompt(prompt), params,
                    parser, reasoning, closed, beam=beam, role=role,
                    echoed=last.text() if request.echo and last.role == role else "", harmony=self.harmony,
                    opened=harmony.open_header(self.tokenizer.decode(prompt[-32:], skip_special_tokens=False))
                    if self.harmony else None)

    def _prediction(self, prediction: dict[str, Any]) -> list[int]:
        """OpenAI's ``prediction`` (``{"type": "content", "content": text or text parts}``) as token ids to draft."""
        if self.engine.runtime.speculative_method != "ngram":
            raise APIError("prediction is drafted by n-gram speculation: start the server with --speculative-config "
                           "'{\"method\": \"ngram\", \"num_speculative_tokens\": 8}'", 400, param="prediction",
                           code="unsupported_parameter")
        content = prediction.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        if prediction.get("type") != "content" or not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
            raise APIError("prediction must be {'type': 'content', 'content': text or a list of text parts}", 400,
                           param="prediction")
        content = "".join(p["text"] for p in parts)
        return self.tokenizer.encode(content, add_special_tokens=False)

    async def create(self, job: _Job) -> ChatCompletionResponse:
        choices: dict[int, _Choice] = {}
        prompt_logprobs = None
        async for _, output in self.generate([job.prompt], job.params, job.request_id, job.request.priority,
                                             job.beam, job.request.cache_salt):
            choices.setdefault(output.outputs[0].index, _Choice(keep_ids=job.request.return_token_ids)).add(output)
            prompt_logprobs = prompt_logprobs or output.prompt_logprobs
        result = [_choice(job, i, c) for i, c in sorted(choices.items())]
        return ChatCompletionResponse(id=job.request_id, created=job.created, model=job.model, choices=result,
                                      usage=job.usage(choices), prompt_logprobs=prompt_logprobs_body(prompt_logprobs),
                                      prompt_token_ids=job.prompt if job.request.return_token_ids else None,
                                      metrics=self._metrics(job, choices))

    def _metrics(self, job: _Job, choices: dict[int, _Choice]) -> Optional[PerRequestMetrics]:
        return self.response_metrics(choices, job.params.num_candidates == 1 and job.beam is None)

    async def stream(self, job: _Job) -> AsyncIterator[str]:
        writer = ChunkWriter("chat", job.request_id, job.created, job.model)
        plain = job.params.logprobs is None and job.name is None and job.parser is None and not job.required \
            and job.reasoning is None and not job.request.return_token_ids and not job.harmony
        try:
            # The role goes first, before any token exists, as OpenAI does: clients see the reply has begun.
            content = None if job.name or job.required else job.echoed
            usage = job.usage(job.choices) if job.request.continuous_usage else None
            yield _chunk(job, [ChatChunkChoice(index=i, delta=ChatDelta(role=job.role, content=content))
                               for i in range(job.request.n)], usage,
                         job.prompt if job.request.return_token_ids else None)
            async for index, choice, text in self._outputs(job):
                usage = job.usage(job.choices) if job.request.continuous_usage else None
                if plain:  # the common chunk: no pydantic model per token
                    if text or choice.finish_reason:
                        yield writer.text_choice(index, text, choice.finish_reason, choice.stop_reason,
                                                 usage and usage.model_dump_json())
                elif (piece := _piece(job, index, choice, text)) is not None:
                    yield _chunk(job, [piece], usage)
            if job.request.include_usage:
                yield _chunk(job, [], job.usage(job.choices), metrics=self._metrics(job, job.choices))
        except Exception as exc:
            yield sse_error(exc)
        yield "data: [DONE]\n\n"

    async def deltas(self, job: _Job) -> AsyncIterator[ChatChunkChoice]:
        """The reply's pieces as a stream sends them (thinking, answer text, calls), without the SSE framing; the
        choices add up in ``job.choices`` (the Responses API builds its events from these)."""
        async for index, choice, text in self._outputs(job):
            if (piece := _piece(job, index, choice, text)) is not None:
                yield piece

    async def _outputs(self, job: _Job) -> AsyncIterator[tuple[int, _Choice, str]]:
        async for _, output in self.generate([job.prompt], job.params, job.request_id, job.request.priority,
                                             cache_salt=job.request.cache_salt):
            index = output.outputs[0].index
            choice = job.choices.setdefault(index, _Choice(keep_ids=job.request.return_token_ids))
            yield index, choice, choice.add(output)


def _piece(job: _Job, index: int, choice: _Choice, text: str) -> Optional[ChatChunkChoice]:
    """The streamed chunk of a choice's new text, when there is one to send: a named call's argument text, a
    'required' list's calls once it closes, thinking apart from the answer, the content and closed calls of an
    'auto' reply, or plain text."""
    finish = choice.finish_reason
    thinking = ""
    if job.reasoning is not None and not job.harmony:
        thinking, text = _think(job, index, text, finish)
    delta: Optional[ChatDelta] = None
    if job.harmony:
        thinking, delta, finish = _harmony_delta(job, index, choice, text)
    elif job.required:
        if finish:
            delta, finish = _required_delta(job, choice)
    elif job.parser is not None:
        delta, finish = _auto_delta(job, index, choice, text)
    elif text or finish:
        delta = _delta(text, job.name, choice)
    if thinking and job.request.include_reasoning:
        delta = (delta or ChatDelta()).model_copy(update={"reasoning_content": thinking})
    if delta is None and choice.unsent_ids:  # tokens without text yet (return_token_ids)
        delta = ChatDelta()
    if delta is None:
        return None
    return ChatChunkChoice(index=index, delta=delta, logprobs=_logprobs(job, choice), finish_reason=finish,
                           stop_reason=choice.stop_reason,
                           token_ids=choice.take_ids() if job.request.return_token_ids else None)


def _think(job: _Job, index: int, text: str, finish: Optional[str]) -> tuple[str, str]:
    """A streamed piece split into thinking and answer (all that was held, once the choice finishes)."""
    stream = job.thinking.get(index)
    if stream is None:
        stream = job.thinking[index] = job.thoughts()
    thinking, answer = stream.feed(text)
    if finish:
        more_thinking, more_answer = stream.finish()
        thinking, answer = thinking + more_thinking, answer + more_answer
    return thinking, answer


def _harmony_delta(job: _Job, index: int, choice: _Choice,
                   text: str) -> tuple[str, Optional[ChatDelta], Optional[str]]:
    """A harmony reply's streamed piece: its thinking, and its content and call pieces (None: nothing to send)."""
    stream = job.messages.setdefault(index, HarmonyStream(*job.harmony_args))
    piece, finish = stream.feed(text), choice.finish_reason
    if finish:
        rest = stream.finish()
        piece = harmony.Split(piece.thinking + rest.thinking, piece.content + rest.content, piece.calls + rest.calls)
        finish = "tool_calls" if finish == "stop" and stream.called and job.name is None else finish
    if not (piece.content or piece.calls or finish):
        return piece.thinking, None, None
    deltas = [tooling.DeltaToolCall(index=c.index, id=c.id, type="function" if c.id is not None else None,
                                    function=tooling.DeltaFunctionCall(name=c.name, arguments=c.arguments))
              for c in piece.calls]
    return piece.thinking, ChatDelta(content=piece.content or None, tool_calls=deltas or None), finish


def _auto_delta(job: _Job, index: int, choice: _Choice, text: str) -> tuple[Optional[ChatDelta], Optional[str]]:
    """An 'auto' reply's content that is surely no call, and its calls' pieces as they come (None: nothing to send
    yet)."""
    stream = job.streams.setdefault(index, ToolCallStream(job.parser, job.limit))  # type: ignore[arg-type]
    content, calls = stream.feed(text)
    finish = choice.finish_reason
    if finish:
        rest, more = stream.finish()
        content, calls = content + rest, calls + more
        finish = "tool_calls" if finish == "stop" and stream.called else finish
    if not (content or calls or finish):
        return None, None
    deltas = [tooling.DeltaToolCall(index=c.index, id=c.id, type="function" if c.id is not None else None,
                                    function=tooling.DeltaFunctionCall(name=c.name, arguments=c.arguments))
              for c in calls]
    return ChatDelta(content=content or None, tool_calls=deltas or None), finish


def _logprobs(job: _Job, choice: _Choice) -> ChatLogprobs | None:
    """The logprobs of the choice's tokens not sent yet (None when the request did not ask for them)."""
    if job.params.logprobs is None:
        return None
    return chat_logprobs(*choice.take_logprobs(), num_top=num_alternatives(job.params),
                         as_ids=job.request.return_tokens_as_token_ids)


def _chunk(job: _Job, choices: list[ChatChunkChoice], usage: UsageInfo | None = None,
           prompt_token_ids: Optional[list[int]] = None, metrics: Optional[PerRequestMetrics] = None) -> str:
    body = ChatCompletionChunk(id=job.request_id, created=job.created, model=job.model, choices=choices,
                               usage=usage, prompt_token_ids=prompt_token_ids, metrics=metrics)
    return f"data: {body.model_dump_json()}\n\n"


def _template_kwargs(request: ChatCompletionRequest, defaults: RequestDefaults) -> Optional[dict[str, Any]]:
    """What the chat template gets besides the messages: ``chat_template_kwargs``, ``tools`` when sent (unless
    ``tool_choice`` is "none" on a server that excludes them then), ``documents`` and ``reasoning_effort`` when set
    (templates such as gpt-oss's read it)."""
    excluded = defaults.exclude_tools_when_tool_choice_none and request.tool_choice == "none"
    extra: dict[str, Any] = {"tools": request.tools} if request.tools and not excluded else {}
    if request.documents is not None:
        extra["documents"] = request.documents
    if request.reasoning_effort is not None:
        extra["reasoning_effort"] = request.reasoning_effort
    if not extra:
        return request.chat_template_kwargs
    return {**(request.chat_template_kwargs or {}), **extra}


def _choice(job: _Job, index: int, choice: _Choice) -> ChatCompletionChoice:
    """A whole reply: its text (its thinking apart, with a reasoning parser); with a named tool choice, a call of
    that function with the text as arguments; with 'required', the calls its text lists; with 'auto', the calls the
    parser finds in the answer and the text that is none ("tool_calls" when it ended on its own with calls, OpenAI's
    reason for them)."""
    finish, text, thinking = choice.finish_reason, choice.text, None
    if job.reasoning is not None and not job.harmony:
        thinking, text = job.thoughts().split(text)
    message, calls = ChatResponseMessage(content=text), None
    if job.harmony:
        thinking, content, calls = harmony.split(text, *job.harmony_args)
        message = ChatResponseMessage(content=content, tool_calls=calls or None)
    elif job.name is not None:
        call = tooling.ToolCall(id=tooling.call_id(), function=tooling.FunctionCall(name=job.name, arguments=text))
        message = ChatResponseMessage(content=None, tool_calls=[call])
    elif job.required:
        calls = tooling.required_calls(text)
        message = ChatResponseMessage(content=None, tool_calls=calls) if calls is not None else message
    elif job.parser is not None and (parsed := job.parser.parse(text)).calls:
        calls = parsed.calls[:job.limit]
        message = ChatResponseMessage(content=parsed.content, tool_calls=calls)
    finish = "tool_calls" if calls and finish == "stop" and job.name is None else finish
    message.reasoning_content = thinking if job.request.include_reasoning else None
    message.role = job.role
    if job.echoed and message.content is not None:
        message.content = job.echoed + message.content
    return ChatCompletionChoice(index=index, message=message, logprobs=_logprobs(job, choice), finish_reason=finish,
                                stop_reason=choice.stop_reason,
                                token_ids=choice.output_ids if job.request.return_token_ids else None)


def _required_delta(job: _Job, choice: _Choice) -> tuple[ChatDelta, Optional[str]]:
    """The one streamed answer of a 'required' reply, once it finishes: its calls whole (or its text, when it was
    cut short)."""
    text = job.thoughts().split(choice.text)[1] if job.reasoning is not None else choice.text
    calls, finish = tooling.required_calls(text), choice.finish_reason
    if calls is None:
        return ChatDelta(content=text), finish
    return ChatDelta(tool_calls=[tooling.DeltaToolCall(index=k, id=c.id, type="function", function=(
        tooling.DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments)))
        for k, c in enumerate(calls)]), "tool_calls" if finish == "stop" else finish


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
