"""vLLM's ``--stream-interval``: a served stream sends its first token at once, then a chunk per N new tokens (the
last may be shorter); a request's ``stream_interval`` may raise N but not lower it, and a bad one is a 400. The
tokens are the same as unstreamed."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest
from server_utils import ServerProcess

CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def paced_server(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    return start_server(tiny_llama, "--served-model-name", "tiny", "--stream-interval", "3")


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)


def _sizes(chunks: list, key: str = "token_ids") -> tuple[list[int], list[int]]:
    """Each chunk's count of new token ids (chunks without any left out), and the ids in order."""
    groups = [c.choices[0].model_extra.get(key) for c in chunks if c.choices]
    groups = [g for g in groups if g]
    return [len(g) for g in groups], [t for g in groups for t in g]


def _whole(server: ServerProcess, max_tokens: int) -> list[int]:
    body = {"model": "tiny", "prompt": "The sky is", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    return httpx.post(f"{server.base_url}/v1/completions", json=body).json()["choices"][0]["token_ids"]


def _grouped(stream: Callable[[], list], pace: int) -> tuple[list, list[int], list[int]]:
    """One stream's chunks, sizes and ids, where no chunk but the first and the last has under ``pace`` tokens.

    A consumer that falls behind gets its deltas merged, so on a loaded machine a stream can come in only two large
    chunks, which shows nothing of the pacing: such a stream is checked, then asked for again (three tries)."""
    for _ in range(3):
        chunks = stream()
        sizes, ids = _sizes(chunks)
        assert all(size >= pace for size in sizes[1:-1]), sizes
        if len(sizes) >= 3:
            return chunks, sizes, ids
    raise AssertionError(f"three streams each came in under three chunks: {sizes}")


@pytest.mark.parametrize("asked, pace", [(None, 3), (1, 3), (5, 5)])
def test_completion_streams_come_in_groups(paced_server: ServerProcess, asked: int | None, pace: int) -> None:
    extra = {"ignore_eos": True, "return_token_ids": True}
    if asked is not None:
        extra["stream_interval"] = asked
    chunks, sizes, ids = _grouped(lambda: list(_client(paced_server).completions.create(
        model="tiny", prompt="The sky is", stream=True, max_tokens=29, temperature=0, extra_body=extra)), pace)
    assert ids == _whole(paced_server, 29)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streams_come_in_groups(paced_server: ServerProcess) -> None:
    chunks, sizes, ids = _grouped(lambda: list(_client(paced_server).chat.completions.create(
        model="tiny", messages=CHAT, stream=True, max_tokens=27, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "stream_interval": 4})), 4)
    assert sum(sizes) == 27
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_bad_stream_interval_is_a_400(paced_server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True, "stream_interval": 0}
    reply = httpx.post(f"{paced_server.base_url}/v1/completions", json=body)
    assert reply.status_code == 400 and "stream_interval" in reply.text
    assert len(_whole(paced_server, 2)) == 2  # the server goes on serving
