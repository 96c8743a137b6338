"""The gRPC API (``pagellm.v1.Engine``, defined in ``pagellm.proto``) over the engine, beside the HTTP server.

Contract:
- ``bind_grpc(host, port, api_key)`` binds a ``grpc.aio`` server before the model loads (a taken port fails at
  once); ``add_services(server, engine, names, ...)`` adds ``pagellm.v1.Engine``, the standard
  ``grpc.health.v1.Health`` service (SERVING while the engine core lives, NOT_SERVING once it is dead:
  ``watch_health`` keeps it true) and server reflection. With ``api_key`` every call but the health check needs the
  metadata ``authorization: Bearer KEY`` (UNAUTHENTICATED otherwise).
- Requests are checked as the HTTP API checks them, by the same code (model names, ``SamplingParams``, prompt length
  and vocabulary, structured-output schemas): what HTTP refuses with a 400 is INVALID_ARGUMENT here with the same
  message, an unknown model NOT_FOUND, a dead engine UNAVAILABLE, anything else INTERNAL.
- ``Generate`` / ``Chat`` stream one ``GenerateResponse`` per engine delta of each sample (``index``), its new text
  and token ids (and logprobs when asked); a sample's last carries ``finish_reason``. Sampling fields left unset
  take the model's generation_config.json defaults, as HTTP requests do. Cancelling the call (or a client that goes
  away) closes the generator, which aborts the engine requests and frees their KV blocks.
- ``Embed`` runs the embeddings handler (``serving_embedding.py``); ``Tokenize``, ``Detokenize`` and
  ``GetModelInfo`` answer from the tokenizer and the engine's runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Optional

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import pagellm
from pagellm.engine.exceptions import EngineDeadError
from pagellm.generation_config import DEFAULTED_FIELDS, unset_default
from pagellm.lora import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.prompt_embeds import PromptEmbeds
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.server.grpc import pagellm_pb2 as pb
from pagellm.server.grpc import pagellm_pb2_grpc as pb_grpc
from pagellm.server.openai.errors import to_api_error
from pagellm.server.openai.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from pagellm.server.openai.serving_engine import EngineClient, OpenAIServing, prepared, random_id

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Engine"].full_name
_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.FAILED_PRECONDITION,
           503: grpc.StatusCode.UNAVAILABLE}


async def _fail(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status the HTTP API's error maps to (raises)."""
    error = to_api_error(exc)
    await context.abort(_STATUS.get(error.status, grpc.StatusCode.INTERNAL), error.message)


def sampling_params(msg: pb.SamplingParams, defaults: dict[str, Any]) -> SamplingParams:
    """The proto's sampling fields as ``SamplingParams`` (unset ones: the model's defaults, else the neutral ones)."""
    kwargs: dict[str, Any] = {name: getattr(msg, name) if msg.HasField(name) else unset_default(name, defaults)
                              for name in DEFAULTED_FIELDS}
    if msg.HasField("max_tokens"):
        kwargs["max_tokens"] = msg.max_tokens
    elif defaults.get("max_tokens") is not None:
        kwargs["max_tokens"] = defaults["max_tokens"]
    for name in ("seed", "logprobs"):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    return SamplingParams(
        **kwargs, n=msg.n or 1, stop=list(msg.stop) or None, stop_token_ids=list(msg.stop_token_ids) or None,
        min_tokens=msg.min_tokens, ignore_eos=msg.ignore_eos, logit_bias=dict(msg.logit_bias) or None,
        include_stop_str_in_output=msg.include_stop_str_in_output, structured_outputs=_constraint(msg),
        extra_args=_whole_numbers(json_format.MessageToDict(msg.extra_args)) if msg.HasField("extra_args") else None)


