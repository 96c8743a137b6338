"""vLLM's ``--sse-keep-alive-interval``: an idle stream gets SSE comment lines (which clients skip) until its next
event, the events themselves pass unchanged, closing the stream ends the one being awaited (as a disconnect does), and
a served stream with the flag reads as without it."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import AsyncIterator, Callable

import httpx
import openai
import pytest
from server_utils import ServerProcess

from pagellm.server.openai.sse import KEEP_ALIVE, with_keep_alive
from pagellm.server.options import add_serve_args, serve_options


class _Gated:
    """Events "a", then (once ``go`` is set) "b"; records whether it was closed while waiting."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.closed_waiting = False

    async def events(self) -> AsyncIterator[str]:
        yield "data: a\n\n"
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.closed_waiting = True
            raise
        yield "data: b\n\n"


def test_an_idle_stream_gets_comments_until_its_next_event() -> None:
    async def main() -> list[str]:
        gated = _Gated()
        seen = []
        async for event in with_keep_alive(gated.events(), 0.01):
            seen.append(event)
            if seen.count(KEEP_ALIVE) == 3:
                gated.go.set()  # the next event comes only after the stream has been idle three times
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), 30))  # a wrapper that sent no comment would never see "b"
    assert seen == ["data: a\n\n", KEEP_ALIVE, KEEP_ALIVE, KEEP_ALIVE, "data: b\n\n"]


def test_closing_the_stream_ends_the_event_it_waits_for() -> None:
    async def main() -> _Gated:
        gated = _Gated()
        stream = with_keep_alive(gated.events(), 0.01)
        assert await stream.__anext__() == "data: a\n\n"
        assert await stream.__anext__() == KEEP_ALIVE
        await asyncio.wait_for(stream.aclose(), 10)  # what the server does when the client goes away: at once
        return gated

    assert asyncio.run(main()).closed_waiting


def test_the_flag_takes_seconds_and_refuses_the_rest() -> None:
    cmd = argparse.ArgumentParser()
    add_serve_args(cmd)
    assert serve_options(cmd.parse_args([])).request_defaults.sse_keep_alive_interval == 0.0
    options = serve_options(cmd.parse_args(["--sse-keep-alive-interval", "2.5"]))
    assert options.request_defaults.sse_keep_alive_interval == 2.5
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ValueError, match="--sse-keep-alive-interval must be a number of seconds >= 0"):
            serve_options(cmd.parse_args(["--sse-keep-alive-interval", bad]))


@pytest.fixture(scope="module")
def keep_alive_server(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    return start_server(tiny_llama, "--served-model-name", "tiny", "--sse-keep-alive-interval", "0.001")


def test_served_streams_read_as_without_comments(keep_alive_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{keep_alive_server.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    whole = client.completions.create(model="tiny", prompt="The sky is", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt="The sky is", max_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == whole
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True}
    with httpx.stream("POST", f"{keep_alive_server.base_url}/v1/chat/completions", json=body, timeout=60) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") or line == KEEP_ALIVE.strip() for line in lines), lines
