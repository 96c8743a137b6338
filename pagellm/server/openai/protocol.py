"""Request bodies of the OpenAI API, as pydantic models, plus pagellm's extra sampling fields (the response
bodies: ``replies.py``).

Contract:
- Requests are validated strictly (no string-to-number coercion) and unknown fields are rejected, as OpenAI does;
  validation errors become HTTP 400 naming the field (see ``errors.py``).
- OpenAI parameters the engine cannot honour (tools, suffix) are accepted by the schema only so that a
  non-default value can be refused with a clear 400 by ``unsupported()``: never ignored.
- Structured outputs arrive as vLLM spells them: ``structured_outputs`` ``{json|regex|choice|grammar}``, the
  legacy ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and OpenAI's ``response_format``
  (``json_object`` or ``json_schema``; on completions too, as vLLM takes it); at most one of them per request.
- ``logit_bias`` keys are token ids written as strings (OpenAI's JSON form).
- ``to_sampling_params`` maps a request onto ``SamplingParams`` field for field (a field left unset: the model's
  generation_config.json default, ``generation_config.py``, else OpenAI's); its ``ValueError`` is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from pagellm.generation_config import unset_default
from pagellm.sampling_params import MAX_LOGPROB_TOKEN_IDS, SamplingParams, StructuredOutputsParams
from pagellm.server.openai import tools as tooling

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# Sibling i of an n-sample request uses seed + i (n <= 128), which must still fit the wire's int64.
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 129)]
Count = Annotated[int, Field(ge=1, le=2**31 - 1)]
NumLogprobs = Annotated[int, Field(ge=0, le=2**31 - 1)]  # the engine caps it at its max_logprobs
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
TruncationSide = Literal["left", "right"]  # where truncate_prompt_tokens cuts: "left" keeps the last tokens


def omitted_when_none() -> Any:
    """A reply field only some requests ask for (``return_token_ids``, per-request metrics, ...): left out of the
    JSON unless set."""
    return Field(default=None, exclude_if=lambda value: value is None)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


@dataclass(frozen=True)
class RequestDefaults:
    """Server-wide values for what a request leaves unset, and how its stream is sent (vLLM's serve flags of the
    same names)."""

    force_include_usage: bool = False  # --enable-force-include-usage: streams end with usage as if asked
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids
    chat_template_kwargs: Optional[dict[str, Any]] = None  # --default-chat-template-kwargs, under a request's own
    response_role: str = "assistant"  # --response-role: the role of chat replies (given a generation prompt)
    exclude_tools_when_tool_choice_none: bool = False  # --exclude-tools-when-tool-choice-none: no tools to templates
    trust_request_chat_template: bool = False  # --trust-request-chat-template: a request may bring its own template
    sse_keep_alive_interval: float = 0.0  # --sse-keep-alive-interval: SSE comments on an idle stream (0: none)
    per_request_metrics: bool = False  # --enable-per-request-metrics: responses carry their timing (request_metrics)
    spec_decode_metrics: str = "none"  # --per-request-spec-decode-metrics: ... and their drafts' acceptance

    def apply(self, request: SamplingRequest) -> None:
        """Fill ``request`` (a completion or chat request) in place."""
        if self.force_include_usage and request.stream:
            request.stream_options = StreamOptions(include_usage=True)
        if request.return_tokens_as_token_ids is None:
            request.return_tokens_as_token_ids = self.return_tokens_as_token_ids
        if self.chat_template_kwargs and isinstance(request, ChatCompletionRequest):
            request.chat_template_kwargs = {**self.chat_template_kwargs, **(request.chat_template_kwargs or {})}


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=128)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[Seed] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # pagellm (vLLM) extensions, sent by the SDK through extra_body
    top_k: Optional[int] = Field(None, ge=-1, le=2**31 - 1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[TokenId]] = None
    priority: Int64 = 0
    cache_salt: Optional[str] = Field(None, min_length=1)  # requests of other salts share no prefix-cache blocks
    # vLLM's: the caller's id for the request, in the response's id (cmpl-<id>, chatcmpl-<id>) and the engine's logs
    request_id: Optional[str] = Field(None, min_length=1, max_length=256)
    # logprobs name tokens "token_id:<id>" (logprobs.py); None: the server's default (RequestDefaults)
    return_tokens_as_token_ids: Optional[bool] = None
    return_token_ids: bool = False  # vLLM's: the choices carry their token ids, and the prompt's
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    repetition_penalty: Optional[float] = Field(None, gt=0)
    bad_words: Optional[list[str]] = None
    allowed_token_ids: Optional[list[TokenId]] = None
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)  # keep the last k prompt tokens (-1: max_model_len)
    truncation_side: Optional[TruncationSide] = None  # vLLM's: "right" keeps the first k instead
    stream_interval: Optional[int] = Field(None, ge=1)  # vLLM's: new tokens per streamed chunk (at least the server's)
    prompt_logprobs: Optional[NumLogprobs] = None
    # vLLM's: at each generated position the logprobs of these tokens (and the sampled one's), in place of the top-k
    logprob_token_ids: Optional[list[TokenId]] = Field(None, max_length=MAX_LOGPROB_TOKEN_IDS)
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None  # OpenAI's (chat); vLLM takes it on completions too
    # vLLM's: {max_pattern_size, min_pattern_size, min_count}; a repeating output ends, finish_reason "repetition"
    repetition_detection: Optional[dict[str, Any]] = None
    # vLLM's: at most this many tokens inside a thinking block, then its end tag is forced (-1: no cap); needs the
    # server's --reasoning-parser or --reasoning-config
    thinking_token_budget: Optional[int] = Field(None, ge=-1)
    use_beam_search: bool = False  # vLLM's: the n best beams of a beam search of width n (serving_beam.py)
    length_penalty: float = Field(1.0, allow_inf_nan=False)
    # vLLM's: arguments for custom logits processors (--logits-processors), as SamplingParams.extra_args
    vllm_xargs: Optional[dict[str, Union[str, int, float, bool, list[Union[str, int, float]]]]] = None
    # vLLM's: the conversation or agent session the request belongs to (else the X-Session-ID header, else
    # vllm_xargs' session_id); KV cache events name it (kv/events.py)
    session_id: Optional[str] = Field(None, min_length=1, max_length=256)

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for every parameter set to a value the engine cannot honour."""
        return []

    def structured(self) -> Optional[StructuredOutputsParams]:
        """The one structured-output constraint of the request, or None (ValueError when several are given)."""
        given: dict[str, Any] = {}
        if self.structured_outputs is not None:
            given["structured_outputs"] = dict(self.structured_outputs)
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given[f"guided_{kind}"] = {kind: value}
        given.update(self._reply_constraints())
        if len(given) > 1:
            raise ValueError(f"give at most one structured-output constraint, got {', '.join(given)}")
        if not given:
            return None
        (name, spec), = given.items()
        unknown = set(spec) - set(StructuredOutputsParams.__struct_fields__)
        if unknown:
            raise ValueError(f"{name}: unknown keys {sorted(unknown)}; use one of json, regex, choice, grammar, "
                             "structural_tag")
        try:
            return StructuredOutputsParams(**spec)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: {exc}") from None

    def _reply_constraints(self) -> dict[str, Any]:
        """``response_format``'s constraint, by name (chat's adds a forced tool call)."""
        return self._response_format()

    def _response_format(self) -> dict[str, Any]:
        """``response_format`` as a structured-output spec (OpenAI: text, json_object or json_schema)."""
        fmt = self.response_format
        if not fmt or fmt.get("type") == "text":
            return {}
        if fmt.get("type") == "json_object":
            return {"response_format": {"json_object": True}}
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': "
                                 "{...}}} with the schema as an object")
            return {"response_format": {"json": spec["schema"]}}
        if fmt.get("type") == "structural_tag":  # vLLM's: its structures and triggers, or xgrammar's own format
            tag = {k: v for k, v in fmt.items() if k != "type"} if "structures" in fmt else fmt
            return {"response_format": {"structural_tag": tag}}
        raise ValueError(f"response_format type must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
                         f"got {fmt.get('type')!r}")

    def _extra_args(self) -> Optional[dict[str, Any]]:
        """``vllm_xargs``, with the request's ``session_id`` over any of theirs."""
        extra = dict(self.vllm_xargs or {})
        if self.session_id is not None:
            extra["session_id"] = self.session_id
        return extra or None

    def _logit_bias(self) -> Optional[dict[int, float]]:
        if not self.logit_bias:
            return None
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids written as strings of integers, got {key!r}") \
                    from None
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (``continuous_usage_stats`` with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int], best_of: Optional[int] = None,
                        prompt_logprobs: Optional[int] = None, defaults: Optional[dict[str, Any]] = None
                        ) -> SamplingParams:
        def pick(name: str) -> Any:  # the request's value, else the server's default, else OpenAI's
            value = getattr(self, name)
            return value if value is not None else unset_default(name, defaults)

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=self.seed,
            max_tokens=max_tokens if max_tokens is not None else (defaults or {}).get("max_tokens"),
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
            presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"),
            logit_bias=self._logit_bias(),
            bad_words=self.bad_words or None,
            allowed_token_ids=self.allowed_token_ids,
            best_of=best_of,
            structured_outputs=self.structured(),
            extra_args=self._extra_args(),
            stream_interval=self.stream_interval,
            repetition_detection=self.repetition_detection,
            thinking_token_budget=self.thinking_token_budget,
            logprob_token_ids=self.logprob_token_ids or None,
        )


