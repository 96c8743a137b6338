"""``/v1/responses``: OpenAI's Responses API over the chat pipeline, whole, streamed as typed events, or in the
background; responses stored for ``GET``, ``DELETE``, ``previous_response_id`` and cancelling.

Contract:
- A request becomes the chat request of the same conversation (``responses_protocol.py``) and runs through the chat
  handler: its template, tools, tool-call and reasoning parsers, structured outputs and checks (a 400 there is a
  400 here). The reply becomes output items: ``reasoning``, ``message`` (``output_text``), ``function_call``.
  A reply cut by ``max_output_tokens`` is ``incomplete`` with ``incomplete_details.reason = "max_output_tokens"``.
  ``usage.output_tokens_details.reasoning_tokens`` counts the thinking's tokens as the tokenizer encodes its text.
- Streamed (``stream: true``), the events are OpenAI's, each with its ``sequence_number``: ``response.created``,
  ``response.in_progress``, then per item ``response.output_item.added``, its part (``content_part.added``), its
  deltas (``reasoning_text.delta``, ``output_text.delta``, ``function_call_arguments.delta``), their ``.done``
  events and ``output_item.done``, and last ``response.completed`` (or ``response.incomplete``) with the whole
  response; an engine error ends the stream with an ``error`` event and ``response.failed``.
- With ``--enable-per-request-metrics`` the response carries chat's per-request ``metrics`` (``request_metrics.py``),
  whole, and in a stream's last event's response, as vLLM's does.
- ``store`` (default true) keeps the response in memory, the newest ``capacity`` of them: ``GET
  /v1/responses/{id}`` returns it, ``GET .../input_items`` pages through its input items, ``DELETE`` forgets it,
  and a later request's ``previous_response_id`` continues its conversation (its input and output; its
  instructions do not carry over, as OpenAI's do not). An unknown id is a 404.
- ``background: true`` answers at once with a ``queued`` response and generates in a task; ``GET`` polls it and
  ``POST /v1/responses/{id}/cancel`` aborts it (``cancelled``, its KV blocks freed); cancelling one that is not a
  running background response is a 400.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

from pagellm.server.openai.errors import APIError
from pagellm.server.openai.replies import ChatChunkChoice, ChatCompletionChoice
from pagellm.server.openai.responses_protocol import (FunctionCallItem, MessageItem, OutputText, ReasoningItem,
                                                      ReasoningText, ResponseObject, ResponsesRequest, ResponseUsage,
                                                      item_id)
from pagellm.server.openai.serving_chat import OpenAIServingChat, _Job


@dataclass
class _Stored:
    response: ResponseObject
    history: list[dict[str, Any]]  # the conversation before the output (without instructions)
    inputs: list[dict[str, Any]] = field(default_factory=list)  # the request's input items, as listed
    task: Optional[asyncio.Task] = None  # a background response's generation while it runs


@dataclass
class _ResponseJob:
    request: ResponsesRequest
    chat: _Job
    response: ResponseObject
    history: list[dict[str, Any]] = field(default_factory=list)
    inputs: list[dict[str, Any]] = field(default_factory=list)


class OpenAIServingResponses:

    def __init__(self, chat: OpenAIServingChat, capacity: int = 1024) -> None:
        self.chat = chat
        self.capacity = capacity
        self._stored: OrderedDict[str, _Stored] = OrderedDict()

    def prepare(self, request: ResponsesRequest) -> _ResponseJob:
        """Check and render the request (APIError / ValueError → 4xx before anything is queued)."""
        for name, why in request.unsupported():
            raise APIError(why, 400, param=name, code="unsupported_parameter")
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self._get(request.previous_response_id, "previous_response_id")
            history = previous.history + previous.response.conversation()
        job = self.chat.prepare(request.to_chat(history))
        response_id = item_id("resp")
        job.request_id = response_id
        status = "queued" if request.background else "in_progress"
        response = ResponseObject.start(request, response_id, job.model, job.created, status)
        return _ResponseJob(request, job, response, history + request.input_messages(), request.input_items())

    async def create(self, rj: _ResponseJob) -> ResponseObject:
        reply = await self.chat.create(rj.chat)
        (choice,) = reply.choices
        rj.response.output, rj.response.metrics = _items(choice, rj.request.wants_logprobs), reply.metrics
        self._finish(rj, choice.finish_reason, reply.usage.prompt_tokens, reply.usage.completion_tokens,
                     reply.usage.prompt_tokens_details.cached_tokens)  # type: ignore[union-attr]  # always set
        self._keep(rj)
        return rj.response

    def start_background(self, rj: _ResponseJob) -> ResponseObject:
        queued = rj.response.model_copy(deep=True)
        stored = self._keep(rj)
        stored.task = asyncio.create_task(self._run(rj, stored))
        return queued

    async def _run(self, rj: _ResponseJob, stored: _Stored) -> None:
        rj.response.status = "in_progress"
        try:
            await self.create(rj)
        except asyncio.CancelledError:
            rj.response.status = "cancelled"
        except Exception as exc:  # the engine failed: the response says so
            rj.response.status, rj.response.error = "failed", {"code": "server_error", "message": str(exc)}
        finally:
            stored.task = None

    def get(self, response_id: str) -> ResponseObject:
        return self._get(response_id, "response_id").response

    def input_items(self, response_id: str, after: Optional[str], limit: int, order: str) -> dict[str, Any]:
        """A page of the response's input items (OpenAI's cursor list: newest first unless ``order`` is asc)."""
        items = self._get(response_id, "response_id").inputs
        items = list(reversed(items)) if order == "desc" else list(items)
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(f"no input item {after!r} in response {response_id}", 400, param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def delete(self, response_id: str) -> dict[str, Any]:
        stored = self._get(response_id, "response_id")
        if stored.task is not None:
            stored.task.cancel()
        del self._stored[response_id]
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str) -> ResponseObject:
        stored = self._get(response_id, "response_id")
        if stored.task is None:
            raise APIError(f"response {response_id} is {stored.response.status}: only a background response that is "
                           "still running can be cancelled", 400, param="response_id")
        stored.task.cancel()
        await asyncio.gather(stored.task, return_exceptions=True)
        return stored.response

    async def stream(self, rj: _ResponseJob) -> AsyncIterator[str]:
        events = _Events(rj.response, rj.request.wants_logprobs)
        yield events.emit("response.created", response=rj.response)
        yield events.emit("response.in_progress", response=rj.response)
        finish: Optional[str] = None
        try:
            async for piece in self.chat.deltas(rj.chat):
                for event in events.piece(piece):
                    yield event
                finish = piece.finish_reason or finish
        except Exception as exc:
            rj.response.status, rj.response.error = "failed", {"code": "server_error", "message": str(exc)}
            yield events.emit("error", code="server_error", message=str(exc), param=None)
            yield events.emit("response.failed", response=rj.response)
            return
        if events.item is None and not rj.response.output:  # nothing was said: an empty message, as a whole reply
            for event in events.open_message():
                yield event
        for event in events.close(incomplete=finish == "length"):
            yield event
        choice = rj.chat.choices.get(0)
        prompt, output = len(rj.chat.prompt), choice.num_tokens if choice else 0
        rj.response.metrics = self.chat.response_metrics(rj.chat.choices, True)
        self._finish(rj, finish, prompt, output, choice.num_cached_tokens if choice else 0)
        self._keep(rj)
        kind = "response.completed" if rj.response.status == "completed" else "response.incomplete"
        yield events.emit(kind, response=rj.response)

    def _finish(self, rj: _ResponseJob, finish: Optional[str], prompt: int, output: int, cached: int) -> None:
        response = rj.response
        cut = finish == "length"
        response.status = "incomplete" if cut else "completed"
        response.incomplete_details = {"reason": "max_output_tokens"} if cut else None
        response.completed_at = None if cut else int(time.time())
        thinking = "".join(t.text for item in response.output if isinstance(item, ReasoningItem)
                           for t in item.content)
        reasoning = len(self.chat.tokenizer.encode(thinking, add_special_tokens=False)) if thinking else 0
        response.usage = ResponseUsage.of(prompt, output, cached, min(reasoning, output))

    def _keep(self, rj: _ResponseJob) -> _Stored:
        if not rj.request.store:
            return _Stored(rj.response, rj.history)
        stored = self._stored.get(rj.response.id)
        if stored is None:
            stored = self._stored[rj.response.id] = _Stored(rj.response, rj.history, rj.inputs)
            while len(self._stored) > self.capacity:
                self._stored.popitem(last=False)
        return stored

    def _get(self, response_id: str, param: str) -> _Stored:
        stored = self._stored.get(response_id)
        if stored is None:
            raise APIError(f"no stored response with id {response_id!r} (responses are kept when sent with store: "
                           f"true, the newest {self.capacity})", 404, param=param, code="response_not_found")
        return stored


def _items(choice: ChatCompletionChoice, logprobs: bool) -> list:
    """A whole reply's output items: thinking, text, calls."""
    message, items = choice.message, []
    if message.reasoning_content:
        items.append(ReasoningItem(content=[ReasoningText(text=message.reasoning_content)]))
    calls = message.tool_calls or []
    if message.content or not calls:
        text = OutputText(text=message.content or "", logprobs=_logprobs(choice.logprobs) if logprobs else None)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        items.append(MessageItem(content=[text], status=status))
    items += [FunctionCallItem(call_id=c.id, name=c.function.name, arguments=c.function.arguments) for c in calls]
    return items


