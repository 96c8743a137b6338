"""Tools on /v1/chat/completions: what pagellm honours of them, and the shapes of a tool call.

- ``tool_choice`` naming a function (``{"type": "function", "function": {"name": F}}``, vLLM's named function
  calling, which needs no tool-call parser): the reply is a call of F whose arguments are constrained to F's
  ``parameters`` JSON schema by the structured-output grammar (``constraint``); the response carries it as
  ``message.tool_calls`` (streamed: the first delta of a choice carries the call's id and name, later ones argument
  text), ``content`` null and ``finish_reason`` "stop" (OpenAI's for a named call; "length" when ``max_tokens`` cut
  the arguments short).
- ``tool_choice`` "none" with tools: the tools reach the chat template only.
- ``auto`` (OpenAI's default when tools are sent) and ``required`` need the model's own call syntax parsed out of
  free text: refused with a 400 that says what works instead (``problems``).
"""

from __future__ import annotations

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


def problems(tools: Optional[list[Any]], tool_choice: Any) -> list[tuple[str, str]]:
    """(field, message) for every tool setting the server cannot honour as sent (each a 400)."""
    if tools and not all(isinstance(t, dict) and t.get("type") == "function"
                         and isinstance((t.get("function") or {}).get("name"), str) for t in tools):
        return [("tools", "each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")]
    if tool_choice in (None, "none"):
        if tools and tool_choice is None:
            return [("tool_choice", "tool_choice 'auto' (the default with tools) is not supported yet; name a "
                                    "function ({'type': 'function', 'function': {'name': ...}}) or send 'none'")]
        return []
    if tool_choice in ("auto", "required"):
        return [("tool_choice", f"tool_choice {tool_choice!r} is not supported yet; name a function "
                                "({'type': 'function', 'function': {'name': ...}}) or send 'none'")]
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        return [("tool_choice", "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                "'function': {'name': ...}}")]
    if _function(tools, name) is None:
        return [("tool_choice", f"tool_choice names {name!r}, which is not among the tools sent")]
    return []


def named(tools: Optional[list[Any]], tool_choice: Any) -> Optional[str]:
    """The function a valid request's ``tool_choice`` names, or None."""
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) and tools else None


def constraint(tools: Optional[list[Any]], tool_choice: Any) -> dict[str, Any]:
    """The structured-output spec of a named call: its arguments follow the function's ``parameters`` schema."""
    name = named(tools, tool_choice)
    if name is None:
        return {}
    function = _function(tools, name) or {}
    return {"tool_choice": {"json": function.get("parameters") or {"type": "object"}}}


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _function(tools: Optional[list[Any]], name: str) -> Optional[dict[str, Any]]:
    for tool in tools or []:
        if isinstance(tool, dict) and (tool.get("function") or {}).get("name") == name:
            return tool["function"]
    return None
