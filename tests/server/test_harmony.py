"""gpt-oss's harmony replies split into thinking, content and calls (``server/openai/harmony.py``), whole and streamed
in any pieces, as vLLM's ``openai_gptoss`` reasoning parser and ``openai`` tool-call parser split them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import openai
import pytest
from server_utils import ServerProcess

from pagellm.server.openai import harmony
from pagellm.server.openai import tools as tooling
from pagellm.server.openai.harmony import HarmonyStream
from pagellm.server.openai.protocol import ChatCompletionRequest
from pagellm.server.openai.serving_chat import OpenAIServingChat
from pagellm.server.openai.tool_parsers import get_parser
from pagellm.tokenizer import Tokenizer

THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'

REPLIES = [  # (reply, thinking, content, calls as (name, arguments))
    (THINK + FINAL, "The user wants the weather.", "It is sunny.", []),
    (THINK + CALL, "The user wants the weather.", None, [("get_weather", {"city": "Paris"})]),
    # the recipient before the channel, a bare format word; a preamble before the call
    (THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
     '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "x"}<|call|>',
     "The user wants the weather.", "Checking.", [("lookup", {"q": "x"})]),
    # two analysis messages, two final ones: each kind's joined by a newline
    (THINK + "<|start|>assistant<|channel|>analysis<|message|>More.<|end|>" + FINAL + "<|end|>" + FINAL,
     "The user wants the weather.\nMore.", "It is sunny.\nIt is sunny.", []),
    # a built-in tool's call is dropped, as vLLM drops it
    (THINK + "<|start|>assistant to=browser.search<|channel|>analysis<|message|>{}<|end|>" + FINAL,
     "The user wants the weather.", "It is sunny.", []),
    # cut short inside its thinking; a model that wrote no harmony at all
    ("<|channel|>analysis<|message|>Hmm, the", "Hmm, the", None, []),
    ("Just text.", None, "Just text.", []),
]


@pytest.mark.parametrize(("reply", "thinking", "content", "calls"), REPLIES)
def test_a_reply_splits_alike_whole_and_in_any_pieces(reply: str, thinking, content, calls) -> None:
    got_thinking, got_content, got_calls = harmony.split(reply)
    assert (got_thinking, got_content) == (thinking, content)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    for size in (1, 2, 3, 5, 8, 13):
        stream = HarmonyStream()
        pieces = [stream.feed(reply[i:i + size]) for i in range(0, len(reply), size)] + [stream.finish()]
        assert ("".join(p.thinking for p in pieces) or None) == thinking
        assert ("".join(p.content for p in pieces) or None) == content
        deltas = [d for p in pieces for d in p.calls]
        names = [d.name for d in deltas if d.id is not None]
        assert names == [name for name, _ in calls] and stream.called == bool(calls)
        for number, (_, arguments) in enumerate(calls):
            assert json.loads("".join(d.arguments for d in deltas if d.index == number)) == arguments


def test_a_stream_holds_only_what_may_be_a_marker() -> None:
    stream = HarmonyStream()
    assert stream.feed("<|channel|>analysis").thinking == ""  # a header: nothing to send yet
    assert stream.feed("<|message|>Sun or <").thinking == "Sun or "  # "<" may open <|end|>
    assert stream.feed("rain?<|end|><|start|>assistant").thinking == "<rain?"
    first = stream.feed('<|channel|>commentary to=functions.f<|message|>{"a"')
    assert [(d.index, d.name, d.arguments) for d in first.calls] == [(0, "f", '{"a"')]
    assert first.calls[0].id is not None
    assert [d.arguments for d in stream.feed(": 1}").calls] == [": 1}"] and stream.finish().calls == []


def test_what_the_server_does_not_surface_is_dropped() -> None:
    reply = THINK + CALL
    assert harmony.split(reply, calls=False, thinking=False) == (None, None, [])
    calls = harmony.split(reply + "<|call|>" + CALL, limit=1)[2]  # parallel_tool_calls false: the first call only
    assert [c.function.name for c in calls] == ["get_weather"]
    assert harmony.split(THINK + CALL.replace('{"city": "Paris"}', "not json"))[2][0].function.arguments == "not json"


def test_the_openai_tool_parser_reads_harmony_calls() -> None:
    parser = get_parser("openai")
    assert parser.harmony
    parsed = parser.parse(THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL)
    assert parsed.content == "Checking." and [c.function.name for c in parsed.calls] == ["get_weather"]


# A tiny gpt-oss with harmony's markers as special tokens (as in gpt-oss's tokenizer), <|return|> and <|call|> among
# its stop tokens, and a template that ends the prompt in "<|start|>assistant"; or, for these tests, in an analysis
# message it opens ("open_analysis") or one it closes empty ("skip_analysis": a constraint then applies at once).
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% if open_analysis is defined %}<|channel|>analysis"
            "<|message|>{% elif skip_analysis is defined %}<|channel|>analysis<|message|><|end|>{% endif %}{% endif %}")
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_a_prompt_that_opened_a_message_is_read_on_from_its_text() -> None:
    assert harmony.open_header("<|start|>assistant") is None
    assert harmony.open_header("<|message|>Hi<|end|><|start|>assistant<|channel|>analysis<|message|><|end|>") is None
    opened = harmony.open_header("<|message|>Hi<|end|><|start|>assistant<|channel|>analysis<|message|>")
    assert opened == "<|start|>assistant<|channel|>analysis"
    assert harmony.split("Hmm.<|end|>" + FINAL, opened=opened)[:2] == ("Hmm.", "It is sunny.")
    call = harmony.open_header("<|start|>assistant<|channel|>commentary to=functions.f<|message|>")
    stream = HarmonyStream(opened=call)
    assert [(d.name, d.arguments) for d in stream.feed('{"a": 1}').calls] == [("f", '{"a": 1}')]


@pytest.fixture(scope="module")
def harmony_model(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_harmony_model(tiny_model_factory("gpt_oss"), tmp_path_factory.mktemp("harmony"))


def build_harmony_model(tiny_gpt_oss: Path, path: Path) -> Path:
    """A copy of a tiny gpt-oss whose tokenizer has harmony's markers, its stop tokens and ``TEMPLATE``."""
    from transformers import AutoTokenizer

    shutil.copytree(tiny_gpt_oss, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return path


@pytest.fixture(scope="module")
def harmony_client(harmony_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    server = ServerProcess(harmony_model, ["--served-model-name", "tiny", "--reasoning-parser", "openai_gptoss",
                                           "--enable-auto-tool-choice", "--tool-call-parser", "openai"],
                           tmp_path_factory.mktemp("harmony-server") / "server.log")
    try:
        server.wait_healthy()
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    finally:
        server.stop()


def _marker_ids(model: Path) -> list[int]:
    ids = Tokenizer.from_dir(model).encode("".join(MARKERS), add_special_tokens=False)
    assert len(ids) == len(MARKERS)
    return ids


def _think_then(model: Path, answer: str, **fields: object) -> dict:
    """The model thinks "aaa" in the analysis message its prompt opened (a bias picks "a"), a thinking budget of 3
    closes it with the final message's header, and the answer follows (a constraint waits for that header)."""
    return {"chat_template_kwargs": {"open_analysis": True}, "thinking_token_budget": 3,
            "logit_bias": {"64": 50}, "structured_outputs": {"regex": re.escape(answer)}, "return_token_ids": True,
            **fields}


def test_a_served_reply_carries_its_thinking_apart_from_its_answer(harmony_client: openai.OpenAI,
                                                                   harmony_model: Path) -> None:
    for stream in (False, True):
        reply = harmony_client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, stream=stream,
                                                       extra_body=_think_then(harmony_model, "It is sunny."))
        chunks = list(reply) if stream else [reply]
        parts = [(c.choices[0].delta if stream else c.choices[0].message) for c in chunks if c.choices]
        ids = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
        assert set(_marker_ids(harmony_model)[:4]) <= set(ids)  # the markers came as special tokens, read in text
        assert "".join(p.reasoning_content or "" for p in parts) == "aaa"
        assert "".join(p.content or "" for p in parts) == "It is sunny."
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    hidden = harmony_client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, extra_body=_think_then(
        harmony_model, "It is sunny.", include_reasoning=False))
    assert hidden.choices[0].message.reasoning_content is None and hidden.choices[0].message.content == "It is sunny."


