"""Function calling through the ``openai`` SDK: a ``tool_choice`` naming a function makes the reply a call of it
whose arguments follow its ``parameters`` schema, whole or streamed (the first delta with id and name, the rest
argument text), ``content`` null and ``finish_reason`` "stop"; ``required`` makes it a list of calls of the tools
sent (one with ``parallel_tool_calls`` false; streamed whole once the list closes), "tool_calls", or the text when
``max_tokens`` cut it short; ``auto`` on a server started with a tool-call parser returns the calls the model wrote
(here forced by a regex, so that a random model writes them) and its other text as content; what cannot be
honoured (``auto`` on a server without a parser, ``required`` without tools, a name not among the tools, a second
constraint, a malformed tool) is a 400 that says what works."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import openai
import pytest
from server_utils import ServerProcess

from pagellm.server.openai import tools

CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMETERS = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2]}},
              "required": ["unit", "days"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}  # every schema here has finitely many values: a random model's reply ends
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _check_arguments(arguments: str) -> None:
    value = json.loads(arguments)
    assert value["unit"] in ("celsius", "fahrenheit") and value["days"] in (1, 2) and set(value) == {"unit", "days"}


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=64, n=2, seed=5)
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
        _check_arguments(call.function.arguments)
    # a response_format beside a forced call shapes text replies, which this turn's is not: the call wins (as in
    # OpenAI's API and vLLM)
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object", "properties": {
        "a": {"type": "string"}}, "required": ["a"]}}}
    reply = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice=NAMED,
                                           response_format=schema, max_tokens=64, seed=5)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _check_arguments(call.function.arguments)


def test_a_named_call_streams_its_id_and_name_first_then_argument_text(client: openai.OpenAI) -> None:
    """A consumer that falls behind gets its queued deltas merged (the whole call may come as one), which is checked
    the same way; such a stream shows nothing of the argument text's deltas, so it is asked for again (three tries)."""
    pieces = []
    for seed in (6, 16, 26):
        stream = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice=NAMED,
                                                max_tokens=64, stream=True, seed=seed)
        calls, finish = [], None
        for chunk in stream:
            (choice,) = chunk.choices
            finish = choice.finish_reason or finish
            calls += choice.delta.tool_calls or []
            assert not choice.delta.content
        assert calls[0].id.startswith("chatcmpl-tool-") and calls[0].function.name == "get_weather"
        assert all(c.id is None and c.function.name is None and c.index == 0 for c in calls[1:])
        _check_arguments("".join(c.function.arguments for c in calls))
        assert finish == "stop"
        pieces.append(len(calls))
        if len(calls) > 1:
            break
    assert pieces[-1] > 1, f"every stream came as one merged delta: {pieces}"


def test_required_lists_calls_of_the_tools_sent(client: openai.OpenAI) -> None:
    # one call per reply (parallel_tool_calls false bounds the list, so a random model's reply always ends)
    reply = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, n=4, seed=7)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("chatcmpl-tool-")
        if call.function.name == "get_weather":
            _check_arguments(call.function.arguments)
        else:
            assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    cut = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                         max_tokens=3, seed=9)
    (choice,) = cut.choices
    assert choice.finish_reason == "length" and choice.message.tool_calls is None and choice.message.content


def test_required_streams_its_calls_whole_once_the_list_closes(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=200, n=2, seed=11, stream=True)
    calls: dict[int, list] = {0: [], 1: []}
    finish: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            calls[choice.index] += choice.delta.tool_calls or []
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for index in (0, 1):
        (call,) = calls[index]
        assert call.index == 0 and call.id.startswith("chatcmpl-tool-") and call.type == "function"
        assert call.function.name in ("get_weather", "get_time") and json.loads(call.function.arguments)


def test_required_allows_several_calls_unless_parallel_calls_are_off() -> None:
    schema = tools.constraint(TOOLS, "required")["tool_choice"]["json"]
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [item["properties"]["name"] for item in schema["items"]["anyOf"]] == [{"enum": ["get_weather"]},
                                                                                  {"enum": ["get_time"]}]
    assert tools.constraint(TOOLS, "required", parallel=False)["tool_choice"]["json"]["maxItems"] == 1
    text = '[{"name": "get_time", "parameters": {"zone": "utc"}}, {"name": "get_weather", "parameters": {"unit": ' \
           '"celsius", "days": 1}}]'
    calls = tools.required_calls(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_time", {"zone": "utc"}), ("get_weather", {"unit": "celsius", "days": 1})]
    assert len({c.id for c in calls}) == 2 and tools.required_calls(text[:-5]) is None


@pytest.mark.parametrize(("settings", "message"), [
    ({"tools": TOOLS}, "tool_choice 'auto' (the default with tools) needs a tool-call parser; start the server with "
                       "--enable-auto-tool-choice --tool-call-parser NAME for it, or name a function"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice 'auto' needs a tool-call parser"),
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names 'nope', which is not among the tools sent"),
    ({"tools": TOOLS, "tool_choice": NAMED, "extra_body": {"structured_outputs": {"regex": "a+"}}},
     "give at most one structured-output constraint, got structured_outputs, tool_choice"),
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "none"}, "each tool must be"),
])
def test_what_cannot_be_honoured_is_a_400_saying_what_works(client: openai.OpenAI, settings: dict,
                                                            message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, **settings)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", "days": 2}}\n</tool_call>'
