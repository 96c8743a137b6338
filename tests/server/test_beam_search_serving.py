"""vLLM's ``use_beam_search`` through the OpenAI SDK: completions and chat return the offline ``LLM.beam_search``'s
beams, best first, as their ``n`` choices; what a beam search cannot honour is a 400 naming it, and the server
serves on."""

from __future__ import annotations


import httpx
import openai
import pytest
from server_utils import ServerProcess, engine_idle, wait_until

from pagellm import LLM
from pagellm.beam_search import BeamSearchParams


def test_completions_and_chat_return_the_offline_beams(server: ServerProcess, client: openai.OpenAI,
                                                       offline: LLM) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.7)
    prompts = ["The quick brown", "Once upon a"]
    want = offline.beam_search(prompts, params)
    reply = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, n=3, temperature=0.8,
                                      extra_body={"use_beam_search": True, "length_penalty": 0.7})
    assert [c.index for c in reply.choices] == list(range(6))
    assert [c.text for c in reply.choices] == [b.text for out in want for b in out.sequences]
    assert [c.finish_reason for c in reply.choices] == [b.finish_reason for out in want for b in out.sequences]
    assert reply.usage.completion_tokens == sum(len(b.output_token_ids) for out in want for b in out.sequences)
    assert reply.usage.prompt_tokens == sum(len(offline.tokenizer.encode(p)) for p in prompts)
    messages = [{"role": "user", "content": "Name a colour."}]
    chat_prompt = offline.tokenizer.apply_chat_template(messages, True)
    chat_want = offline.beam_search([chat_prompt], BeamSearchParams(beam_width=2, max_tokens=6))[0].sequences
    chat = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6, n=2,
                                          extra_body={"use_beam_search": True})
    assert [c.message.content for c in chat.choices] == [b.text for b in chat_want]
    wait_until(lambda: engine_idle(server.base_url), 10, "every beam request to finish and give its blocks back")


@pytest.mark.parametrize(("fields", "param"), [
    (dict(stream=True), "stream"),
    (dict(logprobs=0), "logprobs"),
    (dict(echo=True), "echo"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(stop=["x"]), "stop"),
    (dict(n=11), "n"),
    (dict(guided_regex="[a-z]+"), "structured_outputs"),
])
def test_what_a_beam_search_cannot_honour_is_refused(server: ServerProcess, fields: dict, param: str) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "use_beam_search": True, **fields}
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and ("use_beam_search" in error["message"] or "beam width" in error["message"])
    kept = {k: v for k, v in body.items() if k not in fields}
    ok = httpx.post(f"{server.base_url}/v1/completions", json={**kept, "n": 2}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