def test_the_responses_api_gives_the_thinking_and_the_answer_as_items(harmony_client: openai.OpenAI,
                                                                      harmony_model: Path) -> None:
    """/v1/responses runs the chat handler: gpt-oss's analysis message becomes a reasoning item, its final one the
    message (vLLM serves gpt-oss's Responses API alike)."""
    body = _think_then(harmony_model, "It is sunny.")
    del body["return_token_ids"]
    response = harmony_client.responses.create(model="tiny", input="What is the weather in Paris?",
                                               max_output_tokens=60, extra_body=body)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "aaa" and response.output_text == "It is sunny."


def test_a_served_call_comes_whole_and_streamed(harmony_client: openai.OpenAI, harmony_model: Path) -> None:
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>"
    body = {"chat_template_kwargs": {"skip_analysis": True},
            "structured_outputs": {"regex": re.escape(preamble + CALL)},
            "logit_bias": {str(i): 30 for i in _marker_ids(harmony_model)}}
    reply = harmony_client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=160,
                                                   extra_body=body)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    stream = harmony_client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=160,
                                                    stream=True, extra_body=body)
    order, content, calls, finish = [], "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for kind, value in (("content", delta.content), ("call", delta.tool_calls)):
            if value and (not order or order[-1] != kind):
                order.append(kind)
        content, calls = content + (delta.content or ""), calls + (delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert order == ["content", "call"] and finish == "tool_calls" and content == "Let me look."
    assert [c.function.name for c in calls if c.id is not None] == ["get_weather"]
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}


