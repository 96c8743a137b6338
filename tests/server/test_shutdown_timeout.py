"""vLLM's ``--shutdown-timeout``: on SIGTERM the server takes no new connection, lets the requests in flight finish
for up to that many seconds, then stops the engine; with 0 it cuts them at once."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Callable

import httpx
from server_utils import ServerProcess

BODY = {"model": "tiny", "prompt": "a", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True,
        "return_token_ids": True}


def _stream_through_sigterm(server: ServerProcess) -> tuple[int, bool]:
    """A long stream's token count and whether it ended with [DONE], the server sent SIGTERM after its first chunk."""
    tokens, done, sent = 0, False, False
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.base_url}/v1/completions",
                                                        json=BODY) as reply:
        try:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    tokens += len(json.loads(line[6:])["choices"][0]["token_ids"] or [])
                    if not sent:
                        server.proc.send_signal(signal.SIGTERM)
                        sent = True
                done = done or line == "data: [DONE]"
        except httpx.HTTPError:  # the connection cut mid-stream
            pass
    return tokens, done


def test_requests_in_flight_finish_within_the_timeout(start_server: Callable[..., ServerProcess],
                                                      tiny_llama: Path) -> None:
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--shutdown-timeout", "60")
    assert _stream_through_sigterm(server) == (500, True)
    assert server.proc.wait(60) == 0 and "shutting down the engine" in server.log()


def test_a_zero_timeout_cuts_them(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> None:
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--shutdown-timeout", "0")
    tokens, done = _stream_through_sigterm(server)
    assert tokens < 500 and not done
    assert server.proc.wait(60) == 0
