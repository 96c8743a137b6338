"""OpenAI's predicted outputs on chat (``prediction``) through the ``openai`` SDK: on a server with n-gram
speculation the reply equals the one without a prediction, whole and streamed, the engine accepted drafts from it
and usage says how many (``completion_tokens_details``); a server without speculation, or a malformed prediction,
is a 400 that says what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest
from server_utils import ServerProcess

MESSAGES = [{"role": "user", "content": "Rewrite my text with one word changed."}]
GREEDY = {"temperature": 0, "max_tokens": 32, "extra_body": {"ignore_eos": True}}


def _accepted(base: str) -> float:
    metrics = httpx.get(f"{base}/metrics").text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("pagellm:spec_decode_num_accepted_tokens_total"))


def plain_usage_has_no_details(client: openai.OpenAI) -> bool:
    """A request without a prediction reports no prediction counts (as OpenAI's does not)."""
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    return reply.usage.completion_tokens_details is None


def test_a_prediction_speeds_up_without_changing_the_reply(start_server: Callable[..., ServerProcess],
                                                           tiny_llama: Path, server: ServerProcess) -> None:
    speculative = start_server(tiny_llama, "--served-model-name", "tiny", "--speculative-config",
                               '{"method": "ngram", "num_speculative_tokens": 6, "disable_by_batch_size": null}')
    client = openai.OpenAI(base_url=f"{speculative.base_url}/v1", api_key="x", max_retries=0)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY).choices[0].message.content
    before = _accepted(speculative.base_url)
    predicted = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY,
                                               prediction={"type": "content", "content": plain})
    assert predicted.choices[0].message.content == plain
    accepted = _accepted(speculative.base_url) - before
    assert accepted >= 16  # most of the 32 tokens came from the prediction
    details = predicted.usage.completion_tokens_details  # OpenAI's usage fields, from the request's own counts
    assert details.accepted_prediction_tokens == accepted and details.rejected_prediction_tokens >= 0
    assert plain_usage_has_no_details(client)
    parts = [{"type": "text", "text": plain[:10]}, {"type": "text", "text": plain[10:]}]
    streamed = list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **GREEDY,
                                                   prediction={"type": "content", "content": parts},
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain
    assert streamed[-1].usage.completion_tokens_details.accepted_prediction_tokens == accepted
    with pytest.raises(openai.BadRequestError, match="prediction must be"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, prediction={"type": "diff", "content": "x"})
    without = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="prediction is drafted by n-gram speculation: start the server "
                                                     "with --speculative-config"):
        without.chat.completions.create(model="tiny", messages=MESSAGES, prediction={"type": "content",
                                                                                      "content": plain})
