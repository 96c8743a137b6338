"""vLLM 0.32's tokens-in, tokens-out API (``POST /inference/v1/generate``): the offline engine's exact tokens and
logprobs for the same token ids and sampling parameters, whole and streamed, in the tokens and the text output modes;
a stream ends at ``/inference/v1/abort_requests``; what the API cannot take is a 400 that names it."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
from server_utils import ServerProcess

from pagellm import LLM, SamplingParams

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # "Hello, world" in the byte vocabulary
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def scale_out(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--enable-scale-out")
    yield server
    server.stop()  # not left running (idle) for the rest of the session


def _generate(server: ServerProcess, **body: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}/inference/v1/generate", json={"token_ids": PROMPT, **body}, timeout=60)


def _events(reply: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_tokens_in_tokens_out_match_the_offline_engine(scale_out: ServerProcess, offline: LLM) -> None:
    ref = offline.generate([PROMPT], SamplingParams(**GREEDY, logprobs=2), use_tqdm=False)[0].outputs[0]
    whole = _generate(scale_out, sampling_params={**GREEDY, "logprobs": 2}, request_id="abc", return_token_ids=True)
    assert whole.status_code == 200, whole.text
    body = whole.json()
    (choice,) = body["choices"]
    assert body["request_id"] == "generate-tokens-abc" and body["output_mode"] == "tokens" and "text" not in choice
    assert choice["token_ids"] == list(ref.token_ids) and choice["finish_reason"] == "length"
    assert body["prompt_token_ids"] == PROMPT and body["usage"]["prompt_tokens"] == len(PROMPT)
    assert body["usage"]["completion_tokens"] == 8
    for item, token, entry in zip(choice["logprobs"]["content"], ref.token_ids, ref.logprobs):
        assert item["token_id"] == token and item["logprob"] == pytest.approx(entry[token].logprob, abs=1e-4)
        assert [t["token_id"] for t in item["top_logprobs"]] == list(entry)[:2] and item["rank"] == 1
    events = _events(httpx.post(f"{scale_out.base_url}/inference/v1/generate", timeout=60, json={
        "token_ids": PROMPT, "sampling_params": GREEDY, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True}}))
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == list(ref.token_ids)
    assert events[0]["prompt_token_ids"] == PROMPT and all("prompt_token_ids" not in e for e in events[1:])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"


def test_text_mode_samples_and_defaults(scale_out: ServerProcess, offline: LLM) -> None:
    """``output_mode: "text"`` adds the text; ``n`` samples come as choices; left out, ``max_tokens`` runs to the
    context's end (here a stop token ends it) rather than vLLM's SamplingParams default of 16."""
    ref = offline.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    text = _generate(scale_out, sampling_params={**GREEDY, "logprobs": 0}, output_mode="text").json()
    assert text["choices"][0]["text"] == ref.text and text["output_mode"] == "text"
    assert text["choices"][0]["logprobs"]["content"][0]["token"] == offline.get_tokenizer().decode([ref.token_ids[0]])
    two = _generate(scale_out, sampling_params={"n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 4}).json()
    assert sorted(c["index"] for c in two["choices"]) == [0, 1] and two["usage"]["completion_tokens"] == 8
    longer = list(offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                                   use_tqdm=False)[0].outputs[0].token_ids)
    end = next(i for i in range(17, 60) if longer[i] not in longer[:i])  # a token first seen past the 16th
    long = _generate(scale_out, sampling_params={"temperature": 0, "ignore_eos": True,
                                              "stop_token_ids": [longer[end]]}).json()
    assert long["choices"][0]["token_ids"] == longer[:end + 1] and long["choices"][0]["finish_reason"] == "stop"


def test_a_stream_ends_at_abort_requests(scale_out: ServerProcess) -> None:
    got: list[dict] = []

    def read() -> None:
        with httpx.stream("POST", f"{scale_out.base_url}/inference/v1/generate", timeout=60, json={
                "token_ids": PROMPT, "request_id": "long-one", "stream": True,
                "sampling_params": {"temperature": 0, "max_tokens": 400, "ignore_eos": True}}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    got.append(json.loads(line[6:]))

    reader = threading.Thread(target=read)
    reader.start()
    while not got:
        reader.join(0.05)
    reply = httpx.post(f"{scale_out.base_url}/inference/v1/abort_requests", timeout=30,
                       json={"request_ids": ["generate-tokens-long-one"]})
    assert reply.status_code == 200
    reader.join(60)
    assert not reader.is_alive()
    assert [c["finish_reason"] for e in got for c in e["choices"]][-1] == "abort"
    assert sum(len(c["token_ids"]) for e in got for c in e["choices"]) < 400


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"sampling_params": {"temprature": 0}}, "sampling_params", "unknown fields ['temprature']"),
    ({"sampling_params": {"top_p": 3}}, "sampling_params", "top_p must be in (0, 1]"),
    ({"sampling_params": {}, "token_ids": [400]}, "prompt", "token ids must be in [0, 320)"),
    ({"sampling_params": {}, "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params", "not supported"),
    ({"sampling_params": {}, "features": {"mm_hashes": {}}}, "features", "not supported"),
    ({"sampling_params": {}, "model": "other"}, "model", "does not exist"),
])
def test_what_the_api_cannot_take_is_a_400_naming_it(scale_out: ServerProcess, body: dict, param: str,
                                                     message: str) -> None:
    reply = httpx.post(f"{scale_out.base_url}/inference/v1/generate", timeout=30, json={"token_ids": PROMPT, **body})
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_a_tokens_only_server_serves_that_api_alone(start_server: Callable[..., ServerProcess], tiny_llama: Path,
                                                     server: ServerProcess) -> None:
    """vLLM's ``--tokens-only``: the OpenAI routes are gone, no text is decoded (text mode and stop strings are
    400s that say what to send instead), and vLLM's older ``/abort_requests`` path answers too."""
    only = start_server(tiny_llama, "--served-model-name", "tiny", "--tokens-only")
    assert httpx.post(f"{only.base_url}/v1/completions", json={"prompt": "hi"}, timeout=30).status_code == 404
    reply = _generate(only, sampling_params=GREEDY)
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) == 8
    for body in ({"output_mode": "text", "sampling_params": GREEDY}, {"sampling_params": {**GREEDY, "stop": ["."]}}):
        refused = _generate(only, **body)
        assert refused.status_code == 400 and "decodes no text" in refused.json()["error"]["message"]
    assert httpx.post(f"{only.base_url}/abort_requests", json={"request_ids": ["gone"]}, timeout=30).status_code == 200
    assert httpx.get(f"{only.base_url}/health", timeout=30).status_code == 200
    only.stop()
    off = _generate(server, sampling_params=GREEDY)  # neither flag: vLLM's 403, which says how to turn it on
    assert off.status_code == 403 and "--enable-scale-out" in off.json()["error"]["message"]
    off = httpx.post(f"{server.base_url}/v1/messages/render", json={}, timeout=30)
    assert off.status_code == 403 and "--enable-scale-out" in off.json()["error"]["message"]


