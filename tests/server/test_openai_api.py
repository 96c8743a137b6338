"""Completions and chat through the real ``openai`` SDK against a live server on a tiny random model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from server_utils import ServerProcess, engine_idle, wait_until

NO_EOS = {"ignore_eos": True}  # a pagellm extra field: the tiny random model may emit EOS at any point
CHAT = [{"role": "user", "content": "Say something."}]


def test_models_version_and_tokenizer_routes(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].object == "model"
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "abc"}).json()
    assert tokens["count"] == 3 and tokens["max_model_len"] == 512
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "abc"}
    chat_tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": CHAT}).json()
    assert chat_tokens["count"] > 3
    card = client.models.retrieve("tiny")  # GET /v1/models/{model}
    assert card.id == "tiny" and card.object == "model" and card.model_extra["max_model_len"] == 512
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4o` does not exist"):
        client.models.retrieve("gpt-4o")


def test_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=7, temperature=0, extra_body=NO_EOS)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == "tiny"
    assert out.created > 0 and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 7 and out.usage.total_tokens == 12


def test_completion_echo_and_token_prompts(server: ServerProcess, client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", max_tokens=4, temperature=0, extra_body=NO_EOS)
    plain = client.completions.create(prompt="Hi there", **kwargs)
    echoed = client.completions.create(prompt="Hi there", echo=True, **kwargs)
    assert echoed.choices[0].text == "Hi there" + plain.choices[0].text
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hi there"}).json()["tokens"]
    from_ids = client.completions.create(prompt=ids, echo=True, **kwargs)
    assert from_ids.choices[0].text == echoed.choices[0].text
    batch = client.completions.create(prompt=["Hi there", "Other"], n=2, **kwargs)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)][:2] == [plain.choices[0].text] * 2
    assert batch.usage.prompt_tokens == 8 + 5 and batch.usage.completion_tokens == 16
    streamed = list(client.completions.create(prompt="Hi there", echo=True, stream=True, **kwargs))
    assert streamed[0].choices[0].text.startswith("Hi there")
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_completion_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny", prompt="Stream me", max_tokens=12, temperature=0,
                                      extra_body=NO_EOS)
    chunks = list(client.completions.create(model="tiny", prompt="Stream me", max_tokens=12, temperature=0,
                                            extra_body=NO_EOS, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=6, temperature=0,
                                         extra_body=NO_EOS)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == "tiny"
    message = out.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    # <|im_start|> and <|im_end|> are one token each; every other character is one byte token
    rendered = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
    assert out.usage.prompt_tokens == len(rendered.replace("<|im_start|>", "S").replace("<|im_end|>", "E"))


def test_extra_sampling_fields_are_honoured(client: openai.OpenAI) -> None:
    extra = {"top_k": 5, "min_p": 0.05, "min_tokens": 4, "stop_token_ids": [257], "priority": 0}
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0.7, top_p=0.9,
                                         seed=3, user="user-1", extra_body=extra)
    assert 4 <= out.usage.completion_tokens <= 6
    greedy = client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0,
                                       extra_body=NO_EOS)
    first_token = httpx.post(f"{client.base_url}".replace("/v1/", "/tokenize"),
                             json={"prompt": greedy.choices[0].text}).json()["tokens"][0]
    stopped = client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [first_token]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 10
    assert stopped.choices[0].stop_reason == first_token  # pagellm (vLLM) extension field


def test_chat_stream_role_first_and_usage_last(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                           extra_body=NO_EOS)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                                 extra_body=NO_EOS, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id.startswith("chatcmpl-") for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    no_usage = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, stream=True))
    assert all(c.usage is None for c in no_usage)


def test_n_and_seed(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=8, temperature=1.0, seed=1234, extra_body=NO_EOS)
    first = client.chat.completions.create(n=2, **kwargs)
    again = client.chat.completions.create(n=2, **kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 16
    other = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=1.0, seed=99,
                                           extra_body=NO_EOS)
    assert other.choices[0].message.content != first.choices[0].message.content
    streamed = list(client.chat.completions.create(n=2, stream=True, **kwargs))
    by_index = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] += choice.delta.content or ""
    assert [by_index[0], by_index[1]] == [c.message.content for c in first.choices]


def test_n_siblings_are_seeded_and_reproducible(client: openai.OpenAI) -> None:
    """n samples are the engine's siblings: sibling i samples with seed + i, so they differ but repeat."""
    kwargs = dict(model="tiny", max_tokens=12, temperature=1.0, extra_body=NO_EOS)
    first = client.completions.create(prompt="Once upon", n=2, seed=42, **kwargs)
    again = client.completions.create(prompt="Once upon", n=2, seed=42, **kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    lone = client.completions.create(prompt="Once upon", seed=43, **kwargs)
    assert lone.choices[0].text == texts[1]
    batch = client.completions.create(prompt=["Other", "Once upon"], n=2, seed=42, **kwargs)
    by_index = {c.index: c.text for c in batch.choices}
    assert sorted(by_index) == [0, 1, 2, 3] and [by_index[2], by_index[3]] == texts
    assert batch.usage.completion_tokens == 4 * 12


def test_stop_strings_and_max_tokens(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, extra_body=NO_EOS)
    text = base.choices[0].text
    assert base.usage.completion_tokens == 20
    stop = text[5:7] if text[5:7].strip() else text[5]
    cut = text[: text.index(stop)]
    stopped = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0,
                                        extra_body=NO_EOS, stop=[stop, "\x00never"])
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0,
                                              extra_body=NO_EOS, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_greedy_matches_offline_llm(client: openai.OpenAI, tiny_llama: Path) -> None:
    from pagellm import LLM, SamplingParams

    prompt = "The quick brown fox"
    served = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                       extra_body=NO_EOS)
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=512, kv_cache_memory=16_000_000)
    offline = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)[0]
    assert served.choices[0].text == offline.outputs[0].text
    assert served.usage.completion_tokens == len(offline.outputs[0].token_ids)


