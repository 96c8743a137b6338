"""vLLM 0.32's tokens-in, tokens-out API, ``POST /inference/v1/generate``: a gateway that renders prompts and counts
tokens itself (llm-d's "disaggregated everything") sends token ids and vLLM's ``SamplingParams`` as JSON, and gets
token ids back; ``POST /inference/v1/abort_requests`` ends requests by the ids the responses carry.

Contract (vLLM's shapes):
- The request: ``token_ids`` (at least one, each in the vocabulary), ``sampling_params`` (``SamplingParams``'
  fields by name; an unknown one is a 400 naming it; ``max_tokens`` left out means up to the context length),
  ``request_id`` (the response's is ``generate-tokens-<it>``), ``model``, ``return_token_ids`` (the prompt's ids in
  the response, a stream's first chunk), ``output_mode`` (``tokens``; ``text`` adds each choice's text and logprobs
  in chat's shape), ``stream`` and ``stream_options``, ``cache_salt``, ``priority``, and render's hints:
  ``reasoning_ended`` false holds a structured-output constraint back until the reasoning parser's end tag (a 400
  without ``--reasoning-parser``), ``reasoning_parser_kwargs`` changes nothing (no engine-side parser here). vLLM's
  multimodal and transfer fields (``features``, ``content_parts``, ``token_offsets``, ``kv_transfer_params``,
  ``ec_transfer_params``) are a 400 that names them.
- Render (``rendered``): a chat or completion request, prepared as its route would, as that body: the prompt's ids,
  the sampling parameters set (``wire_params``: the engine's own fields left out, a constraint's ``begin_after``
  said as ``reasoning_ended`` false), the model, stream settings, salt and priority.
- The response: ``choices`` (``index``, ``token_ids``, ``finish_reason``, ``stop_reason``, ``logprobs`` as
  ``{"content": [{"token_id", "logprob", "rank", "top_logprobs": [{"token_id", "logprob", "rank"}]}]}``), ``usage``,
  ``prompt_token_ids``, ``metrics`` (with ``--enable-per-request-metrics`` / ``--per-request-spec-decode-metrics``,
  one sample only). A stream sends one chunk per sample's new tokens (``request_id``, ``choices`` with the new ids),
  then with ``stream_options.include_usage`` a chunk of usage, then ``[DONE]``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import msgspec
from pydantic import BaseModel, Field

from pagellm.outputs import Logprob
from pagellm.sampling_params import SamplingParams
from pagellm.server.openai.errors import APIError, sse_error
from pagellm.server.openai.logprobs import chat_logprobs, num_alternatives
from pagellm.server.openai.protocol import Int64, OpenAIModel, StreamOptions, TokenId, omitted_when_none
from pagellm.server.openai.reasoning import get_reasoning_parser
from pagellm.server.openai.replies import ChatLogprobs, UsageInfo
from pagellm.server.openai.request_metrics import PerRequestMetrics
from pagellm.server.openai.serving_engine import ChoiceState, OpenAIServing, random_id

# SamplingParams' fields a request may set (the rest the engine fills in itself)
INTERNAL = {"bad_words_token_ids", "thinking_markers", "pooling", "output_kind", "lora_request",
            "prediction_token_ids", "processed_logprobs"}
REFUSED = ("token_offsets", "features", "content_parts", "kv_transfer_params", "ec_transfer_params")


class GenerateRequest(OpenAIModel):
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: dict[str, Any]
    request_id: Optional[str] = Field(None, min_length=1, max_length=256)
    model: Optional[str] = None
    return_token_ids: Optional[bool] = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=1024)
    priority: Int64 = 0
    token_offsets: Optional[Any] = None
    features: Optional[Any] = None
    content_parts: Optional[Any] = None
    kv_transfer_params: Optional[Any] = None
    ec_transfer_params: Optional[Any] = None
    # render's hints: False holds a structured-output constraint back until the reasoning parser's end tag (True or
    # None: from the first token); the parser's own flags change nothing here (no engine-side parser)
    reasoning_ended: Optional[bool] = None
    reasoning_parser_kwargs: Optional[dict[str, Any]] = None


class AbortRequests(OpenAIModel):
    request_ids: list[str] = Field(min_length=1)  # the ids the responses carry (generate-tokens-...)


class GenerateLogProb(BaseModel):
    token_id: int
    logprob: float
    rank: Optional[int] = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = []


class GenerateLogProbs(BaseModel):
    content: Optional[list[GenerateLogProbsContent]] = None


class GenerateChoice(BaseModel):
    index: int
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    token_ids: Optional[list[int]] = None
    logprobs: Optional[GenerateLogProbs | ChatLogprobs] = None
    text: Optional[str] = omitted_when_none()  # output_mode "text"


class GenerateResponse(BaseModel):
    request_id: str
    output_mode: Literal["tokens", "text"] = "tokens"
    choices: list[GenerateChoice]
    model: Optional[str] = omitted_when_none()  # the whole response's
    created: Optional[int] = omitted_when_none()
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = omitted_when_none()
    metrics: Optional[PerRequestMetrics] = omitted_when_none()


def _clamp(logprob: float) -> float:
    """OpenAI's floor: -inf (and NaN) become -9999.0, which JSON can carry."""
    return -9999.0 if logprob != logprob else max(logprob, -9999.0)