def _whole_numbers(value: Any) -> Any:
    """A Struct's values with its whole numbers as ints (protobuf keeps every number as a double)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole_numbers(item) for item in value]
    if isinstance(value, dict):
        return {key: _whole_numbers(item) for key, item in value.items()}
    return value


def _constraint(msg: pb.SamplingParams) -> Optional[StructuredOutputsParams]:
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_schema":
        return StructuredOutputsParams(json=msg.json_schema)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(msg.choice.choices))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True) if msg.json_object else None
    return StructuredOutputsParams(**{kind: getattr(msg, kind)})


class EngineService(pb_grpc.EngineServicer):
    """``pagellm.v1.Engine`` (see the module doc)."""

    def __init__(self, engine: EngineClient, names: Sequence[str], loras: dict[str, LoRARequest],
                 model_root: Optional[str], traced: bool = False) -> None:
        self.serving = OpenAIServing(engine, names, loras)
        self.embedding = OpenAIServingEmbedding(engine, names, loras)
        self.model_root = model_root
        self.trace_context = None
        if traced:  # OpenTelemetry is imported only when traces are exported
            from pagellm.metrics.tracing import GrpcTraceContext

            self.trace_context = GrpcTraceContext()

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802 (gRPC's method names)
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            params = self._params(request.model, request.sampling)
            prompt = await prepared(self._generate_prompt, request, request.ByteSize())
        except Exception as exc:
            await _fail(context, exc)
        async for response in self._stream(prompt, params, request, context):
            yield response

    def _generate_prompt(self, request: pb.GenerateRequest) -> list[int] | PromptEmbeds:
        """A Generate request's prompt, checked (through ``prepared``: a large request off the event loop)."""
        kind = request.WhichOneof("prompt")
        if kind == "prompt_embeds":  # checked as it is read
            return self.serving.load_prompt_embeds(request.prompt_embeds)
        if kind == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            self.serving.check_text_length(len(request.text))
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            prompt = self.serving.tokenizer.encode(request.text, special)
        return self.serving.check_prompt(prompt)

    async def Chat(self, request: pb.ChatRequest,  # noqa: N802
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            params = self._params(request.model, request.sampling)
            prompt = await prepared(self._chat_prompt, request, request.ByteSize())
        except Exception as exc:
            await _fail(context, exc)
        async for response in self._stream(prompt, params, request, context):
            yield response

    def _chat_prompt(self, request: pb.ChatRequest) -> list[int]:
        """A Chat request's conversation rendered and tokenized, checked (through ``prepared``, as Generate's)."""
        if not request.messages:
            raise ValueError("messages must hold at least one message")
        self.serving.check_text_length(sum(len(m.content) for m in request.messages))
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        kwargs = json_format.MessageToDict(request.chat_template_kwargs) \
            if request.HasField("chat_template_kwargs") else None
        prompt = self.serving.tokenizer.apply_chat_template(
            messages, not request.continue_final_message, kwargs, continue_final_message=request.continue_final_message)
        return self.serving.check_prompt(prompt)

    def _params(self, model: str, sampling: pb.SamplingParams) -> SamplingParams:
        name = self.serving.check_model(model or None)
        if self.serving.engine.runtime.pooling_only:
            raise ValueError("this model classifies (POST /classify)" if self.serving.engine.runtime.labels
                             else "this model serves embeddings only: call Embed")
        return self.serving.check_params(name, sampling_params(sampling, self.serving.sampling_defaults))

    async def _stream(self, prompt: list[int] | PromptEmbeds, params: SamplingParams,
                      request: pb.GenerateRequest | pb.ChatRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or random_id("grpc")
        counts: dict[int, int] = {}
        num_prompt = len(prompt) if isinstance(prompt, list) else prompt.num_tokens
        traced = self.trace_context.parent(context.invocation_metadata()) if self.trace_context is not None \
            else contextlib.nullcontext()
        try:
            with traced:  # the engine reads the caller's trace parent when the request starts
                outputs = self.serving.generate([prompt], params, request_id, request.priority,
                                                cache_salt=request.cache_salt or None)
                first = await anext(outputs, None)
            if first is not None:
                yield _response(request_id, first[1], counts, params.logprobs or 0, num_prompt)
            async for _, output in outputs:
                yield _response(request_id, output, counts, params.logprobs or 0, num_prompt)
        except Exception as exc:
            await _fail(context, exc)

    async def Embed(self, request: pb.EmbedRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        try:
            kind = request.WhichOneof("input")
            inputs: Any = list(request.texts.texts) if kind == "texts" else \
                [list(ids.ids) for ids in request.token_ids.lists]
            body = EmbeddingRequest(model=request.model or None, input=inputs, priority=request.priority,
                                    dimensions=request.dimensions if request.HasField("dimensions") else None)
            answer = await self.embedding.create(await prepared(self.embedding.prepare, body, request.ByteSize()))
        except Exception as exc:
            await _fail(context, exc)
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=item.embedding) for item in answer.data],
                                prompt_tokens=answer.usage.prompt_tokens)

    async def Tokenize(self, request: pb.TokenizeRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return pb.TokenizeResponse(token_ids=self.serving.tokenizer.encode(request.text, special))

    async def Detokenize(self, request: pb.DetokenizeRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        try:
            text = self.serving.detokenize(request.token_ids)
        except Exception as exc:
            await _fail(context, exc)
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        serving = self.serving
        return pb.ModelInfo(served_model_names=serving.model_names, lora_adapters=list(serving.loras),
                            model=self.model_root or "", max_model_len=serving.max_model_len,
                            vocab_size=serving.vocab_size, pooling_only=bool(serving.engine.runtime.pooling_only),
                            version=pagellm.__version__)


def _response(request_id: str, output: RequestOutput, counts: dict[int, int], num_top: int,
              num_prompt: int) -> pb.GenerateResponse:
    """One engine delta of one sample as a ``GenerateResponse`` (``counts``: each sample's tokens so far; each
    position's logprobs hold the ``num_top`` alternatives in rank order, then the sampled token when it is not one;
    ``num_prompt``: the prompt's tokens, or rows of an embeddings prompt)."""
    sample = output.outputs[0]
    counts[sample.index] = counts.get(sample.index, 0) + len(sample.token_ids)
    response = pb.GenerateResponse(
        request_id=request_id, index=sample.index, text=sample.text, token_ids=sample.token_ids,
        finish_reason=sample.finish_reason or "", prompt_tokens=num_prompt,
        cached_tokens=output.num_cached_tokens, completion_tokens=counts[sample.index],
        stop_reason="" if sample.stop_reason is None else str(sample.stop_reason))
    for token, position in zip(sample.token_ids, sample.logprobs or []):
        sampled = position[token]
        response.logprobs.add(
            sampled=pb.TokenLogprob(token_id=token, token=sampled.decoded_token, logprob=sampled.logprob,
                                    rank=sampled.rank),
            top=[pb.TokenLogprob(token_id=t, token=lp.decoded_token, logprob=lp.logprob, rank=lp.rank)
                 for t, lp in list(position.items())[:num_top]])
    return response


class _BearerAuth(grpc.aio.ServerInterceptor):
    """Calls need ``authorization: Bearer KEY`` (the health check excepted, as load balancers call it bare)."""

    def __init__(self, api_key: str) -> None:
        self._expected = api_key.encode()

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._expected):
            return await continuation(details)
        return _refuse("send the API key as metadata 'authorization: Bearer KEY'")


def _refuse(message: str) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(deny)


def bind_grpc(host: str, port: int, api_key: Optional[str] = None) -> grpc.aio.Server:
    """A gRPC server listening on ``host:port`` (bound now, before the model loads; started by the caller once
    ``add_services`` has given it the engine)."""
    server = grpc.aio.server(interceptors=[_BearerAuth(api_key)] if api_key else [])
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        bound, reason = 0, f" ({exc})"
    else:
        reason = ""
    if bound == 0:
        raise ValueError(f"cannot listen for gRPC on {address}{reason}; pick another --grpc-port")
    return server


def add_services(server: grpc.aio.Server, engine: EngineClient, names: Sequence[str],
                 loras: Optional[dict[str, LoRARequest]] = None, model_root: Optional[str] = None,
                 traced: bool = False) -> health.aio.HealthServicer:
    """Serve ``pagellm.v1.Engine``, health and reflection on ``server`` (``traced``: calls' ``traceparent`` metadata
    parents their requests' spans); returns the health servicer."""
    pb_grpc.add_EngineServicer_to_server(EngineService(engine, names, loras if loras is not None else {},
                                                       model_root, traced), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return health_servicer


async def watch_health(engine: EngineClient, health_servicer: health.aio.HealthServicer,
                       period_s: float = 0.5) -> None:
    """Keep the health service true: SERVING while the engine core answers, NOT_SERVING once it is dead."""
    serving = health_pb2.HealthCheckResponse.SERVING
    while True:
        try:
            await engine.check_health()
            status = serving
        except EngineDeadError:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await health_servicer.set(name, status)
        if status != serving:
            return
        await asyncio.sleep(period_s)