def test_async_client_concurrent_streaming_chats(server: ServerProcess) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, int]:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Request number {i}"}], max_tokens=8 + i % 5,
            temperature=0.8, seed=i, extra_body=NO_EOS, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-2].choices[0].finish_reason == "length"
        return chunks[-1].usage.completion_tokens, chunks[-1].usage.prompt_tokens, 8 + i % 5

    async def main() -> list[tuple[int, int, int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64
    for completion_tokens, prompt_tokens, expected in results:
        assert completion_tokens == expected and prompt_tokens > 0
    wait_until(lambda: engine_idle(server.base_url), 30, "the engine to go idle")


def _generated_tokens(server: ServerProcess) -> int:
    return httpx.get(f"{server.base_url}/stats").json()["num_generation_tokens"]


def test_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    # 32 samples of 480 tokens take the tiny model seconds; the client leaves after a few chunks.
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 480, "n": 32, "ignore_eos": True, "stream": True}
    before = _generated_tokens(server)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in received)
            stats = http.get(f"{server.base_url}/stats").json()
            assert stats["num_running_reqs"] + stats["num_waiting_reqs"] >= 1 and stats["kv_cache_usage"] > 0
    wait_until(lambda: engine_idle(server.base_url), 20, "the aborted stream's blocks to be freed")
    assert _generated_tokens(server) - before < 32 * 480  # aborted, not run to the end


def test_disconnect_non_streaming_frees_blocks(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 480, "n": 32, "ignore_eos": True}
    before = _generated_tokens(server)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.3)
    wait_until(lambda: engine_idle(server.base_url), 20, "the abandoned request's blocks to be freed")
    assert _generated_tokens(server) - before < 32 * 480
    assert "client disconnected" in server.log()


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client: openai.OpenAI) -> None:
    # The byte tokenizer makes one token per character: 80 tokens, five whole blocks of 16. A text no other test sends.
    prompt = "usage-cache " + "".join(chr(ord("a") + (i * 7) % 26) for i in range(68))
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body=NO_EOS)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, n=2, extra_body=NO_EOS)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == 80
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every whole block of the prompt but the one holding its last token, which is computed again for its logits
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body=NO_EOS)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS)
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens >= 64
    assert usage[0].prompt_tokens_details.cached_tokens % 16 == 0


def test_reset_prefix_cache_makes_a_repeated_prompt_miss(server: ServerProcess, client: openai.OpenAI) -> None:
    prompt = "reset-cache " + "".join(chr(ord("a") + (i * 11) % 26) for i in range(52))  # 64 tokens, 4 blocks
    for _ in range(2):
        warm = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body=NO_EOS)
    assert warm.usage.prompt_tokens_details.cached_tokens == 48
    wait_until(lambda: engine_idle(server.base_url), 30, "the engine to go idle")
    assert httpx.post(f"{server.base_url}/reset_prefix_cache").json() == {"reset": True}
    cold = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body=NO_EOS)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=440, stream=True, extra_body=NO_EOS)
    next(iter(stream))  # the request runs: it holds blocks
    busy = httpx.post(f"{server.base_url}/reset_prefix_cache")
    assert busy.status_code == 409 and "only while no request runs" in busy.json()["error"]["message"]
    stream.close()
    wait_until(lambda: engine_idle(server.base_url), 30, "the aborted request's blocks to come back")
