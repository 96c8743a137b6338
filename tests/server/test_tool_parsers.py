"""The tool-call parsers of tool_choice 'auto' (``tool_parsers.py``): each family's syntax becomes calls, what only
looks like a call stays content, and a stream fed in any pieces gives the same calls and content as the whole text,
holding back nothing that is content and sending nothing that is part of a call; hermes calls stream their name
first and then their arguments' text as it comes."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from pagellm.server.openai.tool_call_stream import ToolCallStream
from pagellm.server.openai.tool_parsers import PARSERS, Parsed, ToolParser, get_parser
from pagellm.server.openai.tools import FunctionCall, ToolCall
from pagellm.server.options import add_serve_args, serve_options

HERMES_TWO = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>')
QWEN3_TWO = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
             "<parameter=zone>\na <b> c\nd\n</parameter>\n</function>\n</tool_call>")
CASES = [  # (parser, text, content, [(name, arguments)])
    ("hermes", HERMES_TWO, "Let me look.", [("get_weather", {"city": "Paris", "days": 2}),
                                            ("get_time", {"zone": "cet"})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, null]}"}</tool_call>', None,
     [("f", {"a": [1, None]})]),  # arguments written as JSON text
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),  # stopped unclosed
    ("hermes", "Paris is sunny; <tool_ no tags here > at all.", "Paris is sunny; <tool_ no tags here > at all.", []),
    ("hermes", "<tool_call>{not json}</tool_call> sorry", "<tool_call>{not json}</tool_call> sorry", []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}', '<tool_call>{"name": "f", "arguments": {"a": 1}',
     []),  # cut short inside the call: the text comes back
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", {"a": 1}), ("g", {})]),
    ("llama3_json", ' {"name": "f", "arguments": {"é": "ü"}} ', None, [("f", {"é": "ü"})]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and then some words', None, None),
    ("llama3_json", "The weather in Paris is {mild}.", "The weather in Paris is {mild}.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "g", "arguments": '
                '{}}]', None, [("get_weather", {"city": "Paris"}), ("g", {})]),
    ("mistral", '[{"name": "f", "arguments": {"a": [1]}}]', None, [("f", {"a": [1]})]),  # the marker skipped
    ("mistral", "[1] is the first citation.", "[1] is the first citation.", []),
    ("mistral", '[{"name": "f"}, {"oops": 1}]', '[{"name": "f"}, {"oops": 1}]', []),
    ("mistral", "[]", "[]", []),
    ("pythonic", '[get_weather(city="Paris", days=2), clock.now(precise=True, extra=None)]', None,
     [("get_weather", {"city": "Paris", "days": 2}), ("clock.now", {"precise": True, "extra": None})]),
    ("pythonic", "[f(a={'x': [1, 2.5]}, b=(1, 2))]", None, [("f", {"a": {"x": [1, 2.5]}, "b": [1, 2]})]),
    ("pythonic", "<|python_start|>[f()]<|python_end|>", None, [("f", {})]),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "[f(x)]", "[f(x)]", []),  # positional arguments have no names to send
    ("pythonic", "[f(a=len('x'))]", "[f(a=len('x'))]", []),  # not a literal
    ("pythonic", "[f(a={1, 2})]", "[f(a={1, 2})]", []),  # a set: JSON has none
    ("pythonic", "Use [brackets] for lists.", "Use [brackets] for lists.", []),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "g", '
                       '"parameters": {}}]', None, [("get_weather", {"city": "Paris"}), ("g", {})]),
    ("phi4_mini_json", "functools are handy.", "functools are handy.", []),
    ("phi4_mini_json", 'functools[{"name": "f"}, 3]', 'functools[{"name": "f"}, 3]', []),
    ("granite", 'Let me check.<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "g", '
                '"arguments": {}}]', "Let me check.", [("get_weather", {"city": "Paris"}), ("g", {})]),  # 3.1
    ("granite", '<|tool_call|> [{"name": "f", "arguments": {"a": [1]}}] Done.', "Done.", [("f", {"a": [1]})]),  # 3.0
    ("granite", '[{"name": "f", "arguments": {"a": 1}}]', None, [("f", {"a": 1})]),  # 3.0's marker skipped
    ("granite", "[1] is the first citation.", "[1] is the first citation.", []),
    ("granite", '<tool_call>[{"name": "f"}, {"oops": 1}]', '<tool_call>[{"name": "f"}, {"oops": 1}]', []),
    ("granite", "Use <tool_call> with a list.", "Use <tool_call> with a list.", []),
    ("olmo3", '<function_calls>\nget_weather(city="Paris", days=2)\nnotify(urgent=true, note=null, tags=[false])\n'
              '</function_calls>', None, [("get_weather", {"city": "Paris", "days": 2}),
                                         ("notify", {"urgent": True, "note": None, "tags": [False]})]),
    ("olmo3", "<function_calls>\nf()\n", None, [("f", {})]),  # stopped before the closing tag
    ("olmo3", "<function_calls>\nnot a call\n</function_calls>", "<function_calls>\nnot a call\n</function_calls>",
     []),
    ("olmo3", "<function_calls>\nf(a=len(x))\n</function_calls>", "<function_calls>\nf(a=len(x))\n</function_calls>",
     []),  # not a literal
    ("olmo3", 'get_weather(city="Paris")', 'get_weather(city="Paris")', []),  # no tags: text
    ("qwen3_coder", QWEN3_TWO, "Checking.", [("get_weather", {"city": "Paris", "days": "2"}),
                                             ("get_time", {"zone": "a <b> c\nd"})]),  # no tools sent: text
    ("qwen3_coder", "<tool_call><function=f></function></tool_call>", None, [("f", {})]),
    ("qwen3_coder", "<tool_call>\n<function=f>\nfree text\n</function>\n</tool_call>",
     "<tool_call>\n<function=f>\nfree text\n</function>\n</tool_call>", []),  # not parameters: content
    ("qwen3_coder", "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
     "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>", []),  # no function
]


def _calls(calls: list) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_reply_parses_into_its_calls_and_the_text_that_is_none(parser: str, text: str, content, calls) -> None:
    parsed = get_parser(parser).parse(text)
    if calls is None:  # trailing words after a JSON call: the whole reply is text
        assert parsed.calls == [] and parsed.content == text.strip()
        return
    assert _calls(parsed.calls) == calls and parsed.content == content
    assert all(c.id.startswith("chatcmpl-tool-") for c in parsed.calls) and len({c.id for c in parsed.calls}) == \
        len(parsed.calls)


def _joined(deltas: list) -> list:
    """Streamed call pieces joined into calls (as a client does: the first piece of an index names it)."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.id is not None:
            assert delta.index == len(calls) and delta.name
            calls[delta.index] = ToolCall(id=delta.id, function=FunctionCall(name=delta.name, arguments=""))
        calls[delta.index].function.arguments += delta.arguments
    return list(calls.values())


