"""vLLM's request fields ``request_id`` (the response's id carries it) and chat ``echo`` (a reply that continues
the last message begins with its text)."""

from __future__ import annotations

import httpx
import openai
from server_utils import ServerProcess


def test_a_request_id_names_the_response(server: ServerProcess, client: openai.OpenAI) -> None:
    completion = client.completions.create(model="tiny", prompt="abc", max_tokens=1,
                                           extra_body={"request_id": "job-42"})
    assert completion.id == "cmpl-job-42"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"request_id": "job-43"})
    assert chat.id == "chatcmpl-job-43"
    unnamed = client.completions.create(model="tiny", prompt="abc", max_tokens=1)
    assert unnamed.id.startswith("cmpl-") and len(unnamed.id) == len("cmpl-") + 32
    empty = httpx.post(f"{server.base_url}/v1/completions", json={"model": "tiny", "prompt": "a", "request_id": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "request_id"


def test_echo_prepends_the_continued_message(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": "Well, "}]
    common = dict(model="tiny", messages=messages, max_tokens=4, temperature=0)
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(**common, extra_body=continued).choices[0].message
    echoed = client.chat.completions.create(**common, extra_body={**continued, "echo": True}).choices[0].message
    assert echoed.role == "assistant" and echoed.content == "Well, " + plain.content
    stream = client.chat.completions.create(**common, stream=True, extra_body={**continued, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == echoed.content
    # a new reply (the generation prompt) has the response role; the last message is the user's: nothing to echo
    fresh = client.chat.completions.create(model="tiny", messages=messages[:1], max_tokens=4, temperature=0,
                                           extra_body={"echo": True}).choices[0].message
    assert not fresh.content.startswith("Say it")
