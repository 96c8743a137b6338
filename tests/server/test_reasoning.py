"""A reasoning model's thinking apart from its answer (``--reasoning-parser``): the parsers on texts, fed whole or
in any pieces, and a live server through the ``openai`` SDK on a random model whose tokenizer has Qwen3's think
tokens. There a logit bias makes the model think ("<think>a</think>") and a constraint, which waits for
``</think>``, makes it answer (text and a tool call, JSON, a named call); the response carries each part in its
field, whole and streamed. A prompt whose template closed the block (thinking off) is constrained from the start."""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import openai
import pytest
from server_utils import ServerProcess, think_first

from pagellm.server.openai.protocol import ChatCompletionRequest
from pagellm.server.openai.reasoning import ReasoningStream
from pagellm.server.openai.serving_chat import OpenAIServingChat
from pagellm.server.options import add_serve_args, serve_options
from pagellm.tokenizer import Tokenizer

CASES = [  # (parser, reply, thinking, answer)
    ("deepseek_r1", "Two and two.\n</think>\n\nIt is 4.", "Two and two.\n", "It is 4."),
    ("deepseek_r1", "<think>\nTwo and two.\n</think>It is 4.", "\nTwo and two.\n", "It is 4."),
    ("deepseek_r1", "Still thinking when max_tokens ran o", "Still thinking when max_tokens ran o", ""),
    ("deepseek_r1", "</think>\n\nNo thoughts.", None, "No thoughts."),
    ("deepseek_r1", "a < b, so </thin", "a < b, so </thin", ""),
    ("olmo3", "Two and two.</think>\n\nIt is 4.", "Two and two.", "It is 4."),
    ("olmo3", "<think>Two and two.</think>It is 4.", "Two and two.", "It is 4."),
    ("olmo3", "Cut sh", "Cut sh", ""),
    ("qwen3", "<think>\nTwo and two.\n</think>\n\nIt is 4.", "\nTwo and two.\n", "It is 4."),
    ("qwen3", "\n<think>cut sh", "cut sh", ""),
    ("qwen3", "It is 4.", None, "It is 4."),
    ("qwen3", "<thinking> is not the tag", None, "<thinking> is not the tag"),
    ("qwen3", "It is 4. </think> stays", None, "It is 4. </think> stays"),
    ("qwen3", "<think></think>\n\n", None, ""),
    ("qwen3", "  <thi", None, "  <thi"),
    ("granite", "Here is my thought process:\nTwo and two.\n\nHere is my response:\nIt is 4.", "\nTwo and two.\n\n",
     "It is 4."),
    ("granite", "Here's my thought process: Two. Here's my response: It is 4.", " Two. ", "It is 4."),
    ("granite", " Here is my thought process: Mixed. Here's my response: 4.", " Mixed. ", "4."),
    ("granite", "It is 4. Here is my response: 4.", None, "It is 4. Here is my response: 4."),
    ("granite", "Here is my thought process: a Here's my response: b Here is my response: c", " a ",
     "b Here is my response: c"),
    ("granite", "Here is what I think: 4.", None, "Here is what I think: 4."),
    ("granite", "Here is my thought process: cut short at Here is my resp", " cut short at Here is my resp", ""),
]
# after a prompt that closed the block
CLOSED = ["It is 4.", "It is 4. </think>", "<think>x</think>y", "Here is my thought process: x"]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3", "olmo3", "granite"])
@pytest.mark.parametrize("reply", CLOSED)
def test_after_a_prompt_that_closed_the_block_the_reply_is_all_answer(parser: str, reply: str) -> None:
    assert ReasoningStream(parser, closed=True).split(reply) == (None, reply)


@pytest.mark.parametrize(("parser", "reply", "thinking", "answer"), CASES)
def test_thinking_and_answer_are_split_alike_whole_and_in_any_pieces(parser: str, reply: str, thinking, answer) -> None:
    assert ReasoningStream(parser).split(reply) == (thinking, answer)
    rng = random.Random(len(reply))
    for cuts in (list(range(1, len(reply))), sorted(rng.sample(range(1, len(reply)), 4))):
        stream, got_thinking, got_answer = ReasoningStream(parser), "", ""
        for start, end in zip([0] + cuts, cuts + [len(reply)]):
            piece_thinking, piece_answer = stream.feed(reply[start:end])
            assert "</think>" not in piece_thinking + piece_answer or answer and "</think>" in answer
            got_thinking, got_answer = got_thinking + piece_thinking, got_answer + piece_answer
        rest_thinking, rest_answer = stream.finish()
        assert ((got_thinking + rest_thinking) or None, got_answer + rest_answer) == (thinking, answer)


def test_thinking_streams_as_it_comes_holding_only_a_partial_tag() -> None:
    stream = ReasoningStream("qwen3")
    assert stream.feed("<thi") == ("", "")  # may be <think>
    assert stream.feed("nk>Two and") == ("Two and", "")
    assert stream.feed(" two.</th") == (" two.", "")  # may be </think>
    assert stream.feed("ink>\n") == ("", "")  # the gap before the answer is dropped
    assert stream.feed("\nIt is") == ("", "It is")
    assert stream.feed(" 4.") == ("", " 4.") and stream.finish() == ("", "")


