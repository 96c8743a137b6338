"""Tool calls out of a streamed reply (``tool_choice`` "auto" with ``stream: true``), with the parsers of
``tool_parsers.py``.

Contract:
- ``ToolCallStream`` does what ``ToolParser.parse`` does for a streamed reply: ``feed(piece)`` returns the content
  that can go out now and the calls that have closed; text that may begin a call is held back until it is known
  (hermes: a partial ``<tool_call>`` at the end; the whole-reply syntaxes: a reply that opens with ``{`` or ``[``),
  and ``finish()`` returns what was held, parsed, as ``CallDelta`` pieces. Hermes calls stream as vLLM's do: the
  first delta (id and name) once ``{"name": ..., "arguments":`` has arrived, then the arguments object's text as it
  comes (its raw JSON, so the pieces join into the model's own arguments text); a call whose arguments are not an
  object, or whose name comes after them, goes out whole when it closes, as the whole-reply syntaxes' calls do.
  ``limit`` keeps the first call only (``parallel_tool_calls: false``).
"""

from __future__ import annotations

import json
import re
from typing import Optional

from pagellm.server.openai.tool_parser_base import CallDelta
from pagellm.server.openai.tool_parsers import ToolParser, as_content
from pagellm.server.openai.tools import ToolCall, call_id


class ToolCallStream:
    """One streamed choice: content as soon as it is surely content, calls as they come (see the module doc)."""

    def __init__(self, parser: ToolParser, limit: Optional[int] = None) -> None:
        self.parser, self.limit = parser, limit
        self.text, self.sent = "", 0
        self.emitted = 0                   # calls announced (their first delta sent)
        self.blocks_done = 0               # hermes: call blocks fully handled
        self.open: Optional[int] = None    # hermes: the block whose arguments are streaming
        self.args_sent = 0                 # ... and how much of them went out
        self.announced: set[int] = set()   # hermes: the blocks sent as calls

    def feed(self, piece: str) -> tuple[str, list[CallDelta]]:
        self.text += piece
        end = max(self.sent, self.parser.content_end(self.text))
        content, self.sent = self.text[self.sent:end], end
        if end == len(self.text):
            return content, []
        if self.parser.streams_arguments:
            return content, self._blocks(self.text[end:], final=False)
        if not self.parser.may_close(piece):
            return content, []
        return content, self._whole(self.parser.closed_calls(self.text[end:]))

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What was held, once the reply has ended: its calls not sent yet and the text that was no call."""
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        parsed = self.parser.parse(rest)
        if not parsed.calls and not self.emitted:
            return rest, []
        if self.parser.streams_arguments:
            deltas = self._blocks(rest, final=True)
            return as_content(self.parser.text_outside(rest, self.announced)) or "", deltas
        return parsed.content or "", self._whole(parsed.calls)

    def _whole(self, calls: list[ToolCall]) -> list[CallDelta]:
        """Calls sent whole, one delta each (those not sent yet, up to ``limit``)."""
        fresh = calls[self.emitted:self.limit] if self.limit is not None else calls[self.emitted:]
        self.emitted += len(fresh)
        first = self.emitted - len(fresh)
        return [CallDelta(first + k, c.function.arguments, c.id, c.function.name) for k, c in enumerate(fresh)]

    def _blocks(self, rest: str, final: bool) -> list[CallDelta]:
        """Block syntaxes (hermes): a call is announced once its name is known, its argument text streams as it
        arrives, and a block that closes without having streamed goes out whole (``final``: the reply ended; an open
        block counts)."""
        deltas: list[CallDelta] = []
        for number, (body, call, closed) in enumerate(self.parser.blocks(rest)):
            if number < self.blocks_done:
                continue
            if self.limit is not None and self.emitted >= self.limit and self.open != number:
                break
            if closed or final:
                deltas += self._close_block(number, body, call)
                continue
            deltas += self._stream_block(number, body)
            break  # nothing follows an open block
        return _merged(deltas)

    def _close_block(self, number: int, body: str, call: Optional[ToolCall]) -> list[CallDelta]:
        self.blocks_done = number + 1
        if self.open == number:  # its arguments streamed: the rest of them
            self.open = None
            arguments, _ = _arguments_text(body)
            return [CallDelta(self.emitted - 1, arguments[self.args_sent:])]
        if call is None:  # no call after all: its text is content (``finish`` gives it)
            return []
        self.announced.add(number)
        self.emitted += 1
        return [CallDelta(self.emitted - 1, call.function.arguments, call.id, call.function.name)]

    def _stream_block(self, number: int, body: str) -> list[CallDelta]:
        deltas = []
        if self.open != number:
            head = _HERMES_HEAD.match(body)
            if head is None:
                return []
            self.open, self.args_sent = number, 0
            self.announced.add(number)
            deltas.append(CallDelta(self.emitted, "", call_id(), json.loads(f'"{head.group(1)}"')))
            self.emitted += 1
        arguments, _ = _arguments_text(body)
        if len(arguments) > self.args_sent:
            deltas.append(CallDelta(self.emitted - 1, arguments[self.args_sent:]))
            self.args_sent = len(arguments)
        return deltas

    @property
    def called(self) -> bool:
        return self.emitted > 0


# A hermes call's opening, up to where an arguments object starts: the name is known, the arguments can stream.
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


def _arguments_text(body: str) -> tuple[str, bool]:
    """The arguments object's text in a hermes call body, as far as it has arrived, and whether it is complete (its
    closing brace seen: what follows belongs to the outer object)."""
    head = _HERMES_HEAD.match(body)
    if head is None:
        return "", False
    text, depth, in_string, escaped = body[head.end():], 0, False, False
    for at, char in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return text[:at + 1], True
    return text, False


def _merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """Consecutive deltas of one call as one (a call announced and closed in the same piece goes out whole)."""
    out: list[CallDelta] = []
    for delta in deltas:
        if out and out[-1].index == delta.index and delta.id is None:
            out[-1] = CallDelta(delta.index, out[-1].arguments + delta.arguments, out[-1].id, out[-1].name)
        elif delta.arguments or delta.id is not None:
            out.append(delta)
    return out
