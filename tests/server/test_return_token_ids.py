"""vLLM's ``return_token_ids``: completions and chats carry their prompt's and their choices' token ids, whole or
streamed (the prompt's in the first chunk, each chunk its new tokens), the ids the offline engine generates; without
it the fields are not in the JSON at all."""

from __future__ import annotations

import httpx
import openai
from server_utils import ServerProcess

from pagellm import LLM, SamplingParams

PARAMS = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Name a colour."}]


def _offline(offline: LLM, prompt: str | None = None) -> tuple[list[int], list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = offline.generate([prompt], params, use_tqdm=False)[0] if prompt is not None else \
        offline.chat(CHAT, params, use_tqdm=False)[0]
    return out.prompt_token_ids, list(out.outputs[0].token_ids)


def test_completions_carry_their_token_ids(server: ServerProcess, offline: LLM) -> None:
    prompt_ids, ids = _offline(offline, "The sky is")
    body = {"model": "tiny", "prompt": "The sky is", **PARAMS}
    whole = httpx.post(f"{server.base_url}/v1/completions", json={**body, "return_token_ids": True}).json()
    (choice,) = whole["choices"]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (prompt_ids, ids)
    plain = httpx.post(f"{server.base_url}/v1/completions", json=body).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    chunks = list(client.completions.create(model="tiny", prompt="The sky is", stream=True, max_tokens=6,
                                            temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}))
    firsts = [c.choices[0].model_extra.get("prompt_token_ids") for c in chunks]
    assert firsts[0] == prompt_ids and not any(firsts[1:])
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ids


def test_chats_carry_their_token_ids(server: ServerProcess, offline: LLM) -> None:
    prompt_ids, ids = _offline(offline)
    body = {"model": "tiny", "messages": CHAT, **PARAMS, "return_token_ids": True}
    whole = httpx.post(f"{server.base_url}/v1/chat/completions", json=body).json()
    assert (whole["prompt_token_ids"], whole["choices"][0]["token_ids"]) == (prompt_ids, ids)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, stream=True, max_tokens=6,
                                                 temperature=0, extra_body={"ignore_eos": True,
                                                                            "return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    assert [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])] == ids
