"""``pagellm serve --enable-prompt-embeds``: the completions API's ``prompt_embeds`` (base64 ``torch.save``, as
vLLM takes it) through the OpenAI SDK, whole and streamed, beside text prompts; bad embeddings are 400s that say
what to fix, and the server goes on serving."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Callable

import grpc
import httpx
import openai
import pytest
import torch
from server_utils import ServerProcess, _free_port

from pagellm import LLM, SamplingParams
from pagellm.prompt_embeds import save
from pagellm.server.grpc import pagellm_pb2 as pb
from pagellm.server.grpc import pagellm_pb2_grpc as pb_grpc

GREEDY = dict(temperature=0, max_tokens=6)


def _b64(tensor: object) -> str:
    return base64.b64encode(save(tensor)).decode()


def _rows(seed: int, count: int, hidden: int = 64) -> torch.Tensor:
    return torch.randn(count, hidden, generator=torch.Generator().manual_seed(seed)) * 0.5


GRPC_PORT = _free_port()


@pytest.fixture(scope="module")
def embeds_server(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    return start_server(tiny_llama, "--served-model-name", "tiny", "--enable-prompt-embeds", "--grpc-port",
                        str(GRPC_PORT))


@pytest.fixture(scope="module")
def sdk(embeds_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embeds_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline_embeds(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", max_model_len=512, kv_cache_memory=16_000_000,
               enable_prompt_embeds=True)


def _offline(llm: LLM, prompt: object) -> tuple[list[int], str]:
    """The offline engine's greedy tokens and text for one prompt."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    completion = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    return completion.token_ids, completion.text


def test_embeddings_prompts_through_the_openai_sdk(sdk: openai.OpenAI, offline_embeds: LLM) -> None:
    first, second = _rows(1, 9), _rows(2, 20)
    reply = sdk.completions.create(model="tiny", prompt=None, **GREEDY,
                                   extra_body={"ignore_eos": True, "return_token_ids": True,
                                               "prompt_embeds": [_b64(first), _b64(second)]})
    assert [c.index for c in reply.choices] == [0, 1]
    for choice, rows in zip(reply.choices, (first, second)):
        assert (choice.token_ids, choice.text) == _offline(offline_embeds, {"prompt_embeds": rows})
        assert "prompt_token_ids" not in choice.model_extra  # an embeddings prompt has no tokens
    assert reply.usage.prompt_tokens == 29 and reply.usage.completion_tokens == 12


def test_embeddings_prompts_come_before_text_prompts_and_stream(sdk: openai.OpenAI, offline_embeds: LLM) -> None:
    rows = _rows(3, 12)
    stream = sdk.completions.create(model="tiny", prompt="Hello", stream=True, **GREEDY,
                                    stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True, "prompt_embeds": _b64(rows)})
    texts: dict[int, str] = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts[0] == _offline(offline_embeds, {"prompt_embeds": rows})[1]
    assert texts[1] == _offline(offline_embeds, "Hello")[1]
    assert usage is not None and usage.prompt_tokens == 12 + len(offline_embeds.tokenizer.encode("Hello"))


def test_truncate_prompt_tokens_keeps_the_last_rows(sdk: openai.OpenAI, offline_embeds: LLM) -> None:
    rows = _rows(4, 30)
    reply = sdk.completions.create(model="tiny", prompt=None, **GREEDY,
                                   extra_body={"ignore_eos": True, "return_token_ids": True,
                                               "prompt_embeds": _b64(rows), "truncate_prompt_tokens": 10})
    assert reply.choices[0].token_ids == _offline(offline_embeds, {"prompt_embeds": rows[-10:]})[0]
    assert reply.usage.prompt_tokens == 10
    head = sdk.completions.create(model="tiny", prompt=None, **GREEDY,
                                  extra_body={"ignore_eos": True, "return_token_ids": True, "truncation_side": "right",
                                              "prompt_embeds": _b64(rows), "truncate_prompt_tokens": 10})
    assert head.choices[0].token_ids == _offline(offline_embeds, {"prompt_embeds": rows[:10]})[0]
    offline = offline_embeds.generate({"prompt_embeds": rows}, SamplingParams(
        temperature=0.0, max_tokens=GREEDY["max_tokens"], ignore_eos=True, truncate_prompt_tokens=10,
        truncation_side="right"), use_tqdm=False)[0]
    assert list(offline.outputs[0].token_ids) == head.choices[0].token_ids