def test_the_flag_takes_vllm_names_and_refuses_others() -> None:
    cmd = argparse.ArgumentParser()
    add_serve_args(cmd)
    assert serve_options(cmd.parse_args([])).reasoning_parser is None
    assert serve_options(cmd.parse_args(["--reasoning-parser", "deepseek_r1"])).reasoning_parser == "deepseek_r1"
    with pytest.raises(ValueError, match="unknown reasoning parser 'kimi_k2'; choose one of deepseek_r1, qwen3"):
        serve_options(cmd.parse_args(["--reasoning-parser", "kimi_k2"]))
    with pytest.raises(ValueError, match="unknown reasoning parser 'kimi_k2'; choose one of deepseek_r1, qwen3"):
        ReasoningStream("kimi_k2")


# A plugin for Magistral-style tags; each test that uses it runs it (once per process).
PLUGIN = """from pagellm.server.openai.reasoning import register_reasoning_parser

register_reasoning_parser("brackets", start="[THINK]", end="[/THINK]")
"""


def _plugin(folder: Path) -> str:
    (folder / "brackets.py").write_text(PLUGIN)
    return str(folder / "brackets.py")


def test_a_plugin_file_registers_a_parser_of_its_own_tags(tmp_path: Path) -> None:
    """vLLM's --reasoning-parser-plugin: its parser splits at its own tags, and --reasoning-parser names it; a plugin
    that fails, or a name taken with other tags, is refused by name."""
    cmd = argparse.ArgumentParser()
    add_serve_args(cmd)
    args = cmd.parse_args(["--reasoning-parser-plugin", _plugin(tmp_path), "--reasoning-parser", "brackets"])
    assert serve_options(args).reasoning_parser == "brackets"
    assert ReasoningStream("brackets").split("[THINK]Two and two.[/THINK]\n\nIt is 4.") == ("Two and two.", "It is 4.")
    assert ReasoningStream("brackets").split("<think>x</think>y") == (None, "<think>x</think>y")
    (tmp_path / "broken.py").write_text("raise RuntimeError('the plugin is broken')\n")
    with pytest.raises(ValueError, match="--reasoning-parser-plugin .*broken.py failed: RuntimeError: the plugin"):
        serve_options(cmd.parse_args(["--reasoning-parser-plugin", str(tmp_path / "broken.py")]))
    (tmp_path / "clash.py").write_text(PLUGIN.replace('"brackets", start="[THINK]"', '"qwen3", start="[T]"'))
    with pytest.raises(ValueError, match="a reasoning parser named 'qwen3' exists already"):
        serve_options(cmd.parse_args(["--reasoning-parser-plugin", str(tmp_path / "clash.py")]))


def test_a_server_splits_at_a_plugins_tags(start_server: Callable[..., ServerProcess], tiny_llama: Path,
                                           tmp_path: Path) -> None:
    """Served: a model whose tokenizer has [THINK] and [/THINK] (ids 260, 261) thinks "a" (a logit bias orders the
    tokens), and a constraint that waits for the plugin's end tag shapes the answer."""
    model = tmp_path / "brackets-model"
    shutil.copytree(tiny_llama, model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens(["[THINK]", "[/THINK]"])
    tokenizer.save_pretrained(model)
    server = start_server(model, "--served-model-name", "tiny", "--reasoning-parser-plugin", _plugin(tmp_path),
                          "--reasoning-parser", "brackets")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    body = {"logit_bias": {"260": 60, "64": 50, "261": 40}, "structured_outputs": {"regex": re.escape("It is 4.")},
            "bad_words": ["[THINK][THINK]", "[THINK][/THINK]", "a[THINK]", "aa"]}
    message = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40,
                                             extra_body=body).choices[0].message
    assert message.reasoning_content == "a" and message.content == "It is 4."


CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = f"\n\nLet me look.\n{CALL}"
@pytest.fixture(scope="module")
def client(thinker_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{thinker_server.base_url}/v1", api_key="x", max_retries=0)


def _forced(text: str) -> dict:
    return think_first(structured_outputs={"regex": re.escape(text)})


def test_the_model_thinks_then_the_constraint_shapes_its_answer_and_calls(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=200,
                                           extra_body=_forced(ANSWER))
    (choice,) = reply.choices
    message = choice.message
    assert message.reasoning_content == "a" and message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert choice.finish_reason == "tool_calls"
    hidden = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=200,
                                            extra_body={**_forced(ANSWER), "include_reasoning": False})
    assert hidden.choices[0].message.reasoning_content is None and hidden.choices[0].message.content == "Let me look."


