"""Streamed token chunks written straight to SSE text, without building pydantic models per token.

Contract: ``ChunkWriter(kind, request_id, created, model)``'s ``text_choice(index, text, finish_reason,
stop_reason, usage=None)`` returns ``data: {json}\\n\\n`` byte for byte equal to what ``model_dump_json`` gives for
the ``CompletionResponse`` (``kind="completion"``) or ``ChatCompletionChunk`` (``kind="chat"``, ``text`` as the
delta's ``content``, omitted as null when empty) holding that one choice with no logprobs, and the usage whose JSON
``usage`` is (``stream_options.continuous_usage_stats``), or none. Chunks
that carry logprobs, usage or the chat role still go through the pydantic models (``tests/server/test_chunks.py``
checks the equality over awkward texts and every finish reason). Strings are JSON-escaped by ``msgspec``, which
escapes exactly as pydantic does (control characters as ``\\u00XX`` except ``\\b\\f\\n\\r\\t``; other text as
UTF-8).
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

_encode = msgspec.json.Encoder().encode


def _json(value: Union[str, int, None]) -> str:
    return _encode(value).decode()


class ChunkWriter:
    """Per-stream prefix and suffix computed once; each chunk only encodes its text and reasons."""

    def __init__(self, kind: Literal["completion", "chat"], request_id: str, created: int, model: str) -> None:
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        self._chat = kind == "chat"
        self._head = (f'data: {{"id":{_json(request_id)},"object":"{obj}","created":{created},'
                      f'"model":{_json(model)},"choices":[{{"index":')
        self._tail = '}],"usage":null,"system_fingerprint":null}\n\n'

    def text_choice(self, index: int, text: str, finish_reason: str | None,
                    stop_reason: Union[int, str, None], usage: str | None = None) -> str:
        if self._chat:
            content = _json(text) if text else "null"
            body = f'"delta":{{"role":null,"content":{content},"tool_calls":null,"reasoning_content":null}},' \
                   '"logprobs":null'
        else:
            body = f'"text":{_json(text)},"logprobs":null'
        reasons = f'"finish_reason":{_json(finish_reason)},"stop_reason":{_json(stop_reason)}'
        extra = "" if self._chat else ',"prompt_logprobs":null'
        tail = self._tail if usage is None else f'}}],"usage":{usage},"system_fingerprint":null}}\n\n'
        return f"{self._head}{index},{body},{reasons}{extra}{tail}"
