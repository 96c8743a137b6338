"""The gRPC API (``pagellm serve --grpc-port``) through generated stubs on a live server: generation, chat,
embeddings and tokenization equal the HTTP API's answers for the same request; logprobs, samples and constraints;
refusals carry the HTTP API's messages with the matching status; the API key, health, reflection and cancellation
(which frees the request's KV blocks); and the committed generated modules match the proto."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Callable

import grpc
import httpx
import pytest
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_utils import ServerProcess, _free_port, engine_idle, wait_until

from pagellm.engine.exceptions import EngineDeadError
from pagellm.server.grpc import pagellm_pb2 as pb
from pagellm.server.grpc import pagellm_pb2_grpc as pb_grpc
from pagellm.server.grpc.service import SERVICE, watch_health

KEY = "grpc-secret"
AUTH = (("authorization", f"Bearer {KEY}"),)
GREEDY = dict(temperature=0, ignore_eos=True)


class Api:
    def __init__(self, server: ServerProcess, port: int) -> None:
        self.server, self.channel = server, grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.EngineStub(self.channel)
        self.http = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


@pytest.fixture(scope="module")
def api(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> Api:
    port = _free_port()
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--api-key", KEY, "--grpc-port", str(port))
    return Api(server, port)


def _generate(api: Api, **fields) -> list[pb.GenerateResponse]:
    return list(api.stub.Generate(pb.GenerateRequest(**fields), metadata=AUTH))


def test_generate_streams_the_completion_the_http_api_gives(api: Api) -> None:
    responses = _generate(api, text="The sky is", sampling=pb.SamplingParams(max_tokens=8, **GREEDY))
    assert all(r.index == 0 and r.request_id == responses[0].request_id for r in responses)
    assert [r.finish_reason for r in responses] == [""] * (len(responses) - 1) + ["length"]
    counts = [len(r.token_ids) for r in responses]  # a delta may carry several tokens when the client lags
    assert [r.completion_tokens for r in responses] == [sum(counts[:i + 1]) for i in range(len(counts))]
    assert responses[-1].completion_tokens == 8
    live = api.http.post("/v1/completions", json={"model": "tiny", "prompt": "The sky is", "max_tokens": 8,
                                                  **GREEDY}).json()
    assert "".join(r.text for r in responses) == live["choices"][0]["text"]
    assert responses[-1].prompt_tokens == live["usage"]["prompt_tokens"]
    ids = [t for r in responses for t in r.token_ids]
    again = _generate(api, token_ids=pb.TokenIds(ids=api.stub.Tokenize(pb.TokenizeRequest(text="The sky is"),
                                                                       metadata=AUTH).token_ids),
                      sampling=pb.SamplingParams(max_tokens=8, **GREEDY), request_id="mine")
    assert [t for r in again for t in r.token_ids] == ids and again[0].request_id == "mine"


def test_samples_logprobs_and_constraints(api: Api) -> None:
    two = _generate(api, text="Hi", sampling=pb.SamplingParams(max_tokens=4, n=2, seed=7, temperature=1.0))
    assert {r.index for r in two} == {0, 1} and sum(1 for r in two if r.finish_reason) == 2
    scored = _generate(api, text="Hi", sampling=pb.SamplingParams(max_tokens=4, logprobs=3, **GREEDY))
    positions = [p for r in scored for p in r.logprobs]
    assert len(positions) == 4 and all(len(p.top) == 3 and p.sampled.rank == 1 for p in positions)
    assert all(p.sampled.logprob == p.top[0].logprob >= p.top[1].logprob for p in positions)
    live = api.http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4, "logprobs": 3,
                                                  **GREEDY}).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert [p.sampled.logprob for p in positions] == pytest.approx(live, abs=1e-5)
    forced = _generate(api, text="Q:", sampling=pb.SamplingParams(max_tokens=20, regex="[0-9]{3}-[a-z]{2}"))
    text = "".join(r.text for r in forced)
    assert len(text) == 6 and text[3] == "-" and text[:3].isdigit() and forced[-1].finish_reason == "stop"
    picked = _generate(api, text="Q:", sampling=pb.SamplingParams(max_tokens=9, choice=pb.Choices(
        choices=["yes", "no"])))
    assert "".join(r.text for r in picked) in ("yes", "no")


def test_cache_salt_keeps_prefix_cache_blocks_apart(api: Api) -> None:
    text = "grpc cache salt: a prompt of three whole sixteen-token blocks and some more characters"
    sampling = pb.SamplingParams(max_tokens=1, **GREEDY)
    cached = [_generate(api, text=text, sampling=sampling, cache_salt=salt)[-1].cached_tokens
              for salt in ("tenant-a", "tenant-a", "tenant-b", "")]
    assert cached[0] == 0 and cached[1] >= 64 and cached[2] == 0 and cached[3] == 0
    chat = [pb.ChatMessage(role="user", content=text)]
    cached = [list(api.stub.Chat(pb.ChatRequest(messages=chat, sampling=sampling, cache_salt=salt),
                                 metadata=AUTH))[-1].cached_tokens for salt in ("", "tenant-c", "tenant-c")]
    assert cached[0] == 0 and cached[1] == 0 and cached[2] >= 64


def test_chat_embed_and_tokens_equal_the_http_api(api: Api) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    kwargs = struct_pb2.Struct()
    kwargs.update({"unused_flag": True})
    chat = list(api.stub.Chat(pb.ChatRequest(messages=[pb.ChatMessage(**m) for m in messages], chat_template_kwargs=
                                             kwargs, sampling=pb.SamplingParams(max_tokens=6, **GREEDY)),
                              metadata=AUTH))
    live = api.http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 6,
                                                       **GREEDY}).json()
    assert "".join(r.text for r in chat) == live["choices"][0]["message"]["content"]
    embedded = api.stub.Embed(pb.EmbedRequest(texts=pb.Texts(texts=["a cat", "a dog"]), dimensions=16),
                              metadata=AUTH)
    live = api.http.post("/v1/embeddings", json={"model": "tiny", "input": ["a cat", "a dog"],
                                                 "dimensions": 16}).json()
    for mine, theirs in zip(embedded.embeddings, live["data"]):
        assert list(mine.values) == pytest.approx(theirs["embedding"], abs=1e-5)
    assert embedded.prompt_tokens == live["usage"]["prompt_tokens"]
    ids = api.stub.Tokenize(pb.TokenizeRequest(text="héllo"), metadata=AUTH).token_ids
    assert list(ids) == api.http.post("/tokenize", json={"prompt": "héllo"}).json()["tokens"]
    assert api.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), metadata=AUTH).text == "héllo"
    info = api.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH)
    assert (list(info.served_model_names), info.max_model_len, info.vocab_size) == (["tiny"], 512, 320)


@pytest.mark.parametrize(("fields", "code", "message"), [
    (dict(text="x", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "The model `gpt-9` does not exist"),
    (dict(text="x", sampling=pb.SamplingParams(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(text="x" * 600), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
    (dict(token_ids=pb.TokenIds(ids=[5, 999])), grpc.StatusCode.INVALID_ARGUMENT, "999"),
    (dict(text="x", sampling=pb.SamplingParams(regex="[unclosed")), grpc.StatusCode.INVALID_ARGUMENT, "regex"),
])
def test_refusals_carry_a_status_and_the_http_apis_message(api: Api, fields: dict, code: grpc.StatusCode,
                                                           message: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _generate(api, **fields)
    assert refused.value.code() == code and message in refused.value.details()


def test_the_api_key_guards_every_call_but_health(api: Api) -> None:
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as refused:
            api.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    checker = health_pb2_grpc.HealthStub(api.channel)
    for service in ("", SERVICE):
        status = checker.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(api.channel)
    (answer,) = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                metadata=AUTH)
    assert {s.name for s in answer.list_services_response.service} >= {SERVICE, health.SERVICE_NAME}


def test_cancelling_a_call_aborts_its_request_and_frees_its_blocks(api: Api) -> None:
    call = api.stub.Generate(pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=480, n=4,
                                                                                       **GREEDY)), metadata=AUTH)
    first = next(call)
    assert first.text is not None and not engine_idle(api.server.base_url)
    call.cancel()
    wait_until(lambda: engine_idle(api.server.base_url), 30, "the cancelled call's blocks to be freed")


def test_health_turns_not_serving_when_the_engine_dies() -> None:
    class Dead:
        async def check_health(self) -> None:
            raise EngineDeadError("the engine core process died")

    async def run() -> int:
        servicer = health.aio.HealthServicer()
        await watch_health(Dead(), servicer, period_s=0.01)  # returns once it has said so
        return (await servicer.Check(health_pb2.HealthCheckRequest(service=SERVICE), None)).status

    assert asyncio.run(run()) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_the_generated_modules_match_the_proto(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    proto = "pagellm/server/grpc/pagellm.proto"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(root), f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(root / proto)], check=True)
    for name in ("pagellm_pb2.py", "pagellm_pb2.pyi", "pagellm_pb2_grpc.py"):
        generated = (tmp_path / "pagellm/server/grpc" / name).read_text()
        assert generated == (root / "pagellm/server/grpc" / name).read_text(), f"{name}: run scripts/gen-grpc.sh"
