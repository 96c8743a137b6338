"""gpt-oss's replies in OpenAI's harmony format, split into thinking, content and tool calls (``--reasoning-parser
openai_gptoss`` and ``--tool-call-parser openai``, vLLM's names).

A harmony reply is a run of messages, each a header, ``<|message|>``, its text, and an end: ``<|end|>`` (another
message follows, from ``<|start|>``), or ``<|call|>`` / ``<|return|>``, the model's stop tokens, which end the reply.
A header names the message's channel (``<|channel|>analysis``, ``final`` or ``commentary``) and, for a call, its
recipient (``to=functions.get_weather``, before or after the channel) and its arguments' format (``<|constrain|>json``
or a bare ``json``). The prompt ends in ``<|start|>assistant``, so the reply opens with its first header (where a
template leaves a message open in the prompt, ``open_header`` reads its header and the reply goes on with its text):

    <|channel|>analysis<|message|>The user asks...<|end|><|start|>assistant<|channel|>final<|message|>Hello!

As vLLM splits it: the ``analysis`` channel is thinking (``reasoning_content``, with the reasoning parser); ``final``,
and ``commentary`` without a recipient (a preamble before calls), are content; a message to ``functions.NAME`` is a
call of NAME whose arguments are its text (with the tool-call parser, for ``tool_choice`` "auto"); any other message
(a built-in tool's) is dropped. Messages of one kind are joined with a newline. The server keeps the reply's special
tokens in its text for this (``skip_special_tokens`` off), and the markers are matched in that text.

Contract: ``HarmonyStream.feed(piece)`` returns the thinking, content and call pieces (``CallDelta``: the first with
the call's id and name, then argument text as it arrives) that can go out now; only text that may still be a marker
is held. ``finish()`` gives what was held: a reply cut short ends its open message there, and a reply with no header
at all (a model that did not write harmony) is content. ``split(text)`` is the same over a whole reply, so a stream
and a whole response say the same; a call's arguments are then the JSON text normalised (the model's own text where
it is no JSON object).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

from pagellm.server.openai.tool_parser_base import CallDelta, Parsed, ToolParser
from pagellm.server.openai.tools import FunctionCall, ToolCall, call_id

MESSAGE = "<|message|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>")  # what ends a message's text
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
THINKING, CONTENT, CALL, DROPPED = "thinking", "content", "call", "dropped"


@dataclass
class Split:
    """What a piece of a reply gives: thinking text, content text, and call pieces."""

    thinking: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def message_kind(header: str, calls: bool, thinking: bool) -> tuple[str, Optional[str]]:
    """A header's kind (THINKING, CONTENT, CALL or DROPPED: thinking without the reasoning parser, calls without the
    tool-call parser, a built-in tool's messages) and, for a call, the function's name."""
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    if recipient is not None:
        name = recipient.group(1)
        if name.startswith("functions.") and calls:
            return CALL, name[len("functions."):]
        return DROPPED, None
    kind = channel.group(1) if channel is not None else "final"
    if kind == "analysis":
        return (THINKING if thinking else DROPPED), None
    return (CONTENT if kind in ("final", "commentary") else DROPPED), None


def _partial_end(text: str) -> int:
    """How many characters at the end of ``text`` may be the start of a message's end marker."""
    for keep in range(min(len("<|return|>") - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-keep:]) for tag in _ENDS):
            return keep
    return 0


