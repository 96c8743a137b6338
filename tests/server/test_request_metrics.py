"""Per-request metrics in the responses (vLLM's ``--enable-per-request-metrics`` and
``--per-request-spec-decode-metrics``) through the ``openai`` SDK and raw HTTP: a server with both and n-gram
speculation answers each one-sample request with its timing and its drafts' acceptance, consistent with each other
and with the usage, whole and in a stream's usage chunk; requests of several samples, and a server without the
flags, carry none."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import httpx
import openai
import pytest
from server_utils import ServerProcess

K = 4  # num_speculative_tokens
REPEATING = "one two three four one two three four one two three four one two"


@pytest.fixture(scope="module")
def measured(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    return start_server(tiny_llama, "--served-model-name", "tiny", "--enable-per-request-metrics",
                        "--per-request-spec-decode-metrics", "detailed", "--speculative-config",
                        f'{{"method": "ngram", "num_speculative_tokens": {K}, "prompt_lookup_min": 1}}')


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


def test_several_samples_or_prompts_carry_none(measured: ServerProcess, server: ServerProcess) -> None:
    for body in ({"prompt": REPEATING, "n": 2, "temperature": 1}, {"prompt": [REPEATING, "two"]}):
        reply = httpx.post(f"{measured.base_url}/v1/completions", timeout=60,
                           json={"model": "tiny", "max_tokens": 8, **body}).json()
        assert "metrics" not in reply and len(reply["choices"]) == 2
    plain = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": REPEATING, "max_tokens": 4}).json()
    assert "metrics" not in plain
