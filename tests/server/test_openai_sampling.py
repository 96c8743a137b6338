"""Sampling parameters and structured outputs through the HTTP API (``openai`` SDK and raw SSE), streamed and
whole, against the offline ``LLM`` on the same tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
import transformers
from server_utils import ServerProcess

from pagellm import LLM, SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                          "n": {"type": "integer", "minimum": 1, "maximum": 9},
                                          "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "n", "tags"]}
CHAT = [{"role": "user", "content": "Give me JSON."}]


def test_penalties_and_bias_match_offline(client: openai.OpenAI, offline: LLM) -> None:
    extra = {"repetition_penalty": 1.4, "bad_words": ["e"], "ignore_eos": True}
    kwargs = dict(model="tiny", prompt="Hello hello", max_tokens=12, temperature=0, presence_penalty=0.5,
                  frequency_penalty=0.9, logit_bias={"100": 3.5, "101": -100}, extra_body=extra)
    whole = client.completions.create(**kwargs)
    params = SamplingParams(temperature=0, max_tokens=12, presence_penalty=0.5, frequency_penalty=0.9,
                            logit_bias={100: 3.5, 101: -100}, repetition_penalty=1.4, bad_words=["e"],
                            ignore_eos=True)
    ref = offline.generate(["Hello hello"], params, use_tqdm=False)[0].outputs[0]
    assert whole.choices[0].text == ref.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == ref.text
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0,
                                          frequency_penalty=1.5, extra_body={"allowed_token_ids": [120, 121, 122]})
    assert set(chat.choices[0].message.content or "") <= {"x", "y", "z"}


def test_chat_json_schema_and_json_object(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=150, temperature=1.0, seed=3,
                                           n=3, response_format=fmt)
    assert len(whole.choices) == 3
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=150, temperature=1.0, seed=3,
                                            n=3, response_format=fmt, stream=True)
    texts: dict[int, str] = {}
    for chunk in stream:
        assert len(chunk.choices) <= 1 or all(c.delta.role for c in chunk.choices)  # one choice per delta chunk
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    obj = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=150, temperature=0.8, seed=1,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


@pytest.mark.parametrize("extra,check", [
    ({"guided_regex": r"[a-c]{2}-\d{2}"}, lambda t: re.fullmatch(r"[a-c]{2}-\d{2}", t)),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_grammar": 'root ::= "(" [0-9] ")"'}, lambda t: re.fullmatch(r"\(\d\)", t)),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    # vLLM takes OpenAI's response_format on completions too
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
])
def test_completion_constraints(client: openai.OpenAI, extra: dict, check) -> None:
    for stream in (False, True):
        kwargs = dict(model="tiny", prompt="Say:", max_tokens=150, temperature=1.0, seed=5, extra_body=extra)
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
        else:
            text = client.completions.create(**kwargs).choices[0].text
        assert check(text), text


def test_echo_logprobs_score_the_prompt(client: openai.OpenAI, tiny_llama: Path) -> None:
    ids = [72, 101, 108, 108, 111, 32, 119]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))] + [ref[-1].max().item()]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    prompt_text = transformers.AutoTokenizer.from_pretrained(tiny_llama).decode(ids)
    assert out.choices[0].text.startswith(prompt_text) and len(out.choices[0].text) > len(prompt_text)
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    streamed = sum((c.choices[0].logprobs.token_logprobs for c in chunks if c.choices and c.choices[0].logprobs), [])
    assert streamed == lp.token_logprobs


def test_best_of_matches_offline(client: openai.OpenAI, offline: LLM) -> None:
    out = client.completions.create(model="tiny", prompt="Pick", max_tokens=6, temperature=1.0, seed=8, n=2,
                                    best_of=4, extra_body={"ignore_eos": True})
    ref = offline.generate(["Pick"], SamplingParams(temperature=1.0, seed=8, n=2, best_of=4, max_tokens=6,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert [c.text for c in out.choices] == [c.text for c in ref.outputs]
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 12


def test_streaming_n_interleaves_choices_by_index(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="tiny", prompt="Go", max_tokens=8, temperature=1.0, seed=2, n=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    indices = [c.choices[0].index for c in chunks if c.choices]
    assert all(len(c.choices) <= 1 for c in chunks) and set(indices) == {0, 1, 2}
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2]


def test_prompt_logprobs_extension_on_both_endpoints(server: ServerProcess, offline: LLM) -> None:
    import httpx

    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
    got = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    ref = offline.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0].prompt_logprobs
    assert ref is not None and got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == 4
    for entry, expected in zip(got["prompt_logprobs"][1:], ref[1:]):
        assert expected is not None
        assert {int(k): v["logprob"] for k, v in entry.items()} == pytest.approx(
            {k: v.logprob for k, v in expected.items()}, abs=1e-4)
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", json={
        "model": "tiny", "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0}, timeout=30).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_a_repeating_reply_ends_with_finish_reason_repetition(client: openai.OpenAI, server: ServerProcess) -> None:
    """vLLM 0.32's ``repetition_detection``: the reply ends with the token that made it repeat, streamed or not, and
    the request counts among the finished by reason "repetition"."""
    from metrics_utils import scrape, value

    extra = {"allowed_token_ids": [120, 121], "ignore_eos": True,
             "repetition_detection": {"max_pattern_size": 2, "min_count": 3}}
    before = value(scrape(server.base_url), "pagellm:request_success_total", finished_reason="repetition")
    whole = client.completions.create(model="tiny", prompt="Say:", max_tokens=60, temperature=0, extra_body=extra)
    choice = whole.choices[0]
    assert choice.finish_reason == "repetition" and whole.usage.completion_tokens < 60
    chunks = list(client.completions.create(model="tiny", prompt="Say:", max_tokens=60, temperature=0, stream=True,
                                            extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["repetition"]
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, temperature=0, extra_body=extra)
    assert chat.choices[0].finish_reason == "repetition"
    after = value(scrape(server.base_url), "pagellm:request_success_total", finished_reason="repetition")
    assert after - before == 3
