"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the ``anthropic`` SDK on a live
server (the ``thinker`` model, Qwen3's parsers): the reply equals the chat endpoint's for the same conversation
(system blocks, tool results, a prefilled reply); thinking, text and calls become Anthropic's content blocks, whole
and as the SDK's stream events, which add up to the same message; stop reasons and usage (prefix-cache reads
apart) are Anthropic's; errors are in Anthropic's shape and say what to fix."""

from __future__ import annotations

import hashlib
import json
import re

import anthropic
import httpx
import openai
import pytest
from server_utils import ServerProcess, think_first

PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
TOOL = {"name": "get_weather", "description": "Weather in a city", "input_schema": PARAMETERS}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                              "parameters": PARAMETERS}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
GREEDY = {"temperature": 0, "ignore_eos": True}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def claude(thinker_server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=thinker_server.base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(thinker_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{thinker_server.base_url}/v1", api_key="x", max_retries=0, timeout=60)


def _chat(chat: openai.OpenAI, messages: list[dict], max_tokens: int, **fields: object) -> openai.types.Completion:
    return chat.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0,
                                        extra_body={"ignore_eos": True, **fields})


def test_a_reply_equals_the_chat_reply_to_the_same_conversation(claude: anthropic.Anthropic,
                                                                 chat: openai.OpenAI) -> None:
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=9f2e;"},
              {"type": "text", "text": "Answer briefly."}, {"type": "text", "text": " Be kind."}]
    message = claude.messages.create(model="tiny", system=system, messages=ASK, max_tokens=12, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.id.startswith("msg_") and message.stop_reason == "max_tokens" and message.stop_sequence is None
    (block,) = message.content
    reply = _chat(chat, [{"role": "system", "content": "Answer briefly. Be kind."}, *ASK], 12)
    assert block.type == "text" and block.text == reply.choices[0].message.content
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == reply.usage.prompt_tokens
    assert usage.output_tokens == 12
    again = claude.messages.create(model="tiny", system=system, messages=ASK, max_tokens=12, extra_body=GREEDY)
    assert again.content == message.content and again.usage.cache_read_input_tokens > 0  # the prefix cache's
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == reply.usage.prompt_tokens
    count = claude.messages.count_tokens(model="tiny", system=system, messages=ASK)
    assert count.input_tokens == reply.usage.prompt_tokens == count.context_management["original_input_tokens"]


def test_a_stop_sequence_ends_the_reply_and_is_named(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model="tiny", messages=ASK, max_tokens=16, extra_body=GREEDY).content[0].text
    stop = whole[6:9]
    message = claude.messages.create(model="tiny", messages=ASK, max_tokens=16, stop_sequences=[stop],
                                     extra_body=GREEDY)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == whole[:whole.index(stop)]
    ended = claude.messages.create(model="tiny", messages=ASK, max_tokens=16, extra_body={"temperature": 0})
    assert ended.stop_reason in ("end_turn", "max_tokens")
    assert (ended.stop_reason == "end_turn") == (ended.usage.output_tokens < 16)


def test_thinking_text_and_an_auto_call_become_three_blocks(claude: anthropic.Anthropic) -> None:
    fields = think_first(structured_outputs={"regex": re.escape(f"\n\nLet me look.\n{CALL}")})
    message = claude.messages.create(model="tiny", messages=ASK, tools=[TOOL], max_tokens=120, extra_body=fields)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, call = message.content
    assert thinking.thinking == "a" and thinking.signature == hashlib.sha256(b"a").hexdigest()
    assert text.text == "Let me look."
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"}) and call.id
    assert message.stop_reason == "tool_use"


def test_a_stream_sends_anthropic_events_that_add_up_to_the_message(claude: anthropic.Anthropic) -> None:
    fields = think_first(structured_outputs={"regex": re.escape(f"\n\nLet me look.\n{CALL}")})
    with claude.messages.stream(model="tiny", messages=ASK, tools=[TOOL], max_tokens=120,
                                extra_body=fields) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events if event.type not in ("text", "thinking", "input_json", "signature")]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert starts == ["thinking", "text", "tool_use"] == [block.type for block in final.content]
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1, 2]
    whole = claude.messages.create(model="tiny", messages=ASK, tools=[TOOL], max_tokens=120, extra_body=fields)
    assert (final.content[0].thinking, final.content[0].signature) == (whole.content[0].thinking,
                                                                        whole.content[0].signature)
    assert (final.content[2].name, final.content[2].input) == (whole.content[2].name, whole.content[2].input)
    assert final.content[1].text == "Let me look.\n"  # a stream cannot take back the newline before the call
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    plain = claude.messages.create(model="tiny", messages=ASK, max_tokens=12, extra_body=GREEDY)
    with claude.messages.stream(model="tiny", messages=ASK, max_tokens=12, extra_body=GREEDY) as stream:
        texts = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert "".join(texts) == plain.content[0].text and [b.text for b in streamed.content] == [plain.content[0].text]
    assert streamed.stop_reason == "max_tokens" and streamed.usage.output_tokens == 12


def test_named_and_required_tool_choices_call_the_tool(claude: anthropic.Anthropic) -> None:
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        message = claude.messages.create(model="tiny", messages=ASK, tools=[TOOL], tool_choice=choice,
                                         max_tokens=120, extra_body={"temperature": 0, **NO_THINKING})
        calls = [block for block in message.content if block.type == "tool_use"]
        assert calls and calls[0].name == "get_weather" and calls[0].input["city"] in ("Paris", "Rome")
        assert message.stop_reason == "tool_use"
    none = claude.messages.create(model="tiny", messages=ASK, tools=[TOOL], tool_choice={"type": "none"},
                                  max_tokens=8, extra_body={**GREEDY, **NO_THINKING})
    assert [block.type for block in none.content] == ["text"]


def test_a_tool_result_continues_the_conversation_as_chat_does(claude: anthropic.Anthropic,
                                                               chat: openai.OpenAI) -> None:
    messages = [*ASK, {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "21C, sunny"}]},
                                     {"type": "text", "text": "Thanks!"}]}]
    message = claude.messages.create(model="tiny", messages=messages, tools=[TOOL], max_tokens=10,
                                     extra_body={**GREEDY, **NO_THINKING})
    same = [*ASK, {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21C, sunny"}, {"role": "user", "content": "Thanks!"}]
    reply = _chat(chat, same, 10, tools=[CHAT_TOOL], **NO_THINKING)
    assert message.content[0].text == reply.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == reply.usage.prompt_tokens


def test_a_prefilled_reply_is_continued(claude: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    prefill = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    message = claude.messages.create(model="tiny", messages=prefill, max_tokens=8, extra_body=GREEDY)
    reply = _chat(chat, prefill, 8, add_generation_prompt=False, continue_final_message=True)
    assert message.content[0].text == reply.choices[0].message.content
    answered = claude.messages.create(model="tiny", messages=ASK, max_tokens=8, extra_body=GREEDY)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens != \
        answered.usage.input_tokens + answered.usage.cache_read_input_tokens


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("body,status,kind,says", [
    ({"model": "tiny", "messages": ASK}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"model": "tiny", "messages": ASK, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "nope", "messages": ASK, "max_tokens": 4}, 404, "not_found_error", "nope"),
    ({"model": "tiny", "messages": ASK, "max_tokens": 4, "mystery": 1}, 400, "invalid_request_error", "mystery"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}, 400, "invalid_request_error",
     "messages[0].content[0]: image blocks are not supported"),
    ({"model": "tiny", "max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305",
                                                                    "name": "web_search"}]},
     400, "invalid_request_error", "tools.0"),
    ({"model": "tiny", "max_tokens": 2000, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 2000}},
     400, "invalid_request_error", "thinking.budget_tokens must be less than max_tokens"),
    ({"model": "tiny", "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "tool_choice 'any' needs tools"),
])
def test_errors_are_in_anthropics_shape_and_say_what_to_fix(thinker_server: ServerProcess, body: dict,
                                                            status: int, kind: str, says: str) -> None:
    response = _post(thinker_server, "/v1/messages", body)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and says in error["error"]["message"]


def test_the_sdk_raises_its_own_errors(claude: anthropic.Anthropic, thinker_server: ServerProcess) -> None:
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.messages.create(model="nope", messages=ASK, max_tokens=4)
    assert raised.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="document blocks are not supported"):
        claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    message = claude.messages.create(model="tiny", messages=ASK, max_tokens=4, metadata={"user_id": "u1"},
                                     service_tier="auto", extra_body=GREEDY)
    assert message.usage.output_tokens == 4  # platform settings are taken and change nothing
    response = _post(thinker_server, "/v1/messages", {"model": "tiny", "messages": ASK, "max_tokens": 4,
                                                      "stream": True})
    stream = [event for event in response.text.split("\n\n") if event.strip()]
    assert stream[0].startswith("event: message_start") and stream[-1].startswith("event: message_stop")
    assert json.loads(stream[0].split("data: ", 1)[1])["message"]["usage"]["output_tokens"] == 0

