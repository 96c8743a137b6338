"""Anthropic's Messages API bodies (``POST /v1/messages`` and ``/v1/messages/count_tokens``, which vLLM serves too),
and the chat request each becomes.

Contract:
- ``MessagesRequest`` takes Anthropic's fields (``model``, ``messages``, ``max_tokens``, ``system``,
  ``stop_sequences``, ``stream``, ``tools``, ``tool_choice``, ``thinking``, ``output_config``), the sampling fields
  Anthropic's older API and vLLM take (``temperature``, ``top_p``, ``top_k``), and vLLM's extensions (``PASSED_ON``).
  Anthropic's platform settings (``metadata``, ``service_tier``, ``cache_control``, ``speed``, ...) are taken and
  change nothing (the prefix cache needs no breakpoints). Validation is as strict as chat's: unknown fields,
  documents, server tools (web search, code execution, ...), ``container``, and images for a model that takes none,
  are a 400 that names them.
- ``to_chat()`` is the same conversation as a ``ChatCompletionRequest``, as vLLM renders it: ``system`` (a string,
  or text blocks joined as they are; Claude Code's per-request billing header dropped, so prefixes stay cacheable) as
  the system message; a turn's text blocks joined by newlines (for a vision-language model, ``to_chat(images=True)``,
  a user turn with ``image`` blocks is text and ``image_url`` parts in order: base64 sources as data URLs, url
  sources as they are, which the route fetches: ``input_messages``); user ``tool_result`` blocks as ``tool`` messages
  (before the turn's text); assistant ``tool_use`` blocks as ``tool_calls``, ``thinking`` as ``reasoning_content``
  (``redacted_thinking`` dropped). A conversation
  that ends with an assistant turn is continued, not answered (``continue_final_message``), as Anthropic continues a
  prefilled reply. ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` become chat's ``auto`` / ``required`` /
  a named function / ``none`` (``disable_parallel_tool_use``: ``parallel_tool_calls: false``); ``thinking``
  ``enabled`` sets ``thinking_token_budget`` (below ``max_tokens``), ``disabled`` the template's
  ``enable_thinking: false``; ``output_config.effort`` is ``reasoning_effort`` (``xhigh`` and ``max`` as ``high``),
  ``output_config.format`` a JSON-schema ``response_format``.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import Field, PrivateAttr, model_validator

from pagellm.server.openai.protocol import ChatCompletionRequest, Count, OpenAIModel, Seed

# vLLM's sampling extensions a Messages request may carry; they mean what they mean on chat.
PASSED_ON = ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "logit_bias", "bad_words", "priority", "min_tokens", "ignore_eos",
             "structured_outputs", "cache_salt", "session_id", "vllm_xargs", "thinking_token_budget")
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's system block, with a hash that differs per request
EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # an image block's base64 media types


class Tool(OpenAIModel):
    """A client tool (``type`` "custom" or left out); Anthropic's server tools have other types and are refused."""

    name: str = Field(min_length=1)
    input_schema: dict[str, Any]
    description: Optional[str] = None
    type: Optional[Literal["custom"]] = None
    strict: Optional[bool] = None
    cache_control: Optional[dict[str, Any]] = None
    defer_loading: Optional[bool] = None
    eager_input_streaming: Optional[bool] = None
    input_examples: Optional[list[dict[str, Any]]] = None
    allowed_callers: Optional[list[str]] = None

    def to_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": {"type": "object", **self.input_schema}}
        if self.description is not None:
            function["description"] = self.description
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None

    @model_validator(mode="after")
    def _named(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the name of a tool")
        return self

    def to_chat(self) -> Union[str, dict[str, Any]]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(OpenAIModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(None, ge=MIN_THINKING_BUDGET, le=2**31 - 1)
    display: Optional[Literal["summarized", "omitted", "updates"]] = None  # thinking is always returned whole

    @model_validator(mode="after")
    def _budget(self) -> "Thinking":
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type 'enabled' needs budget_tokens")
        return self


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[OutputFormat] = None


class Message(OpenAIModel):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[dict[str, Any]]]


class CountTokensRequest(OpenAIModel):
    """``POST /v1/messages/count_tokens``: the prompt a Messages request would render, counted."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # Anthropic's platform settings: taken, they change nothing here
    cache_control: Optional[dict[str, Any]] = None
    speed: Optional[str] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None
    _fetched_images: dict[str, bytes] = PrivateAttr(default_factory=dict)  # http(s) image sources' bytes

    def to_chat(self, images: bool = False) -> ChatCompletionRequest:
        """This request as a chat request (ValueError names a bad message or block); ``images``: the model takes
        images, so user turns' image blocks become image parts (else they are refused)."""
        chat = ChatCompletionRequest.model_validate(_without_none(self._chat_body(images)))
        chat._fetched_images = self._fetched_images
        return chat

    def input_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages, its images as image parts (for the route to fetch their URLs)."""
        return [message.to_template_dict() for message in self.to_chat(images=True).messages]

    def _chat_body(self, images: bool) -> dict[str, Any]:
        messages = _system(self.system) + _conversation(self.messages, images)
        last = messages[-1]
        if last["role"] == "assistant" and not last["content"] and "tool_calls" not in last and len(messages) > 1:
            messages.pop()  # an empty last assistant turn prefills nothing
        continued = messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "add_generation_prompt": not continued, "continue_final_message": continued,
                                "chat_template_kwargs": self.chat_template_kwargs}
        if self.tools:
            body["tools"] = [tool.to_chat() for tool in self.tools]
        if self.tool_choice is not None and self.tools:
            body["tool_choice"] = self.tool_choice.to_chat()
            if self.tool_choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        elif self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            raise ValueError(f"tool_choice {self.tool_choice.type!r} needs tools")
        if self.thinking is not None and self.thinking.type == "disabled":
            body["chat_template_kwargs"] = {"enable_thinking": False, **(self.chat_template_kwargs or {})}
        config = self.output_config
        if config is not None and config.effort is not None:
            body["reasoning_effort"] = EFFORT[config.effort]
        if config is not None and config.format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": config.format.schema_}}
        return body


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: Count
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    inference_geo: Optional[str] = None
    diagnostics: Optional[dict[str, Any]] = None
    container: Optional[Union[str, dict[str, Any]]] = None
    # the sampling fields of Anthropic's older API, and vLLM's extensions (PASSED_ON)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, le=2**31 - 1)
    seed: Optional[Seed] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    bad_words: Optional[list[str]] = None
    priority: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    structured_outputs: Optional[dict[str, Any]] = None
    cache_salt: Optional[str] = Field(None, min_length=1)
    session_id: Optional[str] = Field(None, min_length=1, max_length=256)
    vllm_xargs: Optional[dict[str, Union[str, int, float, bool, list[Union[str, int, float]]]]] = None
    thinking_token_budget: Optional[int] = Field(None, ge=-1)

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for every setting this server cannot honour."""
        found = []
        if self.container is not None:
            found.append(("container", "container (code execution) is not supported: pagellm runs no server tools"))
        if self.thinking is not None and self.thinking.budget_tokens is not None \
                and self.thinking.budget_tokens >= self.max_tokens:
            found.append(("thinking.budget_tokens", "thinking.budget_tokens must be less than max_tokens"))
        return found

    def _chat_body(self, images: bool) -> dict[str, Any]:
        body = super()._chat_body(images)
        body.update(max_tokens=self.max_tokens, stop=self.stop_sequences, stream=self.stream)
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.thinking is not None and self.thinking.type == "enabled":
            body["thinking_token_budget"] = self.thinking.budget_tokens
        for name in PASSED_ON:
            if name in self.model_fields_set and name not in body:
                body[name] = getattr(self, name)
        return body


def _without_none(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


def _system(system: Optional[Union[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """The top-level ``system`` as a system message (none when it is empty)."""
    if system is None:
        return []
    text = system if isinstance(system, str) else "".join(_texts(system, "system"))
    return [{"role": "system", "content": text}] if text else []


def _conversation(messages: list[Message], images: bool) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        if isinstance(message.content, str):
            chat.append({"role": message.role, "content": message.content})
        elif message.role == "system":
            if text := "".join(_texts(message.content, where)):
                chat.append({"role": "system", "content": text})
        elif message.role == "user":
            chat.extend(_user_turn(message.content, where, images))
        else:
            chat.append(_assistant_turn(message.content, where))
    if not chat:
        raise ValueError("messages must hold at least one message with content")
    return chat


def _user_turn(blocks: list[dict[str, Any]], where: str, images: bool) -> list[dict[str, Any]]:
    """A user turn: its tool results as ``tool`` messages, then its text (if any) as one user message; with images,
    its text and image blocks as text and ``image_url`` parts, in order."""
    turn, parts = [], []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = _kind(block, at)
        if kind == "tool_result":
            turn.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at),
                         "content": _tool_output(block.get("content"), f"{at}.content")})
        elif kind == "text":
            parts.append({"type": "text", "text": _string(block, "text", at)})
        elif kind == "image" and images:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
        else:
            raise _refused(kind, at, "user")
    if any(part["type"] == "image_url" for part in parts):
        turn.append({"role": "user", "content": parts})
    elif parts:
        turn.append({"role": "user", "content": "\n".join(part["text"] for part in parts)})
    return turn


def _image_url(block: dict[str, Any], at: str) -> str:
    """An image block's source as a URL: base64 data as a data URL, a url source as it is."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media = _string(source, "media_type", f"{at}.source")  # type: ignore[arg-type]
        if media not in IMAGE_TYPES:
            raise ValueError(f"{at}.source.media_type must be one of {', '.join(IMAGE_TYPES)}, got {media!r}")
        return f"data:{media};base64,{_string(source, 'data', f'{at}.source')}"  # type: ignore[arg-type]
    if kind == "url":
        return _string(source, "url", f"{at}.source")  # type: ignore[arg-type]
    raise ValueError(f"{at}.source must be {{'type': 'base64', 'media_type': ..., 'data': ...}} or {{'type': 'url', "
                     f"'url': ...}} (the Files API's file sources are not served), got type {kind!r}")


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts, thinking, calls = [], [], []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "thinking":
            thinking.append(_string(block, "thinking", at))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise ValueError(f"{at}.input must be an object")
            calls.append({"id": _string(block, "id", at), "type": "function", "function": {
                "name": _string(block, "name", at), "arguments": json.dumps(arguments)}})
        elif kind != "redacted_thinking":
            raise _refused(kind, at, "assistant")
    turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thinking:
        turn["reasoning_content"] = "".join(thinking)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _texts(blocks: list[dict[str, Any]], where: str) -> list[str]:
    """The text blocks' texts (the billing header left out); any other block is refused."""
    texts = []
    for index, block in enumerate(blocks):
        at = f"{where}[{index}]" if where == "system" else f"{where}.content[{index}]"
        kind = _kind(block, at)
        if kind != "text":
            raise _refused(kind, at, "system")
        text = _string(block, "text", at)
        if not text.startswith(BILLING_HEADER):
            texts.append(text)
    return texts


def _tool_output(content: Any, where: str) -> str:
    """A tool result's content: a string, or text blocks joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text blocks")
    texts = []
    for index, block in enumerate(content):
        kind = _kind(block, f"{where}[{index}]")
        if kind != "text":
            raise _refused(kind, f"{where}[{index}]", "tool_result")
        texts.append(_string(block, "text", f"{where}[{index}]"))
    return "\n".join(texts)


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ValueError(f"{where} must be a content block: an object with a type")
    return block["type"]


def _string(block: dict[str, Any], name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{name} must be a string")
    return value


def _refused(kind: str, where: str, owner: str) -> ValueError:
    if kind == "image" and owner == "user":
        return ValueError(f"{where}: image blocks are not supported (this model takes no images; serve a "
                          "vision-language model for them); send text")
    if kind in ("document", "search_result", "container_upload"):
        return ValueError(f"{where}: {kind} blocks are not supported (pagellm serves text and images); send text")
    allowed = {"user": "text, image and tool_result", "assistant": "text, thinking, redacted_thinking and tool_use",
               "system": "text", "tool_result": "text"}[owner]
    return ValueError(f"{where}: {kind!r} blocks are not supported in {owner} content (only {allowed})")