def test_json_and_named_calls_come_after_the_thinking(client: openai.OpenAI) -> None:
    schema = TOOLS[0]["function"]["parameters"]
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, response_format=fmt,
                                           extra_body=think_first())
    message = reply.choices[0].message
    assert message.reasoning_content == "a" and json.loads(message.content) in ({"city": "Paris"}, {"city": "Rome"})
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, tools=TOOLS,
                                           tool_choice=named, extra_body=think_first())
    message = reply.choices[0].message
    assert message.reasoning_content == "a" and message.content is None
    assert json.loads(message.tool_calls[0].function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=150, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False, stream=True,
                                            extra_body=think_first())  # one call: the list cannot run on
    thinking, calls = "", []
    for chunk in stream:
        thinking += chunk.choices[0].delta.reasoning_content or "" if chunk.choices else ""
        calls += (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []
    assert thinking == "a" and [c.function.name for c in calls] == ["get_weather"]


def test_with_thinking_off_the_constraint_applies_from_the_first_token(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=50, extra_body={
        **_forced("Sunny, 21 degrees."), "chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert message.reasoning_content is None and message.content == "Sunny, 21 degrees."


def test_a_stream_sends_thinking_then_answer_then_the_call(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=200, stream=True,
                                            extra_body=_forced(ANSWER))
    order, thinking, content, calls, finish = [], "", "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for kind, value in (("thinking", delta.reasoning_content), ("content", delta.content),
                            ("call", delta.tool_calls)):
            if value and (not order or order[-1] != kind):
                order.append(kind)
        thinking += delta.reasoning_content or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert order == ["thinking", "content", "call"] and finish == "tool_calls"
    assert thinking == "a" and content == "Let me look.\n"
    assert [c.function.name for c in calls if c.id is not None] == ["get_weather"]  # its pieces: name, then arguments
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}
    hidden = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=200, stream=True,
                                            extra_body={**_forced(ANSWER), "include_reasoning": False})
    deltas = [chunk.choices[0].delta for chunk in hidden]
    assert not any(d.reasoning_content for d in deltas) and "".join(d.content or "" for d in deltas).startswith("Let")


def test_a_thinking_budget_ends_the_thinking_and_the_answer_follows(client: openai.OpenAI) -> None:
    """vLLM's ``thinking_token_budget``: the model would think "aaaaaaa" (a bias makes it open the block and write
    "a"); a budget of 3 forces ``</think>`` after three, and the answer follows, whole and streamed. A prompt that
    opened the block counts from there (completions, token ids: "a" is 64, ``</think>`` 261)."""
    body = {"logit_bias": {"260": 60, "64": 50}, "bad_words": ["<think><think>", "a<think>", "</think><think>"]}
    replies = {}
    for budget in (None, 3, 0):
        extra = {**body, "thinking_token_budget": budget} if budget is not None else body
        message = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0,
                                                 extra_body=extra).choices[0].message
        stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0,
                                                stream=True, extra_body=extra)
        deltas = [c.choices[0].delta for c in stream if c.choices]
        streamed = ("".join(d.reasoning_content or "" for d in deltas) or None,
                    "".join(d.content or "" for d in deltas) or None)
        assert streamed == (message.reasoning_content, message.content or None)
        replies[budget] = streamed
    assert replies == {None: ("a" * 7, None), 3: ("aaa", "aaa"), 0: (None, "a" * 6)}
    completion = client.completions.create(model="tiny", prompt="Think: <think>", max_tokens=5, temperature=0,
                                           extra_body={"logit_bias": {"64": 50}, "thinking_token_budget": 2,
                                                       "return_token_ids": True})
    assert completion.choices[0].token_ids == [64, 64, 261, 64, 64]


def test_granites_constraint_waits_for_its_response_phrase(tiny_llama: Path) -> None:
    """Granite's block ends in a phrase, not a tag: a constraint waits for the phrase's token ids, and a prompt
    that already ends in it is constrained from the first token."""
    tokenizer = Tokenizer.from_dir(tiny_llama)
    engine = SimpleNamespace(tokenizer=tokenizer, sampling_defaults={}, max_logprobs=20, enable_prompt_embeds=False,
                             check_custom=lambda params: None, image_placeholder=None,
                             runtime=SimpleNamespace(max_model_len=512, vocab_size=320, hidden_size=64,
                                                     pooling_only=False, labels=()))
    chat = OpenAIServingChat(engine, ["tiny"], reasoning_parser="granite")
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    job = chat.prepare(ChatCompletionRequest(messages=CHAT, response_format=fmt))
    phrase = tokenizer.encode("Here is my response:", add_special_tokens=False)
    assert job.params.structured_outputs.begin_after == phrase and not job.closed
    continued = [*CHAT, {"role": "assistant", "content": "Here is my thought process: 4. Here is my response:"}]
    job = chat.prepare(ChatCompletionRequest(messages=continued, response_format=fmt, add_generation_prompt=False,
                                             continue_final_message=True))
    assert job.params.structured_outputs.begin_after is None and job.closed
