"""gpt-oss's forced tool calls: ``tool_choice`` "required" or a named function on a harmony reply.

A harmony reply makes its call as a message to ``functions.NAME`` (``harmony.py``), so a forced call cannot be a JSON
constraint from the first token, as it is for other models (``tools.py``): the model writes its analysis message
first. ``call_tag`` gives the structured-output constraint that forces the call while leaving the rest free: an
xgrammar structural tag (``{"type": "structural_tag", "format": ...}``) whose sequence is

- ``<|start|>assistant``, when the prompt ends after a closed message (a template that closed the analysis);
- the analysis message: optional, or, when the prompt opened it, its rest (``<|end|><|start|>assistant`` closes it);
- optionally a ``commentary`` preamble (content) closed the same way;
- the call: a header with the recipient after the channel (``<|channel|>commentary to=functions.NAME``) or before it
  (`` to=functions.NAME<|channel|>commentary``), the channel ``commentary`` or ``analysis``, the arguments' format
  ``<|constrain|>json`` or `` json`` (the forms gpt-oss writes), ``<|message|>``, and then the arguments, which
  follow NAME's ``parameters`` schema (with one blank at most between JSON's tokens, and no harmony marker inside
  a string, which would end the message). NAME is the named function, or for "required" any of the tools sent.

The grammar then ends, so only the stop tokens may follow (``<|call|>``, which ends a harmony call); one reply makes
one call, as gpt-oss's turns do. Harmony's markers are matched as their special tokens (``markers``), never as
text spelling them. The reply is read as any harmony reply (``harmony.split``), its calls surfaced whether or not the
server has a tool-call parser.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from pagellm.server.openai import tools as tooling
from pagellm.server.openai.errors import APIError
from pagellm.server.openai.harmony import open_header
from pagellm.structured_outputs import StructuredOutputsParams

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


def markers(encode: Callable[[str], list[int]]) -> dict[str, int]:
    """Each harmony marker's token id; ValueError naming the first the tokenizer has no single token for."""
    found = {}
    for marker in MARKERS:
        ids = encode(marker)
        if len(ids) != 1:
            raise ValueError(f"this model's tokenizer has no special token {marker}: a forced tool call needs "
                             "gpt-oss's harmony tokenizer")
        found[marker] = ids[0]
    return found


def forced_call(tokenizer: Any, request: Any, params: Any, prompt: list[int]) -> StructuredOutputsParams:
    """The constraint of a chat request's required or named call on gpt-oss (its ``tools`` and ``tool_choice``),
    given its rendered ``prompt``; an ``APIError`` (400) names what cannot be forced."""
    if params.thinking_token_budget not in (None, -1):
        raise APIError("thinking_token_budget ends gpt-oss's thinking with its final message, which a required or "
                       "named tool call does not have; send one or the other", 400, param="thinking_token_budget")
    tail = tokenizer.decode(prompt[-32:], skip_special_tokens=False)
    try:
        ids = markers(lambda text: tokenizer.encode(text, add_special_tokens=False))
        tag = call_tag(request.tools, request.tool_choice, ids, open_header(tail), tail.rstrip().endswith("<|end|>"))
    except ValueError as exc:
        raise APIError(str(exc), 400, param="tool_choice", code="unsupported_parameter") from None
    return StructuredOutputsParams(structural_tag=tag)


def call_tag(tools: list[Any], tool_choice: Any, ids: dict[str, int], opened: Optional[str],
             after_end: bool) -> dict[str, Any]:
    """The structural tag forcing one call (see the module doc). ``opened``: the header of a message the prompt left
    open (only an analysis message can precede a call); ``after_end``: the prompt ends after a message's end."""
    name = tooling.named(tools, tool_choice)
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    elements: list[dict[str, Any]] = []
    if opened is not None:
        if "analysis" not in opened or "to=" in opened:
            raise ValueError("the prompt leaves a message open that is not the analysis message; a forced tool call "
                             "can follow only an analysis message")
        elements += [_any_text(ids), *_next_message(ids)]
    else:
        elements += _next_header_start(ids, after_end) + [_optional(_message("analysis", ids))]
    elements += [_optional(_message("commentary", ids)), _or([_call(f, ids) for f in chosen])]
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}


def _token(marker: str, ids: dict[str, int]) -> dict[str, Any]:
    return {"type": "token", "token": ids[marker]}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _seq(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def _or(elements: list[dict[str, Any]]) -> dict[str, Any]:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _optional(content: dict[str, Any]) -> dict[str, Any]:
    return {"type": "optional", "content": content}


def _any_text(ids: dict[str, int]) -> dict[str, Any]:
    """A message's text: any tokens but harmony's markers."""
    return {"type": "any_tokens", "exclude_tokens": sorted(ids.values())}


def _next_message(ids: dict[str, int]) -> list[dict[str, Any]]:
    """A message's end and the next assistant message's start."""
    return [_token("<|end|>", ids), _token("<|start|>", ids), _const("assistant")]


def _next_header_start(ids: dict[str, int], after_end: bool) -> list[dict[str, Any]]:
    return [_token("<|start|>", ids), _const("assistant")] if after_end else []


def _message(channel: str, ids: dict[str, int]) -> dict[str, Any]:
    """A whole message on ``channel`` and the next message's start."""
    return _seq(_token("<|channel|>", ids), _const(channel), _token("<|message|>", ids), _any_text(ids),
                *_next_message(ids))


def _call(function: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    """A call of ``function``: its header (either order, either channel, either format) and its JSON arguments."""
    recipient = f" to=functions.{function['name']}"
    json_format = _or([_const(" json"), _seq(_const(" "), _token("<|constrain|>", ids), _const("json"))])
    channel = _or([_const("commentary"), _const("analysis")])
    headers = _or([_seq(_token("<|channel|>", ids), channel, _const(recipient)),
                   _seq(_const(recipient), _token("<|channel|>", ids), channel)])
    # harmony's markers (text or tokens) never inside the arguments, which they would end; one blank at most between
    # JSON's tokens, so a model cannot spend its tokens on blanks
    arguments = {"type": "json_schema", "json_schema": function.get("parameters") or {"type": "object"},
                 "excludes": list(MARKERS), "max_whitespace_cnt": 1}
    return _seq(headers, json_format, _token("<|message|>", ids), arguments)
