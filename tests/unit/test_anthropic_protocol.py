"""Anthropic's Messages bodies as chat requests (``server/anthropic/protocol.py``), and the stop reasons, content
blocks and stream events made of chat's replies (``serving_messages.py``)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pagellm.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagellm.server.anthropic.serving_messages import _Events, content_blocks, stop_reason
from pagellm.server.openai import tools as tooling
from pagellm.server.openai.replies import ChatChunkChoice, ChatDelta, ChatResponseMessage

TOOL = {"name": "f", "input_schema": {"properties": {"a": {"type": "integer"}}}}


def _chat(**body: object) -> dict:
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 10, **body})
    return request.to_chat().model_dump(exclude_none=True)


def test_a_conversation_becomes_the_same_chat() -> None:
    chat = _chat(system=[{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                         {"type": "text", "text": "One. ", "cache_control": {"type": "ephemeral"}},
                         {"type": "text", "text": "Two."}],
                 messages=[{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": [
                               {"type": "thinking", "thinking": "hm", "signature": "s"},
                               {"type": "redacted_thinking", "data": "..."}, {"type": "text", "text": "Let me"},
                               {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                           {"role": "user", "content": [{"type": "text", "text": "and"},
                                                        {"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                                                        {"type": "text", "text": "thanks"}]}])
    assert chat["messages"] == [
        {"role": "system", "content": "One. Two."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Let me", "reasoning_content": "hm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "42"}, {"role": "user", "content": "and\nthanks"}]
    assert chat["add_generation_prompt"] and not chat["continue_final_message"] and chat["max_tokens"] == 10


def test_a_last_assistant_turn_is_continued_unless_it_is_empty() -> None:
    ask = {"role": "user", "content": "Hi"}
    prefilled = _chat(messages=[ask, {"role": "assistant", "content": "The answer is"}])
    assert prefilled["continue_final_message"] and not prefilled["add_generation_prompt"]
    assert prefilled["messages"][-1] == {"role": "assistant", "content": "The answer is"}
    empty = _chat(messages=[ask, {"role": "assistant", "content": ""}])
    assert empty["messages"] == [ask] and empty["add_generation_prompt"] and not empty["continue_final_message"]


def test_tools_choices_thinking_and_output_config_map_onto_chat() -> None:
    chat = _chat(messages=[{"role": "user", "content": "Hi"}], tools=[TOOL],
                 tool_choice={"type": "tool", "name": "f", "disable_parallel_tool_use": True},
                 thinking={"type": "disabled"}, output_config={"effort": "xhigh", "format": {
                     "type": "json_schema", "schema": {"type": "object"}}}, chat_template_kwargs={"x": 1})
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["parallel_tool_calls"] is False and chat["reasoning_effort"] == "high"
    assert chat["chat_template_kwargs"] == {"enable_thinking": False, "x": 1}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output",
                                                                             "schema": {"type": "object"}}}
    assert [_chat(messages=[{"role": "user", "content": "Hi"}], tools=[TOOL], tool_choice={"type": kind})[
        "tool_choice"] for kind in ("auto", "any", "none")] == ["auto", "required", "none"]
    budget = _chat(messages=[{"role": "user", "content": "Hi"}], max_tokens=4096, stream=True,
                   thinking={"type": "enabled", "budget_tokens": 1024}, top_k=5, cache_salt="s")
    assert (budget["thinking_token_budget"], budget["top_k"], budget["cache_salt"]) == (1024, 5, "s")
    assert budget["stream"] and budget["stream_options"]["include_usage"]
    count = CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
    assert count.to_chat().max_tokens is None


@pytest.mark.parametrize("body,says", [
    ({"thinking": {"type": "enabled", "budget_tokens": 512}}, "greater than or equal to 1024"),
    ({"thinking": {"type": "enabled"}}, "needs budget_tokens"),
    ({"tool_choice": {"type": "tool"}}, "needs the name of a tool"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0"),
    ({"temperature": "0.5"}, "temperature"),
])
def test_bad_bodies_are_refused_by_name(body: dict, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        MessagesRequest.model_validate({"model": "m", "max_tokens": 10, "messages": [{"role": "user",
                                                                                      "content": "Hi"}], **body})


@pytest.mark.parametrize("content,says", [
    ([{"type": "image", "source": {}}], r"messages\[0\].content\[0\]: image blocks are not supported"),
    ([{"type": "tool_use", "id": "t", "name": "f", "input": {}}], "'tool_use' blocks are not supported in user"),
    ([{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}],
     "'image' blocks are not supported in tool_result content"),
    ([{"text": "no type"}], "must be a content block"),
    ([{"type": "text", "text": 3}], r"content\[0\].text must be a string"),
])
def test_blocks_that_cannot_be_rendered_are_refused_by_position(content: list, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        _chat(messages=[{"role": "user", "content": content}])


def test_image_blocks_become_image_parts_for_a_model_that_takes_images() -> None:
    """In order with the turn's text; base64 sources as data URLs, url sources as they are."""
    content = [{"type": "text", "text": "Compare"}, {"type": "image", "source": {"type": "base64",
                                                                              "media_type": "image/png", "data": "AAA"}},
               {"type": "text", "text": "with"}, {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 10,
                                              "messages": [{"role": "user", "content": content}]})
    (message,) = request.to_chat(images=True).model_dump(exclude_none=True)["messages"]
    assert message["content"] == [{"type": "text", "text": "Compare"},
                                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
                                  {"type": "text", "text": "with"},
                                  {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    assert [p["image_url"]["url"] for p in request.input_messages()[0]["content"] if p["type"] == "image_url"] == \
        ["data:image/png;base64,AAA", "http://x/y.png"]
    with pytest.raises(ValueError, match="image blocks are not supported .this model takes no images"):
        request.to_chat()


@pytest.mark.parametrize("source,says", [
    ({"type": "file", "file_id": "f"}, r"content\[0\].source must be .* got type 'file'"),
    ({"type": "base64", "media_type": "image/tiff", "data": "AAA"}, "media_type must be one of image/jpeg"),
    ({"type": "base64", "media_type": "image/png"}, r"source.data must be a string"),
    ("http://x/y.png", "got type None"),
])
def test_image_sources_that_cannot_be_read_are_refused_by_position(source: object, says: str) -> None:
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": [{"type": "image", "source": source}]}]})
    with pytest.raises(ValueError, match=says):
        request.to_chat(images=True)


def test_stop_reasons() -> None:
    assert stop_reason("length", None, False, 10, 10) == ("max_tokens", None)
    assert stop_reason("length", None, True, 7, 10) == ("model_context_window_exceeded", None)
    assert stop_reason("stop", "END", False, 3, 10) == ("stop_sequence", "END")
    assert stop_reason("tool_calls", None, True, 3, 10) == ("tool_use", None)
    assert stop_reason("stop", 2, False, 3, 10) == ("end_turn", None)  # a stop token is no stop sequence
    assert stop_reason("repetition", None, False, 3, 10) == ("end_turn", None)


def test_a_call_cut_short_stays_text_in_a_whole_reply() -> None:
    whole = tooling.ToolCall(id="c1", function=tooling.FunctionCall(name="f", arguments='{"a": 1}'))
    cut = tooling.ToolCall(id="c2", function=tooling.FunctionCall(name="f", arguments='{"a": '))
    blocks = content_blocks(ChatResponseMessage(content="Hi. ", tool_calls=[whole, cut], reasoning_content="hm"))
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[1]["text"] == 'Hi. {"a": ' and blocks[2]["input"] == {"a": 1}
    assert content_blocks(ChatResponseMessage(content="")) == [{"type": "text", "text": ""}]


def _events(pieces: list[ChatDelta]) -> tuple[list[dict], _Events]:
    events = _Events()
    lines = [line for delta in pieces for line in events.piece(ChatChunkChoice(index=0, delta=delta))]
    lines += events.finish()
    return [json.loads(line.split("data: ", 1)[1]) for line in lines], events


def test_stream_events_open_fill_and_close_each_block_in_turn() -> None:
    call = tooling.DeltaToolCall(index=0, id="c1", type="function", function=tooling.DeltaFunctionCall(name="f"))
    args = [tooling.DeltaToolCall(index=0, function=tooling.DeltaFunctionCall(arguments=part))
            for part in ('{"a"', ': 1}')]
    sent, events = _events([ChatDelta(reasoning_content="h"), ChatDelta(reasoning_content="m"),
                            ChatDelta(content="Hi"), ChatDelta(tool_calls=[call]), ChatDelta(tool_calls=args)])
    assert [(e["type"], e.get("delta", e.get("content_block", {})).get("type")) for e in sent] == [
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
        ("content_block_stop", None), ("content_block_start", "text"), ("content_block_delta", "text_delta"),
        ("content_block_stop", None), ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
        ("content_block_delta", "input_json_delta"), ("content_block_stop", None)]
    assert [e["index"] for e in sent] == [0] * 5 + [1] * 3 + [2] * 4
    assert events.called()
    cut, events = _events([ChatDelta(tool_calls=[call]), ChatDelta(tool_calls=args[:1])])
    assert not events.called()  # its arguments do not parse: the call does not run
    nothing, _ = _events([])
    assert [e["type"] for e in nothing] == ["content_block_start", "content_block_stop"]
