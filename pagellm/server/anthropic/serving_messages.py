"""``POST /v1/messages``: Anthropic's Messages API over the chat pipeline, whole or streamed as Anthropic's events;
``POST /v1/messages/count_tokens``: the prompt's tokens (also as ``context_management.original_input_tokens``, as
vLLM sends them: nothing edits the context here).

Contract:
- A request becomes the chat request of the same conversation (``protocol.py``) and runs through the chat handler:
  its template, tools, tool-call and reasoning parsers, structured outputs and checks (a 400 there is a 400 here).
- A reply's content blocks come in order: ``thinking`` (a reasoning parser's, signed with the SHA-256 of its text:
  pagellm checks no signature it is sent back), ``text``, then ``tool_use`` (its ``input`` the call's parsed
  arguments; a call cut short, whose arguments do not parse, stays text). A reply with nothing to say is one empty
  text block, as Anthropic's.
- ``stop_reason``: ``max_tokens`` when ``max_tokens`` ran out, ``model_context_window_exceeded`` when the context
  did first; ``tool_use`` when the reply calls tools; ``stop_sequence`` (with ``stop_sequence``) when one of
  ``stop_sequences`` ended it; else ``end_turn``. ``usage``: ``input_tokens`` (the prompt's tokens the prefix cache
  did not hold), ``cache_read_input_tokens`` (those it did) and ``output_tokens``.
- Streamed, the events are Anthropic's: ``message_start`` (the message without content; ``usage.input_tokens`` the
  whole prompt), then per block ``content_block_start``, its deltas (``text_delta``, ``thinking_delta`` then one
  ``signature_delta``, ``input_json_delta``) and ``content_block_stop``; then ``message_delta`` (stop reason, final
  usage) and ``message_stop``. An engine error after the start ends the stream with an ``error`` event.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import BaseModel

from pagellm.server.anthropic.errors import error_event
from pagellm.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagellm.server.openai.errors import APIError
from pagellm.server.openai.replies import ChatChunkChoice, ChatResponseMessage
from pagellm.server.openai.serving_chat import OpenAIServingChat, _Job


class MessageReply(BaseModel):
    """A whole reply, as Anthropic's ``Message``."""

    id: str
    type: str = "message"
    role: str = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: Optional[str] = None
    stop_sequence: Optional[str] = None
    usage: dict[str, int]


@dataclass
class _MessagesJob:
    request: MessagesRequest
    chat: _Job


class AnthropicServingMessages:

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    @property
    def _images(self) -> bool:
        """Whether the model takes images (user turns' image blocks become image parts)."""
        return self.chat.engine.image_placeholder is not None

    def prepare(self, request: MessagesRequest) -> _MessagesJob:
        """Check and render the request (APIError / ValueError → 4xx before anything is queued)."""
        for name, why in request.unsupported():
            raise APIError(why, 400, param=name, code="unsupported_parameter")
        job = self.chat.prepare(request.to_chat(self._images))
        job.request_id = f"msg_{uuid.uuid4().hex}"
        return _MessagesJob(request, job)

    def count_tokens(self, request: CountTokensRequest) -> dict[str, Any]:
        """The tokens of the prompt the request renders, as ``/v1/messages`` would render it."""
        tokens = len(self.chat.prepare(request.to_chat(self._images)).prompt)
        return {"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}}

    async def create(self, mj: _MessagesJob) -> MessageReply:
        reply = await self.chat.create(mj.chat)
        (choice,) = reply.choices
        content = content_blocks(choice.message)
        called = any(block["type"] == "tool_use" for block in content)
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, called,
                                       reply.usage.completion_tokens, mj.request.max_tokens)
        cached = reply.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]  # always set
        return MessageReply(id=mj.chat.request_id, content=content, model=reply.model, stop_reason=reason,
                            stop_sequence=sequence,
                            usage=usage(reply.usage.prompt_tokens, reply.usage.completion_tokens, cached))

    async def stream(self, mj: _MessagesJob) -> AsyncIterator[str]:
        events = _Events()
        start = MessageReply(id=mj.chat.request_id, content=[], model=mj.chat.model,
                             usage={"input_tokens": len(mj.chat.prompt), "output_tokens": 0})
        yield event("message_start", message=start.model_dump())
        finish: Optional[str] = None
        stop: Any = None
        try:
            async for piece in self.chat.deltas(mj.chat):
                for line in events.piece(piece):
                    yield line
                finish, stop = piece.finish_reason or finish, piece.stop_reason if piece.finish_reason else stop
        except Exception as exc:
            yield error_event(exc)
            return
        for line in events.finish():
            yield line
        choice = mj.chat.choices.get(0)
        output, cached = (choice.num_tokens, choice.num_cached_tokens) if choice is not None else (0, 0)
        reason, sequence = stop_reason(finish, stop, events.called(), output, mj.request.max_tokens)
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                    usage=usage(len(mj.chat.prompt), output, cached))
        yield event("message_stop")