def test_a_rendered_request_generates_what_the_route_would(scale_out: ServerProcess) -> None:
    """vLLM's render endpoints: a chat or completion request comes back as the tokens API's body (the rendered
    prompt's ids and the sampling parameters the route would run, the server's defaults in), which generates the
    route's exact reply."""
    chat_body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 6,
                 "temperature": 0, "ignore_eos": True, "logit_bias": {"120": 5}}
    rendered = httpx.post(f"{scale_out.base_url}/v1/chat/completions/render", json=chat_body, timeout=30).json()
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["reasoning_ended"] is None
    assert rendered["sampling_params"]["logit_bias"] == {"120": 5.0} and rendered["sampling_params"]["max_tokens"] == 6
    reply = httpx.post(f"{scale_out.base_url}/v1/chat/completions", json={**chat_body, "return_token_ids": True},
                       timeout=60).json()
    generated = httpx.post(f"{scale_out.base_url}/inference/v1/generate", json=rendered, timeout=60).json()
    assert generated["choices"][0]["token_ids"] == reply["choices"][0]["token_ids"]
    assert rendered["token_ids"] == reply["prompt_token_ids"]
    two = httpx.post(f"{scale_out.base_url}/v1/completions/render", timeout=30, json={
        "model": "tiny", "prompt": ["one", "two"], "request_id": "r", "max_tokens": 3}).json()
    ids = httpx.post(f"{scale_out.base_url}/tokenize", json={"model": "tiny", "prompt": "two"}).json()["tokens"]
    assert [b["request_id"] for b in two] == ["cmpl-r-0", "cmpl-r-1"] and two[1]["token_ids"] == ids
    response = httpx.post(f"{scale_out.base_url}/v1/responses/render", timeout=30, json={
        "model": "tiny", "input": "Hi there", "max_output_tokens": 6, "temperature": 0}).json()
    assert response["request_id"].startswith("resp_") and response["token_ids"] == rendered["token_ids"]
    assert response["sampling_params"]["max_tokens"] == 6
    message = httpx.post(f"{scale_out.base_url}/v1/messages/render", timeout=30, json={  # Anthropic's Messages API
        "model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "logit_bias": {"120": 5}}).json()
    assert message["request_id"].startswith("msg_") and message["token_ids"] == rendered["token_ids"]
    assert message["sampling_params"] == rendered["sampling_params"]
    beams = httpx.post(f"{scale_out.base_url}/v1/completions/render", timeout=30, json={
        "model": "tiny", "prompt": "one", "use_beam_search": True, "n": 2})
    assert beams.status_code == 400 and beams.json()["error"]["param"] == "use_beam_search"


def test_a_constraint_waits_for_the_reasoning_through_render(start_server: Callable[..., ServerProcess],
                                                             thinker: Path) -> None:
    """Rendered on a reasoning server, a constraint that waits for ``</think>`` comes out as vLLM says it,
    ``reasoning_ended: false``, and the tokens API holds it back again: the same reply as the chat route's."""
    from server_utils import think_first

    server = start_server(thinker, "--served-model-name", "tiny", "--reasoning-parser", "qwen3",
                          "--enable-scale-out")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 30,
            **think_first(structured_outputs={"regex": "Sunny[.]"})}
    rendered = httpx.post(f"{server.base_url}/v1/chat/completions/render", json=body, timeout=30).json()
    assert rendered["reasoning_ended"] is False
    assert "begin_after" not in rendered["sampling_params"]["structured_outputs"]
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, "return_token_ids": True},
                      timeout=60).json()
    generated = httpx.post(f"{server.base_url}/inference/v1/generate", json={**rendered, "output_mode": "text"},
                           timeout=60).json()
    assert generated["choices"][0]["text"] == "<think>a</think>Sunny." and chat["choices"][0]["message"]["content"] \
        == "Sunny."
    assert generated["choices"][0]["token_ids"] == chat["choices"][0]["token_ids"]
    server.stop()