def _stream(parser: str | ToolParser, text: str, cuts: list[int], limit=None) -> tuple[str, list, list[str]]:
    """A stream of ``text`` cut at ``cuts``: (its content, its calls, the content each piece sent)."""
    chosen = get_parser(parser) if isinstance(parser, str) else parser
    stream, content, deltas, sent = ToolCallStream(chosen, limit), "", [], []
    for start, end in zip([0] + cuts, cuts + [len(text)]):
        piece, more = stream.feed(text[start:end])
        content, deltas, sent = content + piece, deltas + more, sent + [piece]
    piece, more = stream.finish()
    return content + piece, _joined(deltas + more), sent


CUT_INSIDE = '<tool_call>{"name": "f", "arguments": {"a": 1}'  # cut short before the call's closing brace


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [c for c in CASES if c[1] != CUT_INSIDE])
def test_a_stream_in_any_pieces_gives_what_the_whole_text_gives(parser: str, text: str, content, calls) -> None:
    whole = get_parser(parser).parse(text)
    rng = random.Random(len(text))
    for cuts in ([], list(range(1, len(text))), sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))):
        streamed, streamed_calls, _ = _stream(parser, text, cuts)
        assert _calls(streamed_calls) == _calls(whole.calls)
        assert (streamed.strip() or None) == whole.content


