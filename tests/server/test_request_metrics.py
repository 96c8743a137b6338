"""Per-request metrics in the responses (vLLM's ``--enable-per-request-metrics`` and
``--per-request-spec-decode-metrics``) through the ``openai`` SDK and raw HTTP: a server with both and n-gram
speculation answers each one-sample request with its timing and its drafts' acceptance, consistent with each other
and with the usage, whole and in a stream's usage chunk (completions, chat and the Responses API); requests of
several samples, and a server without the flags, carry none. And vLLM's ``--custom-histogram-buckets`` sets the
bounds of the Prometheus histograms, and ``--kv-cache-metrics`` fills the KV blocks' residency histograms."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest
from server_utils import ServerProcess

K = 4  # num_speculative_tokens
REPEATING = "one two three four one two three four one two three four one two"


@pytest.fixture(scope="module")
def measured(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--enable-per-request-metrics",
                        "--per-request-spec-decode-metrics", "detailed", "--speculative-config",
                        f'{{"method": "ngram", "num_speculative_tokens": {K}, "prompt_lookup_min": 1}}',
                        "--custom-histogram-buckets", '{"time_to_first_token": [0.25, 30], "request_tokens": [8, 64]}',
                        "--kv-cache-metrics", "--kv-cache-metrics-sample", "1", "--num-gpu-blocks-override", "40")
    yield server
    server.stop()  # not left running (idle) for the rest of the session


def _check(metrics: dict[str, Any], num_tokens: int) -> None:
    """The timing and acceptance figures of one generation of ``num_tokens`` tokens agree with each other."""
    for name in ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"):
        assert metrics[name] is not None and metrics[name] >= 0, name
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / (num_tokens - 1))
    elapsed = metrics["time_to_first_token_ms"] + metrics["generation_time_ms"]
    assert metrics["tokens_per_second"] == pytest.approx(num_tokens / elapsed * 1000)
    spec = metrics["speculative_decoding"]
    histogram, accepted, drafted = spec["acceptance_histogram"], spec["per_step_accepted"], spec["per_step_drafted"]
    assert len(histogram) == K + 1 and spec["num_spec_tokens"] == K
    assert sum(histogram) == spec["num_spec_steps"] == len(accepted) == len(drafted) > 0
    assert histogram == [accepted.count(j) for j in range(K + 1)]
    assert sum(accepted) == spec["num_accepted_draft_tokens"] > 0 and sum(drafted) == spec["num_draft_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + sum(accepted) / len(accepted))
    assert spec["draft_acceptance_rate"] == pytest.approx(sum(accepted) / sum(drafted))
    assert spec["num_spec_steps"] + sum(accepted) <= num_tokens  # each step gave its accepted drafts and one more


def test_one_generation_carries_its_timing_and_acceptance(measured: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": REPEATING, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{measured.base_url}/v1/completions", json=body, timeout=60).json()
    _check(whole["metrics"], whole["usage"]["completion_tokens"])
    client = openai.OpenAI(base_url=f"{measured.base_url}/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": REPEATING}],
                                          max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    _check(chat.model_extra["metrics"], chat.usage.completion_tokens)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": REPEATING}],
                                                 max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert [c.model_extra.get("metrics") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    _check(chunks[-1].model_extra["metrics"], chunks[-1].usage.completion_tokens)
    stream = list(client.completions.create(model="tiny", prompt=REPEATING, max_tokens=24, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))  # no usage chunk: nowhere to carry them
    assert all(c.model_extra.get("metrics") is None for c in stream)
    response = client.responses.create(model="tiny", input=REPEATING, max_output_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})  # the Responses API, as vLLM's
    _check(response.model_extra["metrics"], response.usage.output_tokens)
    events = list(client.responses.create(model="tiny", input=REPEATING, max_output_tokens=24, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True}))
    _check(events[-1].response.model_extra["metrics"], events[-1].response.usage.output_tokens)


def test_several_samples_or_prompts_carry_none(measured: ServerProcess, server: ServerProcess) -> None:
    for body in ({"prompt": REPEATING, "n": 2, "temperature": 1}, {"prompt": [REPEATING, "two"]}):
        reply = httpx.post(f"{measured.base_url}/v1/completions", timeout=60,
                           json={"model": "tiny", "max_tokens": 8, **body}).json()
        assert "metrics" not in reply and len(reply["choices"]) == 2
    plain = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": REPEATING, "max_tokens": 4}).json()
    assert "metrics" not in plain
    response = httpx.post(f"{server.base_url}/v1/responses", timeout=60,
                          json={"model": "tiny", "input": REPEATING, "max_output_tokens": 4}).json()
    assert "metrics" not in response and response["status"] == "incomplete"


def test_what_is_not_asked_for_is_left_out_of_the_json() -> None:
    """As vLLM's: no ``speculative_decoding`` without the spec flag (or without drafts), no per-step lists at
    ``summary``; timing figures whose times are unknown are null."""
    from pagellm.outputs import RequestMetrics
    from pagellm.server.openai.request_metrics import response_metrics

    done = RequestMetrics(arrival_time=1.0, first_token_time=2.0, last_token_time=2.5, queued_time=1.0,
                          scheduled_time=1.5)
    done.observe_spec(3, 2)
    timing_only = response_metrics(done, 6, True, True, "none", 3).model_dump(mode="json")
    assert "speculative_decoding" not in timing_only and timing_only["mean_itl_ms"] == pytest.approx(100.0)
    summary = response_metrics(done, 6, True, False, "summary", 3).model_dump(mode="json")
    assert summary["speculative_decoding"]["acceptance_histogram"] == [0, 0, 1, 0]
    assert "per_step_accepted" not in summary["speculative_decoding"] and summary["tokens_per_second"] is None
    assert response_metrics(RequestMetrics(arrival_time=1.0), 0, True, False, "detailed", 3) is None  # no drafts
    assert response_metrics(done, 6, False, True, "detailed", 3) is None  # not one generation


def test_custom_histogram_buckets_replace_a_familys_bounds(measured: ServerProcess) -> None:
    httpx.post(f"{measured.base_url}/v1/completions", timeout=60,
               json={"model": "tiny", "prompt": REPEATING, "max_tokens": 4})
    text = httpx.get(f"{measured.base_url}/metrics").text

    def bounds(series: str) -> list[str]:
        return [line.split('le="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith(f"pagellm:{series}_bucket")]

    assert bounds("time_to_first_token_seconds") == ["0.25", "30.0", "+Inf"]
    assert bounds("request_prompt_tokens") == bounds("request_generation_tokens") == ["8.0", "64.0", "+Inf"]
    assert len(bounds("e2e_request_latency_seconds")) > 3  # families not given keep their defaults


@pytest.mark.parametrize(("value", "message"), [
    ('{"ttft": [1]}', "unknown family 'ttft'"),
    ('{"request_latency": [1, 1]}', "strictly increasing"),
    ('{"request_latency": []}', "non-empty list"),
    ('{"request_latency": [-1, 2]}', "positive"),
])
def test_bad_histogram_buckets_are_refused_by_name(value: str, message: str) -> None:
    import argparse

    from pagellm.server.options import add_serve_args, serve_options

    cmd = argparse.ArgumentParser()
    add_serve_args(cmd)
    with pytest.raises(ValueError, match=message):
        serve_options(cmd.parse_args(["--custom-histogram-buckets", value]))


def test_kv_cache_metrics_follow_blocks_to_their_eviction(measured: ServerProcess) -> None:
    """With every block followed (``--kv-cache-metrics-sample 1``) and a 40-block cache, distinct prompts evict
    each other's cached blocks: each eviction is one lifetime and one idle time; hits on a prompt sent again are
    reuse gaps."""
    def count(series: str) -> float:
        text = httpx.get(f"{measured.base_url}/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"pagellm:{series}_count"))

    before = count("kv_block_lifetime_seconds")
    for i in range(12):  # about 40 distinct 16-token blocks each time round: the pool turns over
        prompt = f"{i:02d} " + "".join(chr(97 + (i * 7 + j) % 26) for j in range(60))
        for _ in range(3 if i == 0 else 1):  # the first prompt thrice: hits, and gaps between them
            httpx.post(f"{measured.base_url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert count("kv_block_lifetime_seconds") > before
    assert count("kv_block_idle_before_evict_seconds") == count("kv_block_lifetime_seconds")
    assert count("kv_block_reuse_gap_seconds") > 0
