"""What every tool-call parser of ``tool_parsers.py`` shares: the ``Parsed`` result, a call made of a name and its
arguments (``make_call``, ``json_call``), a streamed call's piece (``CallDelta``), and the ``ToolParser`` interface
``tool_call_stream.py`` drives."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from pagellm.server.openai.tools import FunctionCall, ToolCall, call_id


@dataclass
class Parsed:
    content: Optional[str]
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class CallDelta:
    """A piece of the ``index``-th call: its first carries ``id`` and ``name``, each carries more argument text."""

    index: int
    arguments: str = ""
    id: Optional[str] = None
    name: Optional[str] = None


def make_call(name: Any, arguments: Any) -> Optional[ToolCall]:
    """A call, when the name is a string and the arguments an object (or JSON text of one)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=json.dumps(arguments,
                                                                                         ensure_ascii=False)))


def json_call(value: Any) -> Optional[ToolCall]:
    if not isinstance(value, dict) or "name" not in value:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return make_call(value["name"], {} if arguments is None else arguments)


def as_content(text: str) -> Optional[str]:
    """Text outside the calls as a reply's content: None when it is only white space."""
    return text.strip() or None


class ToolParser:
    """One call syntax. ``content_end(text)``: how much of a reply's start is surely content (nothing after it may be
    sent as content while streaming); ``closed_calls(rest)``: the calls already complete in the held rest."""

    name = ""
    harmony = False  # gpt-oss's harmony replies: the chat server splits them itself (``harmony.py``)
    # Whether calls are blocks whose arguments can stream as they come (``blocks``, ``text_outside`` then serve).
    streams_arguments = False

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def blocks(self, rest: str) -> list[tuple[str, Optional[ToolCall], bool]]:
        """The call blocks in held text, in order: (body, its call or None, closed)."""
        raise NotImplementedError

    def text_outside(self, rest: str, announced: set[int]) -> str:
        """The held text that is no call: outside the blocks, and the blocks (by number) never ``announced``."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        raise NotImplementedError

    def closed_calls(self, rest: str) -> list[ToolCall]:
        return []

    def may_close(self, piece: str) -> bool:
        """Whether a streamed piece can complete a call (else ``closed_calls`` is not asked again)."""
        return False

    def for_tools(self, tools: Optional[list[Any]]) -> ToolParser:
        """This parser for one request's ``tools`` (a syntax whose arguments are untyped text reads their schemas)."""
        return self
