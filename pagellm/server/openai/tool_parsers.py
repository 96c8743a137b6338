"""Tool calls parsed out of a model's free text, for ``tool_choice`` "auto" (``--enable-auto-tool-choice
--tool-call-parser NAME``, vLLM's flags and parser names).

Each parser knows one family's call syntax, as its chat template teaches it to the model:
- ``hermes`` (Qwen2/2.5/3, Hermes, and other templates that print ``<tools>``): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; text outside the tags is
  content.
- ``llama3_json`` (Llama 3.1/3.2 with JSON tool calling): the whole reply, after an optional ``<|python_tag|>``, is
  one or more JSON objects ``{"name": ..., "parameters": {...}}`` separated by ``;``.
- ``mistral`` (Mistral 7B Instruct v0.3 and other Mistral models of that tokenizer): the whole reply, after
  ``[TOOL_CALLS]`` (a special token: the detokenized text usually lacks it), is a JSON list of
  ``{"name": ..., "arguments": {...}}``.
- ``pythonic`` (Llama 3.2/4 and others that answer with Python): the whole reply is a Python list of calls with
  keyword arguments of literal values, ``[get_weather(city="Paris"), get_time()]``.
- ``phi4_mini_json`` (Phi-4-mini): the whole reply is ``functools`` and a JSON list of ``{"name": ...,
  "arguments": {...}}``.
- ``olmo3`` (OLMo 3): the whole reply ``<function_calls>``, a Python call per line, ``</function_calls>``.
- ``granite`` (Granite 3.x): prose, then ``<|tool_call|>`` (Granite 3.0, a special token: without it in the text,
  a list that opens the reply) or ``<tool_call>`` (3.1) and a JSON list of ``{"name": ..., "arguments": {...}}``,
  with no closing tag; text around it is content.
- ``qwen3_coder`` (Qwen3-Coder): each call is ``<function=NAME>`` with one ``<parameter=KEY>`` block of raw text per
  argument, between ``<tool_call>`` and ``</tool_call>``; a value takes the type its tool's schema gives (``for_tools``:
  strings stay text, numbers and booleans read as such, objects and arrays as JSON or Python literals, unknown
  parameters text). Its calls go out whole as each block closes.
- ``openai`` (gpt-oss): its harmony messages to ``functions.NAME``, which the chat server splits (``harmony.py``).

A ``--tool-parser-plugin`` file registers parsers of its own with ``@register_tool_parser("name")`` (``load_plugin``
runs it, once per process: in the server's, and in each Ray Serve replica that builds the app).

Contract:
- ``parse(text)`` → ``Parsed(content, calls)``: the calls found and the text that is not a call (None when there
  is none). Text that only looks like a call (JSON that does not parse, no ``name``, a list that is not of calls)
  stays content: nothing the model wrote is dropped.
- ``ToolCallStream`` (``tool_call_stream.py``) does the same for a streamed reply.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Callable, Optional

from pagellm.plugins import run_file
from pagellm.server.openai.harmony import HarmonyToolParser
from pagellm.server.openai.tool_parser_base import Parsed, ToolParser, as_content, json_call, make_call
from pagellm.server.openai.tools import ToolCall

__all__ = ["PARSERS", "Parsed", "ToolParser", "as_content", "get_parser", "load_plugin", "register_tool_parser"]


def _before_partial(text: str, markers: tuple[str, ...]) -> int:
    """Where a marker may be arriving at the end of ``text`` (its first characters there), else the end."""
    for keep in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-keep:]) for m in markers):
            return len(text) - keep
    return len(text)


class HermesParser(ToolParser):
    name = "hermes"
    streams_arguments = True
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def pieces(self, text: str) -> list[tuple[str, Optional[ToolCall], bool]]:
        """The text cut at the tags, in order: (raw text, its call or None, closed); the last block may be open."""
        pieces: list[tuple[str, Optional[ToolCall], bool]] = []
        at = 0
        while (start := text.find(self.OPEN, at)) >= 0:
            pieces.append((text[at:start], None, True))
            end = text.find(self.CLOSE, start)
            body_end, at = (end, end + len(self.CLOSE)) if end >= 0 else (len(text), len(text))
            pieces.append((text[start:at], self._block(text[start + len(self.OPEN):body_end]), end >= 0))
        pieces.append((text[at:], None, True))
        return pieces

    @staticmethod
    def _block(body: str) -> Optional[ToolCall]:
        try:
            return json_call(json.loads(body))
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
            return None

    def parse(self, text: str) -> Parsed:
        pieces = self.pieces(text)
        calls = [call for _, call, _ in pieces if call is not None]
        return Parsed(as_content("".join(raw for raw, call, _ in pieces if call is None)), calls)

    def content_end(self, text: str) -> int:
        start = text.find(self.OPEN)
        return start if start >= 0 else _before_partial(text, (self.OPEN,))

    def closed_calls(self, rest: str) -> list[ToolCall]:
        return [call for _, call, closed in self.pieces(rest) if call is not None and closed]

    def blocks(self, rest: str) -> list[tuple[str, Optional[ToolCall], bool]]:
        return [(raw[len(self.OPEN):len(raw) - len(self.CLOSE) if closed else len(raw)], call, closed)
                for raw, call, closed in self.pieces(rest) if raw.startswith(self.OPEN)]

    def text_outside(self, rest: str, announced: set[int]) -> str:
        text, number = [], 0
        for raw, _, _ in self.pieces(rest):
            if raw.startswith(self.OPEN):
                if number not in announced:
                    text.append(raw)
                number += 1
            else:
                text.append(raw)
        return "".join(text)

    def may_close(self, piece: str) -> bool:
        return ">" in piece  # the last character of </tool_call>


class WholeReplyParser(ToolParser):
    """Syntaxes where the whole reply is the calls: held from its first character when it opens like one."""

    opens: tuple[str, ...] = ()
    wrappers: tuple[tuple[str, str], ...] = ()  # special tokens around the calls, when the reply keeps them

    def content_end(self, text: str) -> int:
        head = text.lstrip()
        if not head or any(head.startswith(o) or o.startswith(head) for o in self.opens):
            return 0
        return len(text)

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        for before, after in self.wrappers:
            body = body.removeprefix(before).removesuffix(after).strip()
        calls = self.calls(body) if body.startswith(self.opens[:1]) else None
        return Parsed(None, calls) if calls else Parsed(as_content(text))

    def calls(self, body: str) -> Optional[list[ToolCall]]:
        raise NotImplementedError


class Llama3JsonParser(WholeReplyParser):
    name = "llama3_json"
    opens = ("{", "<|python_tag|>")
    wrappers = (("<|python_tag|>", "<|eom_id|>"),)

    def calls(self, body: str) -> Optional[list[ToolCall]]:
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                value, at = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):
                return None
            if (call := json_call(value)) is None:
                return None
            calls.append(call)
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return calls


class PythonicParser(WholeReplyParser):
    name = "pythonic"
    opens = ("[", "<|python_start|>")
    wrappers = (("<|python_start|>", "<|python_end|>"),)

    def calls(self, body: str) -> Optional[list[ToolCall]]:
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # not Python, or nested past the parser
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)) or node.args \
                    or any(k.arg is None for k in node.keywords):
                return None
            try:
                arguments = {k.arg: self.value(k.value) for k in node.keywords}
                call = make_call(ast.unparse(node.func), arguments)  # literals JSON cannot carry raise TypeError
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
            if call is None:
                return None
            calls.append(call)
        return calls


    @staticmethod
    def value(node: ast.expr) -> Any:
        """A keyword argument's value: a Python literal."""
        return ast.literal_eval(node)


