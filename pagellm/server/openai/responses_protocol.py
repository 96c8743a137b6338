"""The Responses API's bodies (``POST /v1/responses``, OpenAI's newer endpoint, which vLLM serves too): the request,
its input items turned into the chat conversation the model's template renders, and the output items of a reply.

Contract:
- ``ResponsesRequest`` is validated as strictly as the chat request (unknown fields are a 400). ``input`` is a
  string (one user message) or a list of items: messages (``role`` user, system, developer or assistant; content a
  string or ``input_text`` / ``output_text`` parts), ``function_call`` items (a call the model made) and
  ``function_call_output`` items (its result, for the template's tool role); ``reasoning`` items are dropped, as
  chat templates drop earlier thinking. Images, files and hosted tools (web search, file search, MCP, ...) are a
  400 that names them.
- ``to_chat(history)`` is the same request as a ``ChatCompletionRequest``: ``instructions`` as the system message,
  the previous response's conversation (``history``, for ``previous_response_id``), then the input; function tools
  in the Responses' flat shape become chat tools, ``tool_choice`` ``{"type": "function", "name"}`` a named choice,
  ``text.format`` (``json_schema`` / ``json_object``) a ``response_format``, ``max_output_tokens`` the token limit,
  ``top_logprobs`` logprobs, ``reasoning.effort`` chat's ``reasoning_effort``; vLLM's sampling extensions
  (``top_k``, ``seed``, ``structured_outputs``, ...) pass on.
- The output items (built by ``serving_responses.py``) come in order: ``reasoning`` (a reasoning parser's
  thinking), then ``message`` (``output_text``, with logprobs when asked), then ``function_call`` items.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, PrivateAttr

from pagellm.server.openai.protocol import (ChatCompletionRequest, Count, NumLogprobs, OpenAIModel, Seed,
                                           omitted_when_none)
from pagellm.server.openai.request_metrics import PerRequestMetrics

# vLLM's sampling extensions a Responses request may carry; they mean what they mean on chat.
PASSED_ON = ("seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
             "logit_bias", "priority", "min_tokens", "ignore_eos", "bad_words", "structured_outputs",
             "chat_template_kwargs", "include_reasoning", "thinking_token_budget", "session_id", "vllm_xargs")
LOGPROBS = "message.output_text.logprobs"


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(OpenAIModel):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    _fetched_images: dict[str, bytes] = PrivateAttr(default_factory=dict)  # http(s) input_image URLs' bytes
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    max_output_tokens: Optional[Count] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_logprobs: Optional[NumLogprobs] = None
    include: Optional[list[str]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["auto", "none", "required"], dict[str, Any]] = "auto"
    parallel_tool_calls: bool = True
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    store: bool = True
    stream: bool = False
    background: bool = False
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Literal["auto", "disabled"] = "disabled"
    service_tier: Optional[Literal["auto", "default"]] = None
    prompt_cache_key: Optional[str] = None  # a routing hint: prefix caching here needs none
    # vLLM's extensions (PASSED_ON), sent by the SDK through extra_body
    seed: Optional[Seed] = None
    stop: Optional[Union[str, list[str]]] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    priority: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    bad_words: Optional[list[str]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    include_reasoning: bool = True
    thinking_token_budget: Optional[int] = Field(None, ge=-1)
    session_id: Optional[str] = Field(None, min_length=1, max_length=256)
    vllm_xargs: Optional[dict[str, Union[str, int, float, bool, list[Union[str, int, float]]]]] = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for every setting this server cannot honour."""
        found = []
        if self.truncation == "auto":
            found.append(("truncation", "truncation 'auto' (dropping the conversation's oldest items) is not "
                                        "supported; send 'disabled' and keep the input within max_model_len"))
        if self.background and (self.stream or not self.store):
            found.append(("background", "background responses need store: true and stream: false"))
        for name in self.include or []:
            if name != LOGPROBS:
                found.append(("include", f"include {name!r} is not supported (only {LOGPROBS!r})"))
        return found

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS in (self.include or [])

    def to_chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """This request as a chat request over ``history`` (see the module doc; ValueError names a bad item)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            "model": self.model, "messages": system + history + self.input_messages(),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "user": self.user, "logprobs": self.wants_logprobs,
            "top_logprobs": self.top_logprobs if self.wants_logprobs else None,
        }
        if self.tools:
            body.update(tools=[_chat_tool(tool, i) for i, tool in enumerate(self.tools)],
                        tool_choice=_chat_tool_choice(self.tool_choice), parallel_tool_calls=self.parallel_tool_calls)
        body["response_format"] = _response_format(self.text)
        if self.reasoning and self.reasoning.get("effort") is not None:
            body["reasoning_effort"] = self.reasoning["effort"]
        for name in PASSED_ON:
            if name in self.model_fields_set and name not in body:
                body[name] = getattr(self, name)
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        chat._fetched_images = self._fetched_images
        return chat

    def input_items(self) -> list[dict[str, Any]]:
        """``input`` as the items ``GET /v1/responses/{id}/input_items`` lists: each with an id, messages with their
        content as parts (call ``input_messages`` first: it checks them)."""
        raw = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        items = []
        for item in raw:
            kind = item.get("type", "message")
            if kind == "message":
                content = item["content"]
                parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
                item = {"type": "message", "role": item["role"], "content": parts, "status": "completed"}
            prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "item")
            items.append({"id": item.get("id") or item_id(prefix), **item})
        return items

    def input_messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages (consecutive function calls become one assistant turn)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for position, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                messages.append({"role": _role(item, position), "content": _content(item.get("content"), position)})
            elif kind == "function_call":
                call = {"id": _field(item, "call_id", position), "type": "function", "function": {
                    "name": _field(item, "name", position), "arguments": _field(item, "arguments", position)}}
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", position),
                                 "content": output if isinstance(output, str) else _text(output, position)})
            elif kind != "reasoning":
                raise ValueError(f"input[{position}]: items of type {kind!r} are not supported (messages, "
                                 "function_call, function_call_output and reasoning items are)")
        if not messages:
            raise ValueError("input must hold at least one message")
        return messages


def _field(item: dict[str, Any], name: str, position: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ValueError(f"input[{position}].{name} must be a string")
    return value


def _role(item: dict[str, Any], position: int) -> str:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise ValueError(f"input[{position}].role must be user, system, developer or assistant, got {role!r}")
    return "system" if role == "developer" else role


def _content(content: Any, position: int) -> str | list[dict[str, Any]]:
    """A message's content for the chat request: its text (``_text``), or where it has ``input_image`` parts, chat
    parts (text, and ``image_url`` parts of the images' URLs) for a vision-language model."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content, position)
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise ValueError(f"input[{position}].content: an input_image needs its image_url (a data: or http(s) "
                                 "URL; file_id is not supported)")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            parts.append({"type": "text", "text": _text([part], position)})
    return parts


def _text(content: Any, position: int) -> str:
    """A message's content as one string: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"input[{position}].content must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ValueError(f"input[{position}].content: only text parts are supported, got a {kind!r} part")
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_tool(tool: dict[str, Any], position: int) -> dict[str, Any]:
    """A Responses function tool (flat: type, name, parameters) as a chat tool."""
    if tool.get("type") != "function":
        raise ValueError(f"tools[{position}]: only function tools are supported, got {tool.get('type')!r}")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Union[str, dict[str, Any]]) -> Union[str, dict[str, Any]]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """``text.format`` as chat's ``response_format`` (None for plain text)."""
    fmt = (text or {}).get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if fmt.get("type") in ("json_object", "text"):
        return None if fmt["type"] == "text" else {"type": "json_object"}
    raise ValueError(f"text.format type must be 'text', 'json_object' or 'json_schema', got {fmt.get('type')!r}")


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: Optional[list[dict[str, Any]]] = None


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: item_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: item_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: item_id("fc"))
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Union[ReasoningItem, MessageItem, FunctionCallItem]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, output: int, cached: int, reasoning: int) -> ResponseUsage:
        return cls(input_tokens=prompt, input_tokens_details={"cached_tokens": cached, "cache_write_tokens": 0},
                   output_tokens=output, output_tokens_details={"reasoning_tokens": reasoning},
                   total_tokens=prompt + output)


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    completed_at: Optional[int] = None
    error: Optional[dict[str, Any]] = None
    incomplete_details: Optional[dict[str, str]] = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: Optional[ResponseUsage] = None
    # the request's settings, echoed as OpenAI does
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    previous_response_id: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_logprobs: Optional[int] = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Union[str, dict[str, Any]] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: Optional[dict[str, Any]] = None
    truncation: str = "disabled"
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: Optional[str] = None
    metrics: Optional[PerRequestMetrics] = omitted_when_none()  # --enable-per-request-metrics (request_metrics.py)

    @classmethod
    def start(cls, request: ResponsesRequest, response_id: str, model: str, created: int,
              status: str) -> ResponseObject:
        """The response before any output: the request's settings echoed."""
        return cls(id=response_id, created_at=created, status=status, model=model,  # type: ignore[arg-type]
                   instructions=request.instructions, max_output_tokens=request.max_output_tokens,
                   previous_response_id=request.previous_response_id, temperature=request.temperature,
                   top_p=request.top_p, top_logprobs=request.top_logprobs, tools=request.tools or [],
                   tool_choice=request.tool_choice, parallel_tool_calls=request.parallel_tool_calls,
                   text=request.text or {"format": {"type": "text"}}, reasoning=request.reasoning,
                   truncation=request.truncation, store=request.store, background=request.background,
                   metadata=request.metadata or {}, user=request.user)

    def conversation(self) -> list[dict[str, Any]]:
        """The output as chat messages, for a later request's ``previous_response_id``."""
        text = "".join(part.text for item in self.output if isinstance(item, MessageItem) for part in item.content)
        calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                      "arguments": item.arguments}}
                 for item in self.output if isinstance(item, FunctionCallItem)]
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