def token_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int) -> GenerateLogProbs:
    """Logprobs in the tokens shape: each token's own, and the first ``num_top`` (at least 1) of its entry's."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        own = entry.get(token_id)
        top = [GenerateLogProb(token_id=t, logprob=_clamp(p.logprob), rank=p.rank or None)
               for t, p in list(entry.items())[:max(num_top, 1)]]
        content.append(GenerateLogProbsContent(token_id=token_id, logprob=_clamp(own.logprob) if own else -9999.0,
                                               rank=own.rank if own else None, top_logprobs=top))
    return GenerateLogProbs(content=content)


@dataclass
class _Job:
    request: GenerateRequest
    request_id: str
    model: str
    params: SamplingParams
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, ChoiceState] = field(default_factory=dict)


class OpenAIServingTokens(OpenAIServing):

    def __init__(self, *args: Any, no_detokenize: bool = False, reasoning_parser: Optional[str] = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.no_detokenize = no_detokenize  # --tokens-only: the engine decodes no text
        # the reasoning parser's end tag as token ids (--reasoning-parser), which render's reasoning_ended false
        # holds a constraint back for
        self.think_end = self.tokenizer.encode(get_reasoning_parser(reasoning_parser).end, add_special_tokens=False) \
            if reasoning_parser is not None else None

    def prepare(self, request: GenerateRequest) -> _Job:
        """Validate (APIError / ValueError → 4xx before anything is queued)."""
        for name in REFUSED:
            if getattr(request, name) is not None:
                raise APIError(f"{name} is not supported by this server (text-only models, no KV or encoder-cache "
                               "transfer through this API); omit it", 400, param=name, code="unsupported_parameter")
        model = self.check_model(request.model)
        params = self.check_params(model, self._params(request))
        if self.no_detokenize:
            if request.output_mode == "text" or params.stop_strings:
                name = "output_mode" if request.output_mode == "text" else "sampling_params"
                raise APIError("a --tokens-only server decodes no text: send output_mode 'tokens' and stop_token_ids "
                               "instead of stop strings (check stop strings where the text is)", 400, param=name)
            params = msgspec.structs.replace(params, detokenize=False)
        if request.output_mode == "text" and not params.detokenize:
            raise APIError("output_mode 'text' needs sampling_params.detokenize true", 400, param="output_mode")
        if request.reasoning_ended is False and params.structured_outputs is not None:
            if self.think_end is None:
                raise APIError("reasoning_ended false holds the constraint back until the reasoning ends: it needs a "
                               "server with --reasoning-parser", 400, param="reasoning_ended")
            params.structured_outputs = msgspec.structs.replace(params.structured_outputs, begin_after=self.think_end)
        self.check_prompt(list(request.token_ids))
        return _Job(request, random_id("generate-tokens", request.request_id), model, params)

    def _params(self, request: GenerateRequest) -> SamplingParams:
        spec = dict(request.sampling_params)
        unknown = sorted(set(spec) - (set(SamplingParams.__struct_fields__) - INTERNAL))
        if unknown:
            raise APIError(f"sampling_params: unknown fields {unknown}", 400, param="sampling_params")
        spec.setdefault("max_tokens", None)  # left out: up to the context length, as vLLM defaults it
        try:
            return msgspec.convert(spec, SamplingParams, str_keys=True)  # JSON object keys: logit_bias ids
        except (msgspec.ValidationError, ValueError, TypeError) as exc:
            raise APIError(f"sampling_params: {exc}", 400, param="sampling_params") from None

    async def create(self, job: _Job) -> GenerateResponse:
        async for _, output in self.generate([list(job.request.token_ids)], job.params, job.request_id,
                                             job.request.priority, cache_salt=job.request.cache_salt):
            self._choice(job, output.outputs[0].index).add(output)
        choices = [self._whole(job, i, c) for i, c in sorted(job.choices.items())]
        return GenerateResponse(request_id=job.request_id, output_mode=job.request.output_mode, choices=choices,
                                model=job.model, created=job.created, usage=self._usage(job),
                                prompt_token_ids=list(job.request.token_ids) if job.request.return_token_ids
                                else None, metrics=self.response_metrics(job.choices, job.params.n == 1))

    async def stream(self, job: _Job) -> AsyncIterator[str]:
        first = bool(job.request.return_token_ids)
        try:
            async for _, output in self.generate([list(job.request.token_ids)], job.params, job.request_id,
                                                 job.request.priority, cache_salt=job.request.cache_salt):
                index = output.outputs[0].index
                choice = self._choice(job, index)
                text = choice.add(output)
                new_ids = choice.take_ids()
                if not (new_ids or choice.finish_reason):
                    continue
                chunk = GenerateResponse(request_id=job.request_id, output_mode=job.request.output_mode,
                                         choices=[self._piece(job, index, choice, new_ids, text)],
                                         prompt_token_ids=list(job.request.token_ids) if first else None)
                first = False
                yield f"data: {chunk.model_dump_json()}\n\n"
            if job.request.stream_options is not None and job.request.stream_options.include_usage:
                usage = GenerateResponse(request_id=job.request_id, output_mode=job.request.output_mode, choices=[],
                                         usage=self._usage(job),
                                         metrics=self.response_metrics(job.choices, job.params.n == 1))
                yield f"data: {usage.model_dump_json()}\n\n"
        except Exception as exc:
            yield sse_error(exc)
        yield "data: [DONE]\n\n"

    def _choice(self, job: _Job, index: int) -> ChoiceState:
        return job.choices.setdefault(index, ChoiceState(keep_ids=True))

    def _whole(self, job: _Job, index: int, choice: ChoiceState) -> GenerateChoice:
        return GenerateChoice(index=index, finish_reason=choice.finish_reason or "stop",
                              stop_reason=choice.stop_reason, token_ids=choice.output_ids,
                              logprobs=self._logprobs(job, choice),
                              text=choice.text if job.request.output_mode == "text" else None)

    def _piece(self, job: _Job, index: int, choice: ChoiceState, new_ids: list[int], text: str) -> GenerateChoice:
        return GenerateChoice(index=index, finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                              token_ids=new_ids, logprobs=self._logprobs(job, choice),
                              text=text if job.request.output_mode == "text" else None)

    def _logprobs(self, job: _Job, choice: ChoiceState) -> Optional[GenerateLogProbs | ChatLogprobs]:
        """The logprobs of the choice's tokens not sent yet, in the output mode's shape (None when not asked)."""
        if job.params.logprobs is None:
            return None
        token_ids, entries = choice.take_logprobs()
        num_top = num_alternatives(job.params)
        if job.request.output_mode == "text":
            return chat_logprobs(token_ids, entries, num_top)
        return token_logprobs(token_ids, entries, num_top)

    def _usage(self, job: _Job) -> UsageInfo:
        cached = next(iter(job.choices.values())).num_cached_tokens if job.choices else 0
        return UsageInfo.of(len(job.request.token_ids), sum(c.num_tokens for c in job.choices.values()), cached)


# ---- render: an OpenAI request as the tokens API's request, for a gateway to send on ---------------------------

def wire_params(params: SamplingParams) -> tuple[dict[str, Any], Optional[bool]]:
    """``params`` as ``sampling_params`` JSON (the fields set, none of the engine's own) and render's
    ``reasoning_ended`` (False when a constraint waits for the reasoning's end: vLLM's way to say it)."""
    spec = {k: v for k, v in msgspec.to_builtins(params).items() if k not in INTERNAL}
    structured = spec.get("structured_outputs")
    waits = isinstance(structured, dict) and structured.pop("begin_after", None) is not None
    return spec, False if waits else None


def rendered(request_id: str, token_ids: list[int], params: SamplingParams, request: Any) -> dict[str, Any]:
    """One ``GenerateRequest`` body, as vLLM's render endpoints answer."""
    spec, reasoning_ended = wire_params(params)
    options = getattr(request, "stream_options", None)  # a Responses request has neither options nor a salt
    return {"request_id": request_id, "token_ids": list(token_ids), "sampling_params": spec, "model": request.model,
            "stream": bool(request.stream), "stream_options": options.model_dump()
            if request.stream and options is not None else None, "cache_salt": getattr(request, "cache_salt", None),
            "priority": request.priority, "reasoning_ended": reasoning_ended}