# ---- completions ------------------------------------------------------------------------------------------------

class CompletionRequest(SamplingRequest):
    prompt: Optional[Union[str, list[str], list[TokenId], list[list[TokenId]]]] = None
    # Prompts as input embeddings (--enable-prompt-embeds): each a base64 torch.save of a [tokens, hidden] tensor
    prompt_embeds: Optional[Union[str, list[str]]] = None
    max_tokens: Optional[Count] = 16
    echo: bool = False
    logprobs: Optional[NumLogprobs] = None
    best_of: Optional[int] = Field(None, ge=1, le=128)
    suffix: Optional[str] = None
    add_special_tokens: bool = True  # the tokenizer's BOS (and the like) before a text prompt

    def unsupported(self) -> list[tuple[str, str]]:
        found = super().unsupported()
        if self.suffix:
            found.append(("suffix", "suffix (insertion) is not supported; omit it"))
        if self.prompt is None and self.prompt_embeds is None:
            found.append(("prompt", "give a prompt (text or token ids) or prompt_embeds"))
        if self.prompt_embeds is not None:
            given = {"echo": self.echo, "use_beam_search": self.use_beam_search,
                     "prompt_logprobs": self.prompt_logprobs is not None}
            found += [(name, f"{name} needs the prompt's tokens; prompt_embeds has none")
                      for name, on in given.items() if on]
        if self.stream and self.best_of is not None and self.best_of > self.n:
            found.append(("best_of", "best_of > n cannot be streamed (the best are known only at the end); "
                                     "set stream=false or best_of=n"))
        return found

    def to_sampling_params(self, defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        # echo + logprobs scores the prompt too (what evaluation harnesses use): prompt logprobs with the same k.
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self.sampling_params(self.max_tokens, self.logprobs, self.best_of, prompt_logprobs, defaults)


# ---- chat completions -------------------------------------------------------------------------------------------

class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    """A conversation turn; extra keys (``tool_calls``, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None

    @model_validator(mode="after")
    def _content_given(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":  # only a reply (tool calls alone) may leave it out
            raise ValueError(f"a {self.role} message needs its content: a string or a list of text parts")
        return self

    def text(self) -> str:
        """The message's text (its text parts joined by newlines, as a string template gets them)."""
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content if part.type == "text")
        return self.content or ""

    def to_template_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it (its content a string or text parts, which the tokenizer puts
        in the template's form: ``pagellm/chat_content.py``)."""
        return self.model_dump(exclude_none=True)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # http(s) images by URL, fetched by the route before preparation (``images.fetch``); no field of the body
    _fetched_images: dict[str, bytes] = PrivateAttr(default_factory=dict)
    max_tokens: Optional[Count] = None
    max_completion_tokens: Optional[Count] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[NumLogprobs] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message left open, for the model to continue
    add_special_tokens: bool = False  # special tokens added around the rendered template (it writes its own)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None  # vLLM's: the processor's keyword arguments for the images
    # vLLM's: documents for retrieval-augmented templates (passed as ``documents``), and a template of the request's
    # own (Jinja text), taken only from a server started with --trust-request-chat-template
    documents: Optional[list[dict[str, str]]] = None
    chat_template: Optional[str] = None
    echo: bool = False  # vLLM's: the reply begins with the last message's text when that message has the reply's role
    include_reasoning: bool = True  # with --reasoning-parser: false leaves the thinking out of the response
    reasoning_effort: Optional[Literal["minimal", "low", "medium", "high"]] = None  # to the template, as vLLM does
    prediction: Optional[dict[str, Any]] = None  # OpenAI's predicted output: drafted first with n-gram speculation
    # OpenAI's settings for its own platform (dashboards, storage, billing, routing): accepted, they change nothing
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[Literal["auto", "default"]] = None
    prompt_cache_key: Optional[str] = None  # the prefix cache needs no hint
    safety_identifier: Optional[str] = None

    def unsupported(self) -> list[tuple[str, str]]:
        found = super().unsupported()
        if self.store:
            found.append(("store", "store: true (OpenAI keeping the completion) is not supported; the Responses API "
                                   "(/v1/responses) stores responses"))
        if self.top_logprobs is not None and not self.logprobs:
            found.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        if self.logprob_token_ids and not self.logprobs:
            found.append(("logprob_token_ids", "logprob_token_ids needs logprobs: true (its tokens then stand in "
                                               "top_logprobs)"))
        if self.chat_template is not None and not self.chat_template.strip():
            found.append(("chat_template", "chat_template must be a Jinja template (omit it for the server's)"))
        if self.continue_final_message and self.add_generation_prompt:
            found.append(("continue_final_message", "continue_final_message needs add_generation_prompt: false "
                                                    "(the reply continues the last message instead of starting one)"))
        return found  # the tool settings are checked by the chat handler, which knows whether it parses calls

    def _reply_constraints(self) -> dict[str, Any]:
        """A forced tool call (a named function, or ``required``) is this turn's reply, so it wins over
        ``response_format``, which shapes text replies (OpenAI and vLLM take both)."""
        return tooling.constraint(self.tools, self.tool_choice, self.parallel_tool_calls) or self._response_format()

    def to_sampling_params(self, defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(limit, (self.top_logprobs or 0) if self.logprobs else None, defaults=defaults)
