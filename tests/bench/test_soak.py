"""``pagellm bench soak``: a random mix of requests against a live tiny-model server (a KV pool small enough to
preempt, clients that hang up) comes back to an empty, healthy engine; and the soak's own checks flag what they
must (a 5xx, a 4xx without a message, an error event in a 200 stream, a request still running)."""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
from metrics_utils import scrape
from server_utils import ServerProcess

from pagellm.bench import soak
from pagellm.bench.client import connect


@pytest.fixture(scope="module")
def server(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    model = tiny_model_factory("llama")
    folder = tmp_path_factory.mktemp("soak-server")
    # 96 blocks of 16 tokens: a few long requests fill it, so the scheduler preempts
    server = ServerProcess(model, ["--kv-cache-memory", str(96 * 16 * 512), "--enable-auto-tool-choice",
                                   "--tool-call-parser", "hermes"], folder / "server.log")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def args(server: ServerProcess, **overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    soak.add_cli_args(parser)
    namespace = parser.parse_args(["--base-url", server.base_url, "--num-requests", "120", "--max-concurrency", "24",
                                   "--seed", "3"])
    for name, value in overrides.items():
        setattr(namespace, name, value)
    return namespace


def test_a_mixed_soak_leaves_the_engine_empty_and_healthy(server: ServerProcess,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert soak.main(args(server)) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "PROBLEM" not in out
    report = asyncio.run(soak.soak(args(server, num_requests=60, seed=4)))
    assert report["passed"] and report["health_after"] == 200
    assert report["gauges_after"] == {"num_requests_running": 0.0, "num_requests_waiting": 0.0,
                                      "kv_cache_usage_perc": 0.0}
    outcomes = report["outcomes"]  # (how many hang-ups land in time depends on the machine's speed)
    assert sum(outcomes.values()) == len(report["requests"]) == 60 and outcomes["200"] > 30
    assert all(key.startswith("4") for key in report["refusals"])  # each with its message (else a problem)
    assert scrape(server.base_url)[("pagellm:num_preemptions_total", ())] > 0


def test_the_mix_is_reproducible_and_varied() -> None:
    mixes = [soak.Mix(random.Random(7), "m") for _ in range(2)]
    plans = [[mix.request() for _ in range(200)] for mix in mixes]
    assert plans[0] == plans[1]
    paths = {path for path, _ in plans[0]}
    assert paths == {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages",
                     "/tokenize"}
    assert any(body.get("stream") for _, body in plans[0]) and any(body.get("tools") for _, body in plans[0])


def test_the_checks_flag_server_faults() -> None:
    tally = soak.Tally()
    tally.refused(400, "/v1/completions", b'{"error": {"message": "temperature: too low"}}', {})
    assert tally.messages == {"400 /v1/completions: temperature: too low": 1} and not tally.problems
    tally.refused(500, "/v1/completions", b'{"error": {"message": "boom"}}', {"prompt": "x"})
    tally.refused(422, "/v1/chat/completions", b"not json", {})
    assert len(tally.problems) == 2 and "HTTP 500" in tally.problems[0] and "HTTP 422" in tally.problems[1]
    assert soak._stream_error(b'data: {"error": {"message": "engine died"}}')
    assert soak._stream_error(b'data: {"type": "error", "message": "x"}')
    assert soak._stream_error(b'data: {"type": "error", "error": {"type": "api_error", "message": "x"}}')
    assert not soak._stream_error(b'data: {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}')
    assert not soak._stream_error(b'data: {"type": "response.created", "response": {"error": null}}')
    assert not soak._stream_error(b"data: [DONE]")


def test_a_request_still_running_is_reported(server: ServerProcess) -> None:
    """The idle check reads the engine's gauges: a request frozen mid-stream (``/pause?mode=keep``) shows as running
    with its KV blocks taken, so a soak that left one behind would fail."""
    body = {"prompt": "hi", "max_tokens": 480, "ignore_eos": True, "stream": True}

    async def gauges() -> dict[str, float]:
        async with connect(server.base_url) as http:
            return await soak._wait_idle(http, 0)

    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(lines)  # the first token is out; hundreds are still to come
            assert client.post(f"{server.base_url}/pause", params={"mode": "keep"}).status_code == 200
            try:
                frozen = asyncio.run(gauges())
            finally:
                assert client.post(f"{server.base_url}/resume").status_code == 200
            assert '"finish_reason":"length"' in "".join(lines).replace(" ", "")
    assert frozen["num_requests_running"] == 1 and frozen["kv_cache_usage_perc"] > 0
    assert not any(asyncio.run(gauges()).values())