def test_a_hermes_call_cut_short_after_it_was_announced_goes_out_as_far_as_it_came() -> None:
    """Whole, the cut reply is text (its JSON does not parse); streamed, the call was announced once its name and
    arguments began, so it stays a call with the arguments that arrived, as vLLM's stream does."""
    for cuts in ([], list(range(1, len(CUT_INSIDE)))):
        content, calls, _ = _stream("hermes", CUT_INSIDE, cuts)
        assert content == "" and _calls(calls) == [("f", {"a": 1})]


def test_granite_streams_its_prose_at_once_and_its_calls_when_the_list_closes() -> None:
    stream = ToolCallStream(get_parser("granite"))
    assert stream.feed("Checking") == ("Checking", [])
    assert stream.feed(". <tool") == (". ", [])  # '<tool' may become '<tool_call>'
    assert stream.feed('_call>[{"name": "f", "arguments": {"a": 1}}') == ("", [])
    content, deltas = stream.feed("]")
    assert content == "" and _calls(_joined(deltas)) == [("f", {"a": 1})] and stream.called
    assert stream.finish() == ("", [])


def test_hermes_streams_content_at_once_and_holds_only_what_may_open_a_call() -> None:
    stream = ToolCallStream(get_parser("hermes"))
    assert stream.feed("Let me look") == ("Let me look", [])
    assert stream.feed(". <tool") == (". ", [])  # '<tool' may become '<tool_call>'
    assert stream.feed("box> is a tag") == ("<toolbox> is a tag", [])
    assert stream.feed(" <tool_call>{\"name\": \"f\", ") == (" ", [])
    content, deltas = stream.feed("\"arguments\": {}}</tool_call>")
    assert content == "" and _calls(_joined(deltas)) == [("f", {})] and stream.called
    assert stream.feed(" done") == ("", []) and stream.finish() == ("done", [])


def test_hermes_streams_the_name_first_then_the_arguments_as_they_come() -> None:
    stream = ToolCallStream(get_parser("hermes"))
    assert stream.feed('<tool_call>\n{"name": "get_wea') == ("", [])
    assert stream.feed('ther", "arguments": ') == ("", [])
    (head,) = stream.feed("{")[1]  # the name is known and the arguments object opens: the call is announced
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "{") and head.id.startswith("chatcmpl-tool-")
    pieces = [stream.feed(p)[1] for p in ('"city": "Pa', 'ris \\"}', '", "days"', ': 2}', "}\n</tool_call>")]
    assert [[(d.index, d.id, d.arguments) for d in p] for p in pieces] == [
        [(0, None, '"city": "Pa')], [(0, None, 'ris \\"}')], [(0, None, '", "days"')], [(0, None, ": 2}")], []]
    assert json.loads("{" + "".join(d.arguments for p in pieces for d in p)) == {"city": 'Paris "}', "days": 2}
    content, deltas = stream.feed('<tool_call>{"arguments": {"zone": "cet"}, "name": "get_time"}</tool_call>')
    assert content == "" and [(d.index, d.name, json.loads(d.arguments)) for d in deltas] == [
        (1, "get_time", {"zone": "cet"})]  # name after the arguments: whole, once it closes
    assert stream.finish() == ("", [])