class _Payload:
    def __reduce__(self):  # what a hostile pickle would run on an unsafe load
        return (print, ("ran",))


@pytest.mark.parametrize("extra,param,message", [
    ({"prompt_embeds": "not base64!"}, "prompt_embeds", "base64"),
    ({"prompt_embeds": base64.b64encode(b"garbage").decode()}, "prompt_embeds", "torch.save"),
    ({"prompt_embeds": _b64(_Payload())}, "prompt_embeds", "torch.save"),
    ({"prompt_embeds": _b64(torch.zeros(3, 32))}, "prompt_embeds", "hidden size is 64"),
    ({"prompt_embeds": _b64(torch.zeros(3, 64, dtype=torch.int32))}, "prompt_embeds", "floating point"),
    ({"prompt_embeds": _b64(torch.zeros(3, 64).to_sparse())}, "prompt_embeds", "dense tensor"),
    ({"prompt_embeds": [_b64(_rows(5, 3)), _b64(torch.zeros(600, 64))]}, "prompt_embeds",
     "prompt_embeds 1: 600 rows, but max_model_len is 512"),
    ({"prompt_embeds": []}, "prompt_embeds", "must not be empty"),
    ({"prompt_embeds": _b64(_rows(5, 3)), "echo": True}, "echo", "prompt_embeds has none"),
    ({"prompt_embeds": _b64(_rows(5, 3)), "prompt_logprobs": 1}, "prompt_logprobs", "prompt_embeds has none"),
    ({"prompt_embeds": _b64(_rows(5, 3)), "use_beam_search": True}, "use_beam_search", "prompt_embeds has none"),
    ({}, "prompt", "give a prompt"),
])
def test_bad_embeddings_are_400s_that_name_the_fix(embeds_server: ServerProcess, extra: dict, param: str,
                                                   message: str) -> None:
    body = {"model": "tiny", "max_tokens": 2, **extra}
    response = httpx.post(f"{embeds_server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert re.search(message, error["message"]), error["message"]
    assert "ran" not in embeds_server.log().splitlines()  # the hostile pickle never ran
    ok = httpx.post(f"{embeds_server.base_url}/v1/completions",
                    json={"model": "tiny", "prompt_embeds": _b64(_rows(6, 4)), "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_server_without_the_flag_refuses_them(server: ServerProcess) -> None:
    """The shared server runs without --enable-prompt-embeds: a 400 naming the flag (the API server never loads
    torch for it)."""
    body = {"model": "tiny", "prompt_embeds": _b64(_rows(7, 4)), "max_tokens": 2}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "--enable-prompt-embeds" in json.loads(response.text)["error"]["message"]


def test_grpc_generate_takes_the_rows_as_bytes(embeds_server: ServerProcess, offline_embeds: LLM) -> None:
    rows = _rows(8, 11)
    stub = pb_grpc.EngineStub(grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}"))
    sampling = pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    responses = list(stub.Generate(pb.GenerateRequest(prompt_embeds=save(rows), sampling=sampling)))
    assert [t for r in responses for t in r.token_ids] == _offline(offline_embeds, {"prompt_embeds": rows})[0]
    assert responses[-1].prompt_tokens == 11
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(pb.GenerateRequest(prompt_embeds=save(torch.zeros(3, 32)), sampling=sampling)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hidden size is 64" in error.value.details()


def test_cache_salts_keep_embeddings_blocks_apart(embeds_server: ServerProcess) -> None:
    rows = _b64(_rows(9, 40))
    body = {"model": "tiny", "prompt_embeds": rows, "max_tokens": 1}

    def cached(**extra: str) -> int:
        reply = httpx.post(f"{embeds_server.base_url}/v1/completions", json={**body, **extra}, timeout=60).json()
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") == 32  # the same tenant finds its two full blocks
    assert cached(cache_salt="tenant-b") == 0 and cached() == 0  # another tenant, or none, finds nothing