def _forced_call(client: openai.OpenAI, model: Path, tool_choice: object, stream: bool) -> tuple[list, str, str]:
    """A forced call's (calls, content, finish_reason), whole or streamed; the bias ends the model's free messages
    at once and its strings at their first character (a random model's otherwise run to max_tokens)."""
    tokenizer = Tokenizer.from_dir(model)
    (end,), (quote,) = (tokenizer.encode(t, add_special_tokens=False) for t in ("<|end|>", '"'))
    reply = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=120, stream=stream,
                                           extra_body={"logit_bias": {str(end): 100, str(quote): 100}})
    if not stream:
        return reply.choices[0].message.tool_calls or [], reply.choices[0].message.content, \
            reply.choices[0].finish_reason
    deltas = [c.choices[0] for c in reply if c.choices]
    calls = [call for d in deltas for call in d.delta.tool_calls or []]
    whole = [tooling.ToolCall(id=c.id, function=tooling.FunctionCall(name=c.function.name, arguments="".join(
        more.function.arguments or "" for more in calls if more.index == c.index))) for c in calls if c.id]
    return whole, "".join(d.delta.content or "" for d in deltas) or None, deltas[-1].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_or_named_call_is_made(harmony_client: openai.OpenAI, harmony_model: Path, stream: bool) -> None:
    """gpt-oss's required and named calls are constrained (``harmony_calls.py``): the reply is one call of the tool,
    its arguments following the schema ("tool_calls" for required, "stop" for a named call, as OpenAI's)."""
    for tool_choice, finish in (("required", "tool_calls"),
                                ({"type": "function", "function": {"name": "get_weather"}}, "stop")):
        calls, content, reason = _forced_call(harmony_client, harmony_model, tool_choice, stream)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": ""})]
        assert reason == finish and content is None and calls[0].id.startswith("chatcmpl-tool-")


def test_a_forced_call_with_a_thinking_budget_is_refused(harmony_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget ends gpt-oss's thinking with its final"):
        harmony_client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                               extra_body={"thinking_token_budget": 8})


def test_the_server_keeps_the_markers_and_constrains_the_final_message(harmony_model: Path) -> None:
    """What preparation sets (no request runs): special tokens kept in the text, and a response_format that waits
    for the final message's header."""
    engine = SimpleNamespace(tokenizer=Tokenizer.from_dir(harmony_model), sampling_defaults={}, max_logprobs=20,
                             enable_prompt_embeds=False, check_custom=lambda params: None, image_placeholder=None,
                             runtime=SimpleNamespace(max_model_len=512, vocab_size=320, hidden_size=64,
                                                     pooling_only=False, labels=()))
    chat = OpenAIServingChat(engine, ["tiny"], "openai", "openai_gptoss")
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": TOOLS[0]["function"]["parameters"]}}
    job = chat.prepare(ChatCompletionRequest(messages=CHAT, response_format=fmt))
    assert job.harmony and not job.params.skip_special_tokens and job.opened is None
    final = engine.tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False)
    assert job.params.structured_outputs.begin_after == final and len(final) == 7
    plain = OpenAIServingChat(engine, ["tiny"]).prepare(ChatCompletionRequest(messages=CHAT))
    assert not plain.harmony and plain.params.skip_special_tokens