def test_each_call_goes_out_when_it_closes_and_parallel_calls_off_keeps_the_first() -> None:
    text = HERMES_TWO
    first_close = text.index("</tool_call>") + len("</tool_call>")
    stream = ToolCallStream(get_parser("hermes"))
    _, deltas = stream.feed(text[:first_close])
    assert _calls(_joined(deltas)) == [("get_weather", {"city": "Paris", "days": 2})]
    _, more = stream.feed(text[first_close:])
    assert _calls(_joined(deltas + more)[1:]) == [("get_time", {"zone": "cet"})] and stream.finish() == ("", [])
    for parser, reply in (("hermes", text), ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", '
                                                            '"parameters": {}}')):
        content, calls, _ = _stream(parser, reply, list(range(1, len(reply))), limit=1)
        assert len(calls) == 1 and calls[0].function.name in ("get_weather", "f")


def test_whole_reply_syntaxes_hold_a_reply_that_opens_like_a_call_and_stream_any_other() -> None:
    for parser, reply in (("llama3_json", '  {"name": "f", "parameters": {}}'), ("pythonic", "\n[f(a=1)]")):
        _, calls, sent = _stream(parser, reply, list(range(1, len(reply))))
        assert sent == [""] * len(reply) and len(calls) == 1  # nothing of a call ever went out as content
    _, _, sent = _stream("pythonic", "Sure: [f(a=1)]", list(range(1, 14)))
    assert sent[:2] == ["S", "u"]  # content flows as soon as the reply cannot be a call


def test_the_parser_flags_as_vllm_spells_them() -> None:
    cmd = argparse.ArgumentParser()
    add_serve_args(cmd)
    assert serve_options(cmd.parse_args([])).tool_call_parser is None
    assert serve_options(cmd.parse_args(["--tool-call-parser", "hermes"])).tool_call_parser is None  # not enabled
    args = cmd.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert serve_options(args).tool_call_parser == "llama3_json"
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        serve_options(cmd.parse_args(["--enable-auto-tool-choice"]))
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "phi4_mini_json", "pythonic", "qwen3_coder",
                            "granite", "olmo3", "openai"}
    with pytest.raises(ValueError, match="unknown tool-call parser 'granite4'; choose one of granite, hermes"):
        get_parser("granite4")


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_text_nested_past_any_parser_stays_content(parser: str) -> None:
    for deep in ("[" * 100_000, "{\"name\": \"f\", \"arguments\": " + "[" * 100_000,
                 "<tool_call>" + "[" * 100_000 + "</tool_call>", "[f(a=" + "[" * 100_000 + ")]"):
        assert get_parser(parser).parse(deep) == Parsed(deep)


QWEN3_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "scale": {"type": "number"}, "tags": {"type": "array"},
    "opts": {"type": "object"}, "note": {"type": ["string", "null"]}, "limit": {"type": ["integer", "null"]}}}


def test_qwen3_coder_reads_each_parameter_as_its_schema_types_it() -> None:
    """Values are raw text; the tool's schema says what each is (as the model's template printed them)."""
    values = {"city": "New York", "zip": "02134", "days": "3", "metric": "True", "ratio": "0.5", "scale": "2",
              "tags": '["a", "b"]', "opts": "{'deep': [1, None]}", "note": "null", "limit": "null",
              "unknown": "7", "bad_days": "3"}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    text = f"<tool_call>\n<function=search>\n{body}</function>\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "search", "parameters": QWEN3_SCHEMA}},
             {"type": "function", "function": {"name": "other"}}]
    parser = get_parser("qwen3_coder").for_tools(tools)
    assert _calls(parser.parse(text).calls) == [("search", {
        "city": "New York", "zip": "02134", "days": 3, "metric": True, "ratio": 0.5, "scale": 2, "tags": ["a", "b"],
        "opts": {"deep": [1, None]}, "note": None, "limit": None, "unknown": "7", "bad_days": "3"})]
    wrong = text.replace("<parameter=days>\n3\n", "<parameter=days>\nthree\n")
    assert json.loads(parser.parse(wrong).calls[0].function.arguments)["days"] == "three"  # not an integer: text
    streamed, calls, _ = _stream(parser, text, list(range(1, len(text))))
    assert _calls(calls) == _calls(parser.parse(text).calls) and streamed == ""
    assert get_parser("hermes").for_tools(tools).name == "hermes"