class HarmonyStream:
    """One choice's reply as it arrives (see the module doc). ``calls``: surface calls (the tool-call parser, and
    ``tool_choice`` "auto"); ``thinking``: surface thinking (the reasoning parser); ``limit``: the most calls."""

    def __init__(self, calls: bool = True, thinking: bool = True, limit: Optional[int] = None,
                 opened: Optional[str] = None) -> None:
        self.surface_calls, self.surface_thinking, self.limit = calls, thinking, limit
        self.held = ""
        self.kind: Optional[str] = None  # the open message's (None: reading a header)
        self.emitted = 0  # calls announced
        self.started: set[str] = set()  # the kinds that have had a message (the next one's text starts on a newline)
        self._opening: list[CallDelta] = []  # the pieces of a message the prompt opened, sent with the first text
        if opened is not None:  # the prompt ends inside a message (``open_header``): the reply goes on with it
            first = Split()
            self._open(opened, first)
            self._opening = first.calls

    @property
    def called(self) -> bool:
        return self.emitted > 0

    def feed(self, piece: str) -> Split:
        self.held += piece
        out = Split(calls=self._opening)
        self._opening = []
        while True:
            if self.kind is None:
                at = self.held.find(MESSAGE)
                if at < 0:
                    return out
                self._open(self.held[:at], out)
                self.held = self.held[at + len(MESSAGE):]
                continue
            ends = [(at, tag) for tag in _ENDS if (at := self.held.find(tag)) >= 0]
            if not ends:
                keep = _partial_end(self.held)
                self._emit(self.held[:len(self.held) - keep], out)
                self.held = self.held[len(self.held) - keep:]
                return out
            at, tag = min(ends)
            self._emit(self.held[:at], out)
            self.held, self.kind = self.held[at + len(tag):], None

    def finish(self) -> Split:
        out = self.feed("")
        if self.kind is not None:  # cut short inside a message: its text so far
            self._emit(self.held, out)
        elif self.held.strip() and "<|" not in self.held and not self.started:  # no harmony at all: content
            self.kind = CONTENT
            self._emit(self.held, out)
        self.held, self.kind = "", None
        return out

    def _open(self, header: str, out: Split) -> None:
        kind, name = message_kind(header, self.surface_calls, self.surface_thinking)
        if kind == CALL and self.limit is not None and self.emitted >= self.limit:
            kind = DROPPED
        if kind == CALL:
            out.calls.append(CallDelta(self.emitted, "", call_id(), name))
            self.emitted += 1
        elif kind in self.started:
            self._add(kind, "\n", out)
        self.started.add(kind)
        self.kind = kind

    def _emit(self, text: str, out: Split) -> None:
        if text and self.kind is not None:
            self._add(self.kind, text, out)

    def _add(self, kind: str, text: str, out: Split) -> None:
        if kind == THINKING:
            out.thinking += text
        elif kind == CONTENT:
            out.content += text
        elif kind == CALL:
            if out.calls and out.calls[-1].index == self.emitted - 1:
                last = out.calls[-1]
                out.calls[-1] = CallDelta(last.index, last.arguments + text, last.id, last.name)
            else:
                out.calls.append(CallDelta(self.emitted - 1, text))


def open_header(prompt_tail: str) -> Optional[str]:
    """The header of the message a rendered prompt (its last characters) leaves open, its text begun (a template
    that opens the analysis message, a continued final message), or None: the reply starts with a header."""
    start = prompt_tail.rfind("<|start|>")
    last = prompt_tail[start:] if start >= 0 else prompt_tail
    at = last.find(MESSAGE)
    if at < 0 or any(tag in last[at:] for tag in _ENDS):
        return None
    return last[:at]


def split(text: str, calls: bool = True, thinking: bool = True, limit: Optional[int] = None,
          opened: Optional[str] = None) -> tuple[Optional[str], Optional[str], list[ToolCall]]:
    """A whole reply's thinking, content (None where empty) and calls."""
    stream = HarmonyStream(calls, thinking, limit, opened)
    first, rest = stream.feed(text), stream.finish()
    found: dict[int, ToolCall] = {}
    for delta in first.calls + rest.calls:
        if delta.id is not None:
            found[delta.index] = ToolCall(id=delta.id, function=FunctionCall(name=delta.name or "", arguments=""))
        found[delta.index].function.arguments += delta.arguments
    for call in found.values():
        call.function.arguments = _normalised(call.function.arguments)
    return first.thinking + rest.thinking or None, first.content + rest.content or None, list(found.values())


def _normalised(arguments: str) -> str:
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else arguments


class HarmonyToolParser(ToolParser):
    """``--tool-call-parser openai``: gpt-oss's calls, messages to ``functions.NAME`` (the chat server streams them
    with ``HarmonyStream``; ``parse`` is ``split`` over a whole reply, its thinking left out)."""

    name = "openai"
    harmony = True

    def parse(self, text: str) -> Parsed:
        _, content, calls = split(text, thinking=False)
        return Parsed(content, calls)

    def content_end(self, text: str) -> int:
        return 0  # nothing is surely content before the messages are read