class Olmo3Parser(PythonicParser):
    """OLMo 3: ``<function_calls>``, one Python call per line, ``</function_calls>``; values are Python literals or
    JSON's ``null``, ``true`` and ``false``."""

    name = "olmo3"
    opens = ("<function_calls>",)
    wrappers = (("<function_calls>", "</function_calls>"),)

    def calls(self, body: str) -> Optional[list[ToolCall]]:
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        return super().calls(f"[{', '.join(lines)}]") if lines else None

    def parse(self, text: str) -> Parsed:
        head = text.strip()
        if not head.startswith(self.opens[0]):
            return Parsed(as_content(text))
        calls = self.calls(head.removeprefix(self.opens[0]).removesuffix(self.wrappers[0][1]))
        return Parsed(None, calls) if calls else Parsed(as_content(text))

    @staticmethod
    def value(node: ast.expr) -> Any:
        return ast.literal_eval(_JsonNames().visit(node))


class _JsonNames(ast.NodeTransformer):
    """JSON's literal names as Python's constants, anywhere in a value."""

    NAMES = {"null": None, "true": True, "false": False}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(self.NAMES[node.id]) if node.id in self.NAMES else node


class MistralParser(WholeReplyParser):
    name = "mistral"
    opens = ("[", "[TOOL_CALLS]")
    wrappers = (("[TOOL_CALLS]", ""),)

    def calls(self, body: str) -> Optional[list[ToolCall]]:
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            return None
        calls = [json_call(item) for item in value] if isinstance(value, list) else []
        return calls if calls and all(call is not None for call in calls) else None  # type: ignore[return-value]


class Phi4MiniJsonParser(WholeReplyParser):
    name = "phi4_mini_json"
    opens = ("functools[",)

    def calls(self, body: str) -> Optional[list[ToolCall]]:
        try:
            value = json.loads(body.removeprefix("functools"))
        except (ValueError, RecursionError):
            return None
        calls = [json_call(item) for item in value] if isinstance(value, list) else []
        return calls if calls and all(call is not None for call in calls) else None  # type: ignore[return-value]