def _logprobs(logprobs: Any) -> list[dict[str, Any]]:
    return [entry.model_dump() for entry in (logprobs.content if logprobs is not None else None) or []]


class _Events:
    """Turns the chat pipeline's pieces into the Responses API's events, one output item open at a time."""

    def __init__(self, response: ResponseObject, logprobs: bool) -> None:
        self.response = response
        self.logprobs = logprobs
        self.sequence = 0
        self.item: Any = None  # the open item
        self.text = ""  # its text (or arguments) so far
        self.token_logprobs: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence,
                **{k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for k, v in fields.items()}}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    @property
    def index(self) -> int:
        return len(self.response.output)

    def piece(self, piece: ChatChunkChoice) -> list[str]:
        delta, out = piece.delta, []
        if delta.reasoning_content:
            out += self._open(ReasoningItem) + self._delta("response.reasoning_text.delta", delta.reasoning_content)
        lps = _logprobs(piece.logprobs) if self.logprobs else []
        if delta.content or (lps and not delta.tool_calls and not delta.reasoning_content):  # text not out yet
            out += self._open(MessageItem) + self._delta("response.output_text.delta", delta.content or "", lps)
        for call in delta.tool_calls or []:
            arguments = call.function.arguments or "" if call.function is not None else ""
            if call.id is not None:
                out += self.close()
                name = call.function.name if call.function is not None else ""
                out += self._added(FunctionCallItem(call_id=call.id, name=name or "", status="in_progress"))
            if arguments:
                out.append(self._emit_delta("response.function_call_arguments.delta", arguments))
        return out

    def open_message(self) -> list[str]:
        return self._open(MessageItem)

    def _open(self, kind: type) -> list[str]:
        """Events that close the open item unless it is a ``kind``, and open a ``kind``."""
        if isinstance(self.item, kind):
            return []
        out = self.close()
        item = kind(status="in_progress")
        out += self._added(item)
        part = ReasoningText(text="") if kind is ReasoningItem else OutputText(text="")
        out.append(self.emit("response.content_part.added", item_id=item.id, output_index=self.index,
                             content_index=0, part=part))
        return out

    def _added(self, item: Any) -> list[str]:
        self.item, self.text, self.token_logprobs = item, "", []
        return [self.emit("response.output_item.added", output_index=self.index, item=item)]

    def _delta(self, kind: str, text: str, logprobs: Optional[list] = None) -> list[str]:
        self.token_logprobs += logprobs or []
        fields = {"logprobs": logprobs or []} if kind == "response.output_text.delta" else {}
        return [self._emit_delta(kind, text, content_index=0, **fields)]

    def _emit_delta(self, kind: str, text: str, **fields: Any) -> str:
        self.text += text
        return self.emit(kind, item_id=self.item.id, output_index=self.index, delta=text, **fields)

    def close(self, incomplete: bool = False) -> list[str]:
        """The events that finish the open item, which joins the response's output (``incomplete``: it was cut)."""
        item, out = self.item, []
        if item is None:
            return out
        where = {"item_id": item.id, "output_index": self.index}
        if isinstance(item, FunctionCallItem):
            item.arguments = self.text
            out.append(self.emit("response.function_call_arguments.done", arguments=self.text, **where))
        else:
            text = self.text
            if isinstance(item, ReasoningItem):
                part: Any = ReasoningText(text=text)
                out.append(self.emit("response.reasoning_text.done", content_index=0, text=text, **where))
            else:
                part = OutputText(text=text, logprobs=self.token_logprobs if self.logprobs else None)
                out.append(self.emit("response.output_text.done", content_index=0, text=text,
                                     logprobs=self.token_logprobs, **where))
            item.content = [part]
            out.append(self.emit("response.content_part.done", content_index=0, part=part, **where))
        item.status = "incomplete" if incomplete else "completed"
        out.append(self.emit("response.output_item.done", output_index=self.index, item=item))
        self.response.output.append(item)
        self.item = None
        return out