SECOND = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'


@pytest.fixture(scope="module")
def hermes(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> openai.OpenAI:
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def _reply(text: str) -> dict:
    """A request body's extra fields that make the random model write exactly ``text``."""
    return {"structured_outputs": {"regex": re.escape(text)}}


def test_auto_returns_the_calls_the_model_wrote_and_its_other_text_as_content(hermes: openai.OpenAI) -> None:
    reply = hermes.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=200,
                                           extra_body=_reply(f"Let me look.\n{CALL}\n{SECOND}"))
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"unit": "celsius", "days": 2}), ("get_time", {"zone": "utc"})]
    one = hermes.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="auto",
                                         parallel_tool_calls=False, max_tokens=200, extra_body=_reply(CALL + SECOND))
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    text = hermes.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=50,
                                          extra_body=_reply("Sunny, 21 <b>degrees</b>."))
    assert text.choices[0].finish_reason == "stop" and text.choices[0].message.tool_calls is None
    assert text.choices[0].message.content == "Sunny, 21 <b>degrees</b>."


def test_auto_streams_content_as_it_comes_and_each_calls_arguments_as_they_come(hermes: openai.OpenAI) -> None:
    stream = hermes.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=200, stream=True,
                                            extra_body=_reply(f"Let me look.\n{CALL}\n{SECOND}"))
    content, pieces, finish = "", [], None
    for chunk in stream:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        pieces += choice.delta.tool_calls or []
        finish = choice.finish_reason or finish
    assert content == "Let me look.\n" and finish == "tool_calls"  # no piece of a tag went out as content
    firsts = [p for p in pieces if p.id is not None]  # each call's first piece: its id, type and name
    assert [(p.index, p.type, p.function.name) for p in firsts] == [(0, "function", "get_weather"),
                                                                    (1, "function", "get_time")]
    assert all(p.id.startswith("chatcmpl-tool-") for p in firsts)
    arguments = ["".join(p.function.arguments or "" for p in pieces if p.index == i) for i in (0, 1)]
    assert [json.loads(a) for a in arguments] == [{"unit": "celsius", "days": 2}, {"zone": "utc"}]
    assert sum(p.index == 0 for p in pieces) > 2  # the arguments came in pieces, as the model wrote them
    plain = hermes.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=50, stream=True,
                                           extra_body=_reply("No <tool_call needed."), stream_options={
                                               "include_usage": True})
    chunks = [c for c in plain]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "No <tool_call needed."
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks) and chunks[-1].usage.completion_tokens


QWEN3_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
QWEN3_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
              "</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_calls_carry_the_types_of_the_requests_tools(start_server: Callable[..., ServerProcess],
                                                                   tiny_llama: Path) -> None:
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--enable-auto-tool-choice",
                          "--tool-call-parser", "qwen3_coder")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=CHAT, tools=QWEN3_TOOLS, max_tokens=200,
                                           extra_body=_reply(f"Sure.\n{QWEN3_CALL}"))
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    stream = client.chat.completions.create(model="tiny", messages=CHAT, tools=QWEN3_TOOLS, max_tokens=200,
                                            stream=True, extra_body=_reply(f"Sure.\n{QWEN3_CALL}"))
    pieces = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(p.content or "" for p in pieces).strip() == "Sure."
    calls = [call for p in pieces for call in p.tool_calls or []]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]


PLUGIN = '''
import json

from pagellm.server.openai.tool_parsers import WholeReplyParser, register_tool_parser
from pagellm.server.openai.tools import FunctionCall, ToolCall, call_id


@register_tool_parser("arrows")
class ArrowsParser(WholeReplyParser):
    """One call per line: >> name {json arguments}."""

    opens = (">>",)

    def calls(self, body):
        calls = []
        for line in body.splitlines():
            name, _, arguments = line.removeprefix(">>").strip().partition(" ")
            calls.append(ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments or "{}")))
        return calls
'''


def test_a_plugin_file_registers_a_parser_of_its_own(start_server: Callable[..., ServerProcess], tiny_llama: Path,
                                                      tmp_path: Path) -> None:
    """vLLM's --tool-parser-plugin: a file whose parser --tool-call-parser then names; a name no parser has, or a
    plugin that fails, stops the server before it starts."""
    plugin = tmp_path / "arrows.py"
    plugin.write_text(PLUGIN)
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--enable-auto-tool-choice",
                          "--tool-parser-plugin", str(plugin), "--tool-call-parser", "arrows")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    wrote = '>> get_weather {"unit": "celsius", "days": 1}\n>> get_time {"zone": "cet"}'
    reply = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=200,
                                           extra_body=_reply(wrote))
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"unit": "celsius", "days": 1}), ("get_time", {"zone": "cet"})]
    with pytest.raises(RuntimeError, match="unknown tool-call parser 'arrowz'; choose one of .*hermes"):
        start_server(tiny_llama, "--enable-auto-tool-choice", "--tool-parser-plugin", str(plugin),
                     "--tool-call-parser", "arrowz")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('the plugin is broken')\n")
    with pytest.raises(RuntimeError, match="--tool-parser-plugin .*broken.py failed: RuntimeError: the plugin is"):
        start_server(tiny_llama, "--tool-parser-plugin", str(broken))
