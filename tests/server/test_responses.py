"""OpenAI's Responses API (``/v1/responses``) through the ``openai`` SDK on a live server (the ``thinker`` model,
Qwen3's parsers): the reply equals the chat endpoint's for the same conversation; instructions, text formats, tools
(named, auto), thinking and logprobs become the right output items, whole and as the SDK's stream events; stored
responses continue a conversation, are fetched and deleted; background responses are polled and cancelled with
their KV blocks freed; what cannot be honoured is a 400 that says so."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from server_utils import ServerProcess, engine_idle, think_first, wait_until

CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": PARAMETERS}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
GREEDY = {"ignore_eos": True}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # a constraint applies from the first token


@pytest.fixture(scope="module")
def client(thinker_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{thinker_server.base_url}/v1", api_key="x", max_retries=0)


def _chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> str:
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0,
                                           extra_body=GREEDY)
    return reply.choices[0].message.content


def test_a_reply_equals_the_chat_reply_to_the_same_conversation(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="What is the weather in Paris?", max_output_tokens=12,
                                       temperature=0, extra_body=GREEDY)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "tiny"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == _chat_text(client, CHAT, 12)
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, extra_body=GREEDY)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    instructed = client.responses.create(model="tiny", instructions="Answer briefly.", temperature=0,
                                         input=[{"role": "user", "content": [{"type": "input_text", "text": CHAT[0][
                                             "content"]}]}], max_output_tokens=12, extra_body=GREEDY)
    assert instructed.output_text == _chat_text(client, [{"role": "system", "content": "Answer briefly."}, *CHAT], 12)
    assert instructed.instructions == "Answer briefly." and instructed.output_text != response.output_text


def test_text_formats_shape_the_output_text(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="Weather?", max_output_tokens=40, text={"format": {
        "type": "json_schema", "name": "weather", "schema": PARAMETERS, "strict": True}}, extra_body=NO_THINKING)
    assert response.status == "completed" and json.loads(response.output_text)["city"] in ("Paris", "Rome")
    forced = client.responses.create(model="tiny", input="Weather?", max_output_tokens=40,
                                     extra_body={"structured_outputs": {"regex": "Sunny, 21 degrees\\."},
                                                 **NO_THINKING})
    assert forced.output_text == "Sunny, 21 degrees." and forced.output[0].status == "completed"


def test_thinking_answer_and_an_auto_call_become_three_items(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="Weather in Paris?", tools=[TOOL], max_output_tokens=120,
                                       extra_body=think_first(structured_outputs={
                                           "regex": re.escape(f"\n\nLet me look.\n{CALL}")}))
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = response.output
    assert reasoning.content[0].text == "a" and message.content[0].text == "Let me look."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.call_id and call.id.startswith("fc_") and call.call_id != call.id
    assert response.status == "completed" and 1 <= response.usage.output_tokens_details.reasoning_tokens <= 3


def test_a_named_tool_call_then_its_result_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=[TOOL], max_output_tokens=40,
                                    tool_choice={"type": "function", "name": "get_weather"}, extra_body=NO_THINKING)
    (call,) = first.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert first.tool_choice.name == "get_weather" and first.tools[0].name == "get_weather"
    second = client.responses.create(model="tiny", previous_response_id=first.id, max_output_tokens=10,
                                     temperature=0, extra_body=GREEDY, input=[
                                         {"type": "function_call_output", "call_id": call.call_id, "output": "21C"}])
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "21C"}]
    assert second.previous_response_id == first.id and second.output_text == _chat_text(client, messages, 10)
    with pytest.raises(openai.NotFoundError, match="no stored response with id 'resp_nope'"):
        client.responses.create(model="tiny", input="Hi", previous_response_id="resp_nope")


def test_a_stream_sends_openai_events_and_the_same_response(client: openai.OpenAI) -> None:
    fields = think_first(structured_outputs={"regex": re.escape(f"\n\nLet me look.\n{CALL}")})
    with client.responses.stream(model="tiny", input="Weather in Paris?", tools=[TOOL], max_output_tokens=120,
                                 extra_body=fields) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    added = [event.item.type for event in events if event.type == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"] == [item.type for item in final.output]
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    thinking = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert (thinking, text, json.loads(arguments)) == ("a", "Let me look.\n", {"city": "Paris"})
    assert final.output[1].content[0].text == "Let me look.\n" and final.output[2].arguments == arguments
    whole = client.responses.create(model="tiny", input="Weather in Paris?", max_output_tokens=12, temperature=0,
                                    extra_body=GREEDY)
    events = list(client.responses.create(model="tiny", input="Weather in Paris?", max_output_tokens=12,
                                          temperature=0, extra_body=GREEDY, stream=True))
    assert events[-1].type == "response.incomplete"  # cut at max_output_tokens, as OpenAI's stream says
    streamed = events[-1].response
    assert streamed.output_text == whole.output_text and streamed.status == "incomplete"
    assert streamed.output[0].status == "incomplete" and streamed.usage.output_tokens == 12


def test_logprobs_come_with_the_output_text(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="Hi", max_output_tokens=5, top_logprobs=2, temperature=0,
                                       include=["message.output_text.logprobs"], extra_body=GREEDY)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == 5 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert all(lp.logprob == max(top.logprob for top in lp.top_logprobs) for lp in logprobs)  # greedy
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body=GREEDY)
    assert [(lp.token, lp.logprob) for lp in logprobs] == [(lp.token, lp.logprob)
                                                           for lp in chat.choices[0].logprobs.content]
    events = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=5, top_logprobs=2,
                                          temperature=0, extra_body=GREEDY, stream=True))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in deltas] == [(lp.token, lp.logprob) for lp in logprobs]
    assert events[-1].response.output[0].content[0].logprobs == logprobs


def test_stored_responses_are_fetched_and_deleted(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="Hi", max_output_tokens=4)
    fetched = client.responses.retrieve(response.id)
    assert fetched.model_dump() == response.model_dump()
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_background_responses_are_polled_and_cancelled(client: openai.OpenAI, thinker_server: ServerProcess) -> None:
    queued = client.responses.create(model="tiny", input="Hi", max_output_tokens=8, background=True, temperature=0,
                                     extra_body=GREEDY)
    assert queued.status == "queued" and queued.background is True
    wait_until(lambda: client.responses.retrieve(queued.id).status not in ("queued", "in_progress"), 60,
               "the background response to finish")
    done = client.responses.retrieve(queued.id)
    assert (done.status, done.usage.output_tokens) == ("incomplete", 8)  # cut at max_output_tokens
    assert done.output_text == _chat_text(client, [{"role": "user", "content": "Hi"}], 8)
    long = client.responses.create(model="tiny", input="Hi", max_output_tokens=480, background=True,
                                   extra_body=GREEDY)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    wait_until(lambda: engine_idle(thinker_server.base_url), 30, "the cancelled response's blocks freed")
    with pytest.raises(openai.BadRequestError, match="only a background response that is still running"):
        client.responses.cancel(long.id)


@pytest.mark.parametrize(("fields", "message"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "only text parts are supported (this model takes no images), got a 'image_url' part"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "only function tools are supported, got 'web_search'"),
    ({"input": "Hi", "truncation": "auto"}, "truncation 'auto'"),
    ({"input": "Hi", "background": True, "stream": True}, "background responses need store: true and stream: false"),
    ({"input": "Hi", "include": ["reasoning.encrypted_content"]}, "include 'reasoning.encrypted_content'"),
    ({"input": [{"type": "computer_call", "id": "x"}]}, "items of type 'computer_call' are not supported"),
    ({"input": "Hi", "text": {"format": {"type": "yaml"}}}, "text.format type must be"),
    ({"input": "Hi", "frobnicate": 1}, "frobnicate"),
])
def test_what_cannot_be_honoured_is_a_400_that_says_so(thinker_server: ServerProcess, fields: dict,
                                                        message: str) -> None:
    reply = httpx.post(f"{thinker_server.base_url}/v1/responses", json={"model": "tiny", **fields})
    assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text


def test_a_stored_responses_input_items_are_listed_page_by_page(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", max_output_tokens=2, input=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "21C"}])
    listed = client.responses.input_items.list(response.id, order="asc")
    kinds = [(item.type, getattr(item, "role", None)) for item in listed.data]
    assert kinds == [("message", "system"), ("message", "user"), ("function_call", None),
                     ("function_call_output", None)]
    assert listed.data[0].content[0].text == "Be brief." and listed.data[3].output == "21C"
    newest = client.responses.input_items.list(response.id, limit=2)  # OpenAI's default order: newest first
    assert [item.id for item in newest.data] == [listed.data[3].id, listed.data[2].id] and newest.has_more
    rest = client.responses.input_items.list(response.id, limit=2, after=newest.data[-1].id)
    assert [item.id for item in rest.data] == [listed.data[1].id, listed.data[0].id] and not rest.has_more
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
