"""The hand-written stream chunks equal the pydantic models' JSON byte for byte (the SDK parses either)."""

from __future__ import annotations

import pytest

from pagellm.server.openai.chunks import ChunkWriter
from pagellm.server.openai.replies import (ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice,
                                           CompletionResponse, UsageInfo)

TEXTS = ["", " hello", 'quote " back\\slash', "tab\tnew\nline\r\x00\x1f\x7f", "naïve 日本 🙂 \u2028\u2029",
         "</script>&<>'"]
REASONS = [(None, None), ("stop", None), ("stop", "###"), ("stop", 2), ("length", None), ("abort", None)]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish_reason,stop_reason", REASONS)
def test_completion_chunk_matches_pydantic(text: str, finish_reason: str | None, stop_reason: object) -> None:
    writer = ChunkWriter("completion", "cmpl-1\"x", 1700000000, "my/model ü")
    body = CompletionResponse(id="cmpl-1\"x", created=1700000000, model="my/model ü", choices=[
        CompletionChoice(index=3, text=text, finish_reason=finish_reason, stop_reason=stop_reason)])
    assert writer.text_choice(3, text, finish_reason, stop_reason) == f"data: {body.model_dump_json()}\n\n"


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish_reason,stop_reason", REASONS)
def test_chat_chunk_matches_pydantic(text: str, finish_reason: str | None, stop_reason: object) -> None:
    writer = ChunkWriter("chat", "chatcmpl-9", 5, "m")
    delta = ChatDelta(content=text) if text else ChatDelta()
    body = ChatCompletionChunk(id="chatcmpl-9", created=5, model="m", choices=[
        ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason, stop_reason=stop_reason)])
    assert writer.text_choice(0, text, finish_reason, stop_reason) == f"data: {body.model_dump_json()}\n\n"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_chunk_with_the_usage_so_far_matches_pydantic(kind: str) -> None:
    """``stream_options.continuous_usage_stats``: each chunk carries the usage."""
    usage = UsageInfo.of(7, 3, 2)
    writer = ChunkWriter(kind, "id-1", 5, "m")
    if kind == "chat":
        body = ChatCompletionChunk(id="id-1", created=5, model="m", usage=usage, choices=[
            ChatChunkChoice(index=1, delta=ChatDelta(content=" hi"), finish_reason="stop")])
    else:
        body = CompletionResponse(id="id-1", created=5, model="m", usage=usage, choices=[
            CompletionChoice(index=1, text=" hi", finish_reason="stop")])
    assert writer.text_choice(1, " hi", "stop", None, usage.model_dump_json()) == f"data: {body.model_dump_json()}\n\n"
