"""A request's preparation (tokenization above all) runs off the server's event loop: megabytes of prompt text
take the tokenizer seconds, and on the loop they stalled every other request and stream for as long. Text that
cannot fit ``max_model_len`` is refused before it is tokenized at all."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import httpx
from server_utils import ServerProcess

from pagellm.server.openai.serving_engine import INLINE_BYTES, prepared
from pagellm.tokenizer import Tokenizer


def test_small_requests_are_prepared_in_place_large_ones_on_the_thread() -> None:
    def where(body: str) -> str:
        if body == "bad":
            raise ValueError("refused")  # a 4xx, raised where the route awaits it
        return threading.current_thread().name

    async def run() -> tuple[str, str, str]:
        small, large = await prepared(where, "ok", INLINE_BYTES), await prepared(where, "ok", INLINE_BYTES + 1)
        try:
            await prepared(where, "bad", INLINE_BYTES + 1)
        except ValueError as exc:
            return small, large, str(exc)
        return small, large, "not raised"

    assert asyncio.run(run()) == ("MainThread", "prepare_0", "refused")


def test_a_long_tokenization_does_not_stall_the_server(start_server: Callable[..., ServerProcess],
                                                       tiny_llama: Path) -> None:
    server = start_server(tiny_llama, "--served-model-name", "tiny")
    # 2.4 MB the byte-level test tokenizer makes 2.4 million tokens of (seconds), cut to its last 8 to be served
    slow_body = {"model": "tiny", "prompt": "hello world " * 200_000, "max_tokens": 1, "truncate_prompt_tokens": 8}
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=120) as http:
        start = time.monotonic()
        slow = pool.submit(http.post, f"{server.base_url}/v1/completions", json=slow_body)
        waits = []
        while not slow.done():  # requests the event loop answers itself, one after another meanwhile
            asked = time.monotonic()
            assert http.get(f"{server.base_url}/v1/models").status_code == 200
            waits.append(time.monotonic() - asked)
        took = time.monotonic() - start
        assert slow.result().status_code == 200, slow.result().text
    assert slow.result().json()["usage"]["prompt_tokens"] == 8
    # on the loop, one of them waited for the whole tokenization: most of the slow request's time
    assert len(waits) > 1 and max(waits) < 0.5 * took, (max(waits), took)


def test_text_too_long_for_the_context_is_refused_untokenized(server: ServerProcess, tiny_llama: Path) -> None:
    longest = Tokenizer.from_dir(tiny_llama).max_token_chars
    assert longest == len("<|im_start|>")  # the test tokenizer: one byte a token, and its chat special tokens
    too_long = "x" * (512 * longest + 1)  # the server's max_model_len is 512
    for route, body in [("completions", {"model": "tiny", "prompt": too_long, "max_tokens": 1}),
                        ("completions", {"model": "tiny", "prompt": ["hi", too_long], "max_tokens": 1}),
                        ("chat/completions", {"model": "tiny", "max_tokens": 1,
                                              "messages": [{"role": "user", "content": too_long}]})]:
        reply = httpx.post(f"{server.base_url}/v1/{route}", json=body, timeout=30)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert f"has {len(too_long)} characters, more than max_model_len (512) tokens of at most {longest}" \
            in error["message"]
    # cut to its last tokens, the same text is what the client meant: served
    kept = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": too_long, "max_tokens": 1, "truncate_prompt_tokens": 16})
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 16
