"""``pagellm serve --logits-processors``: requests opt in with ``vllm_xargs`` (the OpenAI SDK's extra_body), through
completions, chat and ``/invocations``; a value the processor refuses is a 400 before anything streams."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import grpc
import httpx
import openai
import pytest
from google.protobuf import struct_pb2
from server_utils import ServerProcess, _free_port

from pagellm import LLM, SamplingParams
from pagellm.server.grpc import pagellm_pb2 as pb
from pagellm.server.grpc import pagellm_pb2_grpc as pb_grpc

TESTS = Path(__file__).resolve().parents[1]
GRPC_PORT = _free_port()


@pytest.fixture(scope="module")
def custom_server(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    return start_server(tiny_llama, "--served-model-name", "tiny", "--logits-processors",
                        "custom_processors:TargetToken", "custom_processors:NoRepeats", "--grpc-port",
                        str(GRPC_PORT), env={"PYTHONPATH": str(TESTS)})


@pytest.fixture(scope="module")
def sdk(custom_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{custom_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


GREEDY = dict(model="tiny", max_tokens=8, temperature=0)


def test_vllm_xargs_reach_the_processor(sdk: openai.OpenAI, offline: LLM) -> None:
    chosen = sdk.completions.create(prompt="Hello", **GREEDY, extra_body={
        "ignore_eos": True, "return_token_ids": True, "vllm_xargs": {"target_token": 65}})
    decode = offline.tokenizer.decode
    assert chosen.choices[0].token_ids == [65] * 8 and chosen.choices[0].text == decode([65] * 8)
    chat = sdk.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **GREEDY,
                                       extra_body={"ignore_eos": True, "vllm_xargs": {"target_token": 66}})
    assert chat.choices[0].message.content == decode([66] * 8)
    free = sdk.completions.create(prompt="Hello", **GREEDY, extra_body={"ignore_eos": True,
                                                                         "return_token_ids": True})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert free.choices[0].token_ids == offline.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids


def test_streams_and_invocations_carry_them(custom_server: ServerProcess, offline: LLM) -> None:
    body = {**GREEDY, "prompt": "Hello", "ignore_eos": True, "stream": True, "vllm_xargs": {"target_token": 67}}
    with httpx.stream("POST", f"{custom_server.base_url}/invocations", json=body, timeout=60) as reply:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in reply.iter_lines()
                       if line.startswith("data: {"))
    assert text == offline.tokenizer.decode([67] * 8)


@pytest.mark.parametrize("stream", [False, True])
def test_values_the_processor_refuses_are_400s(custom_server: ServerProcess, stream: bool) -> None:
    body = {**GREEDY, "prompt": "Hello", "stream": stream, "vllm_xargs": {"target_token": "A"}}
    reply = httpx.post(f"{custom_server.base_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert "target_token must be a token id" in reply.json()["error"]["message"]


def test_xargs_must_be_json_values(custom_server: ServerProcess) -> None:
    body = {**GREEDY, "prompt": "Hello", "vllm_xargs": {"deep": {"no": "objects"}}}
    reply = httpx.post(f"{custom_server.base_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"].startswith("vllm_xargs")


def test_grpc_extra_args_reach_the_processor(custom_server: ServerProcess) -> None:
    """Protobuf's Struct holds numbers as doubles: a whole one reaches the processor as an int."""
    stub = pb_grpc.EngineStub(grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}"))
    args = struct_pb2.Struct()
    args.update({"target_token": 70})
    sampling = pb.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args=args)
    responses = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=sampling)))
    assert [t for r in responses for t in r.token_ids] == [70] * 5
    args.update({"target_token": "x"})
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(
            max_tokens=5, extra_args=args))))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "target_token must be a token id" in error.value.details()