def content_blocks(message: ChatResponseMessage) -> list[dict[str, Any]]:
    """A whole reply's content blocks (see the module doc)."""
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content,
                       "signature": signature(message.reasoning_content)})
    texts = [message.content] if message.content else []
    calls = []
    for call in message.tool_calls or []:
        arguments = _parsed(call.function.arguments)
        if arguments is None:
            texts.append(call.function.arguments)
        else:
            calls.append({"type": "tool_use", "id": call.id, "name": call.function.name, "input": arguments})
    if texts:
        blocks.append({"type": "text", "text": "".join(texts)})
    blocks.extend(calls)
    return blocks or [{"type": "text", "text": ""}]


def stop_reason(finish: Optional[str], stop: Any, called: bool, output_tokens: int,
                max_tokens: int) -> tuple[str, Optional[str]]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a chat choice's finish."""
    if finish == "length":
        return ("max_tokens", None) if output_tokens >= max_tokens else ("model_context_window_exceeded", None)
    if called:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_read_input_tokens": cached_tokens,
            "output_tokens": output_tokens}


def signature(thinking: str) -> str:
    return hashlib.sha256(thinking.encode()).hexdigest()


def event(kind: str, **fields: Any) -> str:
    """One server-sent event in Anthropic's framing (the event's name, then its JSON with the same ``type``)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


def _parsed(arguments: str) -> Optional[dict[str, Any]]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


@dataclass
class _Events:
    """One streamed reply's content blocks: each opened, filled and closed in turn."""

    index: int = -1
    kind: Optional[str] = None
    thinking: list[str] = field(default_factory=list)  # the open thinking block's text, for its signature
    calls: dict[int, list[str]] = field(default_factory=dict)  # each call's argument text, by its chat index
    current: Optional[int] = None  # the chat index of the open tool_use block's call

    def piece(self, piece: ChatChunkChoice) -> list[str]:
        delta, lines = piece.delta, []
        if delta.reasoning_content:
            lines += self._open({"type": "thinking", "thinking": "", "signature": ""}, "thinking")
            self.thinking.append(delta.reasoning_content)
            lines.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
        if delta.content:
            lines += self._open({"type": "text", "text": ""}, "text")
            lines.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or []:
            if call.id is not None:
                lines += self._open({"type": "tool_use", "id": call.id, "name": call.function.name, "input": {}},
                                    "tool_use")
                self.current, self.calls[call.index] = call.index, []
            if call.function.arguments and call.index == self.current:
                self.calls[call.index].append(call.function.arguments)
                lines.append(self._delta({"type": "input_json_delta", "partial_json": call.function.arguments}))
        return lines

    def finish(self) -> list[str]:
        """The last block closed (an empty text block first, when the reply said nothing)."""
        if self.index < 0:
            return self._open({"type": "text", "text": ""}, "text") + self._close()
        return self._close()

    def called(self) -> bool:
        """Whether the reply called a tool whose arguments are whole (a call cut short does not run)."""
        return self.current is not None and _parsed("".join(self.calls[self.current]) or "{}") is not None

    def _open(self, block: dict[str, Any], kind: str) -> list[str]:
        if self.kind == kind and kind != "tool_use":
            return []
        lines = self._close()
        self.index, self.kind = self.index + 1, kind
        return lines + [event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        lines = []
        if self.kind == "thinking":
            lines.append(self._delta({"type": "signature_delta", "signature": signature("".join(self.thinking))}))
            self.thinking = []
        self.kind = None
        return lines + [event("content_block_stop", index=self.index)]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", index=self.index, delta=delta)
