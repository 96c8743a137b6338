"""Tools on /v1/chat/completions: what pagellm honours of them, and the shapes of a tool call.

- ``tool_choice`` naming a function (``{"type": "function", "function": {"name": F}}``, vLLM's named function
  calling, which needs no tool-call parser): the reply is a call of F whose arguments are constrained to F's
  ``parameters`` JSON schema by the structured-output grammar (``constraint``); the response carries it as
  ``message.tool_calls`` (streamed: the first delta of a choice carries the call's id and name, later ones argument
  text), ``content`` null and ``finish_reason`` "stop" (OpenAI's for a named call; "length" when ``max_tokens`` cut
  the arguments short).
- ``tool_choice`` "required": the reply is a JSON list of one or more calls ``{"name": ..., "parameters": {...}}``
  of the tools sent (at most one with ``parallel_tool_calls`` false), each following its function's schema, as vLLM
  constrains it; the response carries them as ``message.tool_calls`` with ``finish_reason`` "tool_calls" (a reply
  cut short by ``max_tokens`` is no list: it comes back as ``content`` with "length"). A stream sends the calls
  whole, in one delta per choice, once the list has closed.
- ``tool_choice`` "none" with tools: the tools reach the chat template only.
- ``auto`` (OpenAI's default when tools are sent): the model writes freely and the server's tool-call parser
  (``--enable-auto-tool-choice --tool-call-parser NAME``, ``tool_parsers.py``) takes the calls out of its text,
  returned as ``message.tool_calls`` with ``finish_reason`` "tool_calls" (streamed: content as it comes, each call
  whole once it closes). A server without a parser refuses it with a 400 that says what works instead
  (``problems``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Optional

from pydantic import BaseModel


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    index: int = 0
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall


_INSTEAD = ("start the server with --enable-auto-tool-choice --tool-call-parser NAME for it, or name a function "
            "({'type': 'function', 'function': {'name': ...}}), send 'required', or 'none'")


def problems(tools: Optional[list[Any]], tool_choice: Any, auto: bool = False) -> list[tuple[str, str]]:
    """(field, message) for every tool setting the server cannot honour as sent (each a 400); ``auto``: the server
    parses calls out of free text (``tool_parsers.py``)."""
    if tools and not all(isinstance(t, dict) and t.get("type") == "function"
                         and isinstance((t.get("function") or {}).get("name"), str) for t in tools):
        return [("tools", "each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")]
    if is_auto(tools, tool_choice) and not auto:
        shown = "'auto' (the default with tools)" if tool_choice is None else "'auto'"
        return [("tool_choice", f"tool_choice {shown} needs a tool-call parser; {_INSTEAD}")]
    if tool_choice in (None, "none", "auto"):
        return []
    if tool_choice == "required":
        return [] if tools else [("tool_choice", "tool_choice 'required' needs tools")]
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        return [("tool_choice", "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                "'function': {'name': ...}}")]
    if _function(tools, name) is None:
        return [("tool_choice", f"tool_choice names {name!r}, which is not among the tools sent")]
    return []


def is_auto(tools: Optional[list[Any]], tool_choice: Any) -> bool:
    """Whether the model chooses between text and calls (OpenAI's default when tools are sent)."""
    return bool(tools) and tool_choice in (None, "auto")


def forces_call(tool_choice: Any) -> bool:
    """Whether ``tool_choice`` makes the reply a call: "required", or a named function."""
    return tool_choice == "required" or isinstance(tool_choice, dict)


def named(tools: Optional[list[Any]], tool_choice: Any) -> Optional[str]:
    """The function a valid request's ``tool_choice`` names, or None."""
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) and tools else None


def constraint(tools: Optional[list[Any]], tool_choice: Any, parallel: Optional[bool] = None) -> dict[str, Any]:
    """The structured-output spec of a named call (its arguments follow the function's ``parameters`` schema) or of
    ``required`` (a list of calls of any of the tools, one at most unless ``parallel`` calls are allowed)."""
    name = named(tools, tool_choice)
    if name is not None:
        return {"tool_choice": {"json": _parameters(_function(tools, name) or {})}}
    if tool_choice != "required" or not tools:
        return {}
    calls = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                               "parameters": _parameters(t["function"])},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    listing = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return {"tool_choice": {"json": {**listing, "maxItems": 1} if parallel is False else listing}}


def required_calls(text: str) -> Optional[list[ToolCall]]:
    """The calls of a ``required`` reply, or None when its text is no whole list (cut short)."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return [ToolCall(id=call_id(), function=FunctionCall(name=item["name"], arguments=json.dumps(item["parameters"])))
            for item in items]


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object"}


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _function(tools: Optional[list[Any]], name: str) -> Optional[dict[str, Any]]:
    for tool in tools or []:
        if isinstance(tool, dict) and (tool.get("function") or {}).get("name") == name:
            return tool["function"]
    return None
