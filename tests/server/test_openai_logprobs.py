"""OpenAI logprobs through the ``openai`` SDK: the values the offline ``LLM`` computes, in both response shapes,
streamed and whole."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import ServerProcess

from pagellm import LLM, SamplingParams
from pagellm.outputs import CompletionOutput

NO_EOS = {"ignore_eos": True}
CHAT = [{"role": "user", "content": "Tell me."}]
MAX_TOKENS = 10
TOP = 3


def _reference(llm: LLM, prompt: str | list[int]) -> CompletionOutput:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == MAX_TOKENS
    return out


def test_completion_logprobs_match_offline(client: openai.OpenAI, offline: LLM) -> None:
    prompt = "The quick brown"
    ref = _reference(offline, prompt)
    sampled = [entry[t] for t, entry in zip(ref.token_ids, ref.logprobs)]
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP,
                  extra_body=NO_EOS)
    whole = client.completions.create(**kwargs)
    lp = whole.choices[0].logprobs
    assert lp.tokens == [s.decoded_token for s in sampled]
    assert lp.token_logprobs == pytest.approx([s.logprob for s in sampled], abs=1e-4)
    for top, entry in zip(lp.top_logprobs, ref.logprobs):
        assert top == pytest.approx({p.decoded_token: p.logprob for p in entry.values()}, abs=1e-4)
        assert 1 <= len(top) <= TOP + 1  # texts may repeat (partial UTF-8 bytes all decode to U+FFFD)
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets
    assert whole.usage.completion_tokens == MAX_TOKENS

    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset

    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body=NO_EOS)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_match_offline(server: ServerProcess, client: openai.OpenAI, offline: LLM) -> None:
    prompt_ids = httpx.post(f"{server.base_url}/tokenize", json={"messages": CHAT}).json()["tokens"]
    ref = _reference(offline, prompt_ids)
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                  top_logprobs=TOP, extra_body=NO_EOS)
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS
    for item, token, entry in zip(content, ref.token_ids, ref.logprobs):
        assert item.token == entry[token].decoded_token and item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(entry[token].logprob, abs=1e-4)
        expected_top = [p for p in entry.values()][:TOP]
        assert [t.token for t in item.top_logprobs] == [p.decoded_token for p in expected_top]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([p.logprob for p in expected_top], abs=1e-4)

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = sum((c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs), [])
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]

    only_sampled = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0,
                                                  logprobs=True, extra_body=NO_EOS)
    assert all(item.top_logprobs == [] for item in only_sampled.choices[0].logprobs.content)
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, extra_body=NO_EOS)
    assert plain.choices[0].logprobs is None


def test_logprob_token_ids_stand_in_for_the_top_alternatives(server: ServerProcess, client: openai.OpenAI,
                                                             offline: LLM) -> None:
    """vLLM's ``logprob_token_ids``: chat's ``top_logprobs`` are the sampled token, then those tokens in order, and
    completions' hold the same, with the offline engine's values; chat needs ``logprobs: true``, and beam search
    and ids outside the vocabulary are 400s that say so."""
    asked = [104, 101, 33]  # "h", "e", "!" in the tiny byte vocabulary (as_ids keeps their names apart)
    prompt_ids = httpx.post(f"{server.base_url}/tokenize", json={"messages": CHAT}).json()["tokens"]
    ref = offline.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                        logprob_token_ids=asked), use_tqdm=False)[0].outputs[0]
    body = {**NO_EOS, "logprob_token_ids": asked, "return_tokens_as_token_ids": True}
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=True, extra_body=body)
    for item, token, entry in zip(chat.choices[0].logprobs.content, ref.token_ids, ref.logprobs):
        shown = [token] + [t for t in asked if t != token]
        assert [t.token for t in item.top_logprobs] == [f"token_id:{t}" for t in shown]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([entry[t].logprob for t in shown], abs=1e-4)
    completion = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=body)
    for top, token, entry in zip(completion.choices[0].logprobs.top_logprobs, ref.token_ids, ref.logprobs):
        assert top == pytest.approx({f"token_id:{t}": entry[t].logprob for t in [*asked, token]}, abs=1e-4)
    for route, extra, message in (
            ("chat/completions", {"logprob_token_ids": asked}, "logprob_token_ids needs logprobs: true"),
            ("chat/completions", {"logprob_token_ids": [5, 320], "logprobs": True}, r"must be in \[0, 320\)"),
            ("completions", {"logprob_token_ids": asked, "use_beam_search": True, "n": 2},
             "logprob_token_ids does not apply to use_beam_search")):
        prompt = {"messages": CHAT} if route.startswith("chat") else {"prompt": "Hi"}
        reply = httpx.post(f"{server.base_url}/v1/{route}", timeout=30, json={
            "model": "tiny", "max_tokens": 2, **prompt, **extra})
        assert reply.status_code == 400 and re.search(message, reply.json()["error"]["message"])


def test_return_tokens_as_token_ids_names_every_token_by_its_id(server: ServerProcess, client: openai.OpenAI,
                                                                offline: LLM) -> None:
    """vLLM's ``return_tokens_as_token_ids``: ``token_id:<id>`` wherever a token's text stood, the same logprobs,
    and text offsets that still count the choice's text."""
    prompt = [5, 17, 42, 99]
    ref = _reference(offline, prompt)
    named = lambda ids: [f"token_id:{t}" for t in ids]  # noqa: E731
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP, echo=True)
    plain = client.completions.create(**kwargs, extra_body=NO_EOS).choices[0].logprobs
    as_ids = client.completions.create(**kwargs, extra_body={**NO_EOS, "return_tokens_as_token_ids": True})
    lp = as_ids.choices[0].logprobs
    assert lp.tokens == named(prompt + ref.token_ids)
    assert lp.token_logprobs == plain.token_logprobs and lp.text_offset == plain.text_offset
    assert lp.top_logprobs[0] is None
    for top, entry in zip(lp.top_logprobs[len(prompt):], ref.logprobs):
        assert top == pytest.approx({f"token_id:{t}": p.logprob for t, p in entry.items()}, abs=1e-4)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            extra_body={**NO_EOS, "return_tokens_as_token_ids": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset

    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=True, top_logprobs=TOP,
                                          extra_body={**NO_EOS, "return_tokens_as_token_ids": True})
    prompt_ids = httpx.post(f"{server.base_url}/tokenize", json={"messages": CHAT}).json()["tokens"]
    chat_ref = _reference(offline, prompt_ids)
    content = chat.choices[0].logprobs.content
    assert [item.token for item in content] == named(chat_ref.token_ids)
    for item, entry in zip(content, chat_ref.logprobs):
        assert item.bytes == list(item.token.encode())
        assert [t.token for t in item.top_logprobs] == named(list(entry)[:TOP])


def test_logprobs_mode_flag_reaches_the_replies(start_server, tiny_llama: Path) -> None:
    """``--logprobs-mode raw_logits``: the API's logprobs carry the model's logits (the offline engine's values)."""
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--logprobs-mode", "raw_logits")
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0, "logprobs": 2}
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
    offline = LLM(str(tiny_llama), dtype="float32", max_model_len=512, kv_cache_memory=16_000_000,
                  logprobs_mode="raw_logits")
    out = offline.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, logprobs=2),
                           use_tqdm=False)[0].outputs[0]
    assert reply["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs)], abs=1e-4)
    assert max(reply["choices"][0]["logprobs"]["token_logprobs"]) > 0  # logits: no logprob is above zero