class GraniteParser(ToolParser):
    """Granite 3.x: prose, then ``<|tool_call|>`` (3.0's special token) or ``<tool_call>`` (3.1's text) and a JSON
    list of ``{"name": ..., "arguments": {...}}`` with no closing tag; text before the marker and after the list is
    content. A list that opens the reply is calls too (3.0's marker, a special token, is not in the text)."""

    name = "granite"
    MARKERS = ("<|tool_call|>", "<tool_call>")

    def _marker(self, text: str) -> tuple[int, int]:
        """Where the first marker starts and ends, or (-1, -1). A reply that opens with ``[`` counts as one whose
        marker was Granite 3.0's special token, which detokenizing drops."""
        found = [(at, at + len(m)) for m in self.MARKERS if (at := text.find(m)) >= 0]
        if found:
            return min(found)
        head = len(text) - len(text.lstrip())
        return (head, head) if text[head:head + 1] == "[" else (-1, -1)

    def _calls(self, text: str) -> Optional[tuple[str, list[ToolCall]]]:
        """(the text that is no call, the calls) where a marker is followed by a whole list of calls, else None."""
        start, end = self._marker(text)
        if start < 0:
            return None
        body = text[end:].lstrip()
        try:
            value, used = json.JSONDecoder().raw_decode(body)
        except (ValueError, RecursionError):
            return None
        calls = [json_call(item) for item in value] if isinstance(value, list) else []
        if not calls or any(call is None for call in calls):
            return None
        return text[:start] + body[used:], calls  # type: ignore[return-value]

    def parse(self, text: str) -> Parsed:
        found = self._calls(text)
        return Parsed(as_content(text)) if found is None else Parsed(as_content(found[0]), found[1])

    def content_end(self, text: str) -> int:
        start, _ = self._marker(text)
        return start if start >= 0 else _before_partial(text, self.MARKERS)

    def closed_calls(self, rest: str) -> list[ToolCall]:
        found = self._calls(rest)
        return [] if found is None else found[1]

    def may_close(self, piece: str) -> bool:
        return "]" in piece  # the list's end


class Qwen3CoderParser(HermesParser):
    name = "qwen3_coder"
    streams_arguments = False

    def __init__(self, schemas: Optional[dict[str, dict[str, Any]]] = None) -> None:
        self.schemas = schemas or {}  # each tool's parameters' schemas, by tool name

    def for_tools(self, tools: Optional[list[Any]]) -> ToolParser:
        schemas = {}
        for tool in tools or []:
            function = (tool.get("function") or {}) if isinstance(tool, dict) else {}
            properties = (function.get("parameters") or {}).get("properties")
            if isinstance(function.get("name"), str) and isinstance(properties, dict):
                schemas[function["name"]] = properties
        return Qwen3CoderParser(schemas)

    def _block(self, body: str) -> Optional[ToolCall]:  # type: ignore[override]
        match = _QWEN3_FUNCTION.fullmatch(body.strip())
        if match is None:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        schema = self.schemas.get(name, {})
        arguments = {}
        for key, value in _QWEN3_PARAMETER.findall(inner):
            key = key.strip()
            arguments[key] = _typed(value.removeprefix("\n").removesuffix("\n"), schema.get(key))
        if _QWEN3_PARAMETER.sub("", inner).strip():  # text between the parameters: not this syntax
            return None
        return make_call(name, arguments)

    def may_close(self, piece: str) -> bool:
        return ">" in piece


_QWEN3_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_QWEN3_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_INTEGER_TYPES = ("integer", "int")
_NUMBER_TYPES = ("number", "float", "double")


def _typed(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's raw text as the value its JSON schema describes (text when it says nothing)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    if value.strip().lower() == "null" and ("null" in kinds or not kinds):
        return None
    if not kinds or "string" in kinds:
        return value
    text = value.strip()
    for kind in kinds:
        try:
            if kind in _INTEGER_TYPES:
                return int(text)
            if kind in _NUMBER_TYPES:
                number = float(text)
                return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() \
                    else number
            if kind == "boolean" and text.lower() in ("true", "false"):
                return text.lower() == "true"
            if kind in ("object", "array"):
                return _literal(text)
        except (ValueError, SyntaxError, RecursionError):
            continue
    return value


def _literal(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return ast.literal_eval(text)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                            PythonicParser, Qwen3CoderParser, Phi4MiniJsonParser,
                                                            GraniteParser, Olmo3Parser, HarmonyToolParser)}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))} (or "
                         "register one in a --tool-parser-plugin file)")
    return PARSERS[name]()


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator of a ``--tool-parser-plugin`` file: serve the ``ToolParser`` subclass as ``name``."""
    def register(cls: type[ToolParser]) -> type[ToolParser]:
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise ValueError(f"tool-call parser {name!r} must be a subclass of pagellm's ToolParser")
        if name in PARSERS and PARSERS[name] is not cls:
            raise ValueError(f"a tool-call parser named {name!r} exists already; register yours as another name")
        cls.name = name
        PARSERS[name] = cls
        return cls

    return register


def load_plugin(path: str) -> None:
    """Run a ``--tool-parser-plugin`` file once per process (it registers parsers); ValueError when it fails."""
    run_file(path, "--tool-parser-plugin")
