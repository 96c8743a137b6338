"""What completions and chat share: the engine interface, model and prompt checks, fan-out, a choice's state.

Contract:
- ``EngineClient`` is the slice of ``AsyncLLM`` the server uses; the server never imports the engine class itself
  (``launch.py`` builds it), so the app can be built over any object with these methods.
- ``check_request`` refuses (400/404) before anything is queued: unknown model, unsupported parameters, sampling
  values ``SamplingParams`` rejects, token ids outside the vocabulary, structured-output schemas, regexes or
  grammars that do not parse, prompts that are empty, too long for ``max_model_len`` or out of vocabulary.
- ``generate`` makes one engine call per prompt, ``n`` passed through (the engine's siblings: seed + i, the
  prompt's KV blocks shared), and yields ``(prompt_index, RequestOutput)`` deltas as they arrive; each holds one
  sample whose ``index`` is the sibling index. Closing it (client gone, error) cancels every engine request, which
  aborts them and frees their blocks.
- ``ChoiceState`` adds up one choice's deltas; the logprobs it holds are those not yet sent (``take_logprobs``).
- ``prepared(prepare, body, size)`` runs a large request's preparation (validation, chat template, tokenization,
  grammar compilation) on one worker thread, off the event loop; text too long to fit ``max_model_len`` is refused
  before it is tokenized (``check_text_length``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, TypeVar, Union

import msgspec

from pagellm.beam_search import BeamSearchParams
from pagellm import prompt_embeds
from pagellm.engine.input_processor import CLASSIFY_ONLY, EMBEDS_OFF, POOLING_ONLY, check_prompt, cut
from pagellm.lora import LoRARequest
from pagellm.metrics.stats import SchedulerStats
from pagellm.outputs import Logprob, RequestMetrics, RequestOutput
from pagellm.prompt_embeds import PromptEmbeds
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.server.openai import serving_beam
from pagellm.server.openai.errors import APIError
from pagellm.server.openai.protocol import RequestDefaults, SamplingRequest
from pagellm.server.openai.request_metrics import PerRequestMetrics, response_metrics
from pagellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_DONE = object()

# One thread prepares large requests (their Python holds the GIL, so more would not run at once; the tokenizer's Rust
# part lets the event loop run beside it): tokenizing megabytes of text takes seconds, which on the event loop stalled
# every stream the server was sending. Requests of up to INLINE_BYTES are prepared on the event loop itself: theirs
# takes about a millisecond at most, less than the hand-over to the thread can cost when the engine's threads hold
# both cores (c=1 TTFT p50 +1-2 ms, p95 +5 ms, measured with every request handed over; docs/performance.md, Round 43).
_PREPARE = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prepare")
INLINE_BYTES = 8192
_In = TypeVar("_In")
_Out = TypeVar("_Out")


async def prepared(prepare: Callable[[_In], _Out], body: _In, size: int) -> _Out:
    """``prepare(body)`` for a request of ``size`` bytes: on the preparing thread when it is larger than
    INLINE_BYTES, else here; what it raises (APIError, ValueError: a 4xx) is raised here."""
    if size <= INLINE_BYTES:
        return prepare(body)
    return await asyncio.get_running_loop().run_in_executor(_PREPARE, prepare, body)


class EngineClient(Protocol):
    """The engine as the server sees it (``pagellm.engine.async_engine.AsyncLLM``)."""

    tokenizer: Tokenizer
    runtime: Any  # max_model_len, num_blocks, vocab_size, hidden_size, pooling_only (worker/runtime.py)
    sampling_defaults: dict[str, Any]  # for requests that leave them unset (generation_config.py)
    max_logprobs: int  # the most logprobs per token a request may ask for (--max-logprobs)
    enable_prompt_embeds: bool  # requests may give prompts as input embeddings (--enable-prompt-embeds)
    image_placeholder: Optional[str]  # a vision-language model's image placeholder (None: it takes no images)

    def process_chat_images(self, text: str, urls: list[str], fetched: dict[str, bytes],
                            kwargs: Optional[dict[str, Any]] = None) -> list[int]: ...

    def generate(self, prompt: Union[str, list[int]], sampling_params: SamplingParams, request_id: str,
                 priority: int = 0, cache_salt: Optional[str] = None) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None: ...

    def kv_event_sources(self) -> dict[int, Any]: ...

    async def get_stats(self) -> SchedulerStats: ...

    async def start_profile(self) -> bool: ...

    async def reset_prefix_cache(self) -> bool: ...

    def check_lora(self, request: LoRARequest) -> None: ...

    def check_custom(self, params: SamplingParams) -> None: ...  # custom logits processors' validate_params

    async def stop_profile(self) -> list[str]: ...

    def log_requests(self, max_len: Optional[int] = None) -> None: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def update_weights_from_disk(self, model: Optional[str] = None) -> None: ...

    async def wake_up(self, tags: Optional[list[str]] = None) -> None: ...

    async def is_sleeping(self) -> bool: ...

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None: ...

    async def resume_generation(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def collective_rpc(self, method: str, timeout: Optional[float] = None, args: tuple = (),
                             kwargs: Optional[dict[str, Any]] = None) -> list[Any]: ...


def random_id(prefix: str, given: Optional[str] = None) -> str:
    """A response id: the prefix and the request's own ``request_id`` (vLLM's field), else a random one."""
    return f"{prefix}-{given or uuid.uuid4().hex}"


@dataclass
class ChoiceState:
    """One choice (a prompt's sample) as its deltas arrive."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False  # something was streamed
    num_cached_tokens: int = 0  # the prompt tokens its request found in the prefix cache
    num_draft_tokens: int = 0   # speculative drafts verified for it (known once it finished), and those accepted
    num_accepted_draft_tokens: int = 0
    metrics: Optional[RequestMetrics] = None  # its request's, once it finished
    text_offset: int = 0   # completions logprobs: where the next unsent token starts in the text
    token_ids: list[int] = field(default_factory=list)        # the tokens whose logprobs are not sent yet
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    keep_ids: bool = False  # return_token_ids: the choice keeps its token ids ...
    output_ids: list[int] = field(default_factory=list)       # ... all of them
    unsent_ids: list[int] = field(default_factory=list)       # ... and those no chunk has carried yet

    def add(self, output: RequestOutput) -> str:
        """Take one delta; returns its new text."""
        completion = output.outputs[0]
        self.text += completion.text
        self.num_tokens += len(completion.token_ids)
        if self.keep_ids:
            self.output_ids += completion.token_ids
            self.unsent_ids += completion.token_ids
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if completion.logprobs is not None:
            self.token_ids += completion.token_ids
            self.logprobs += completion.logprobs
        if completion.finish_reason is not None:
            self.finish_reason, self.stop_reason = completion.finish_reason, completion.stop_reason
            self.num_draft_tokens = output.metrics.num_draft_tokens
            self.num_accepted_draft_tokens = output.metrics.num_accepted_draft_tokens
            self.metrics = output.metrics
        return completion.text

    def take_ids(self) -> list[int]:
        """The tokens no chunk has carried yet (a stream's ``return_token_ids``)."""
        taken, self.unsent_ids = self.unsent_ids, []
        return taken

    def take_logprobs(self) -> tuple[list[int], list[dict[int, Logprob]]]:
        taken = self.token_ids, self.logprobs
        self.token_ids, self.logprobs = [], []
        return taken


class OpenAIServing:
    """Base of the completion and chat handlers."""

    def __init__(self, engine: EngineClient, model_names: Sequence[str],
                 loras: Optional[dict[str, LoRARequest]] = None, defaults: Optional[RequestDefaults] = None) -> None:
        self.engine = engine
        self.defaults = defaults or RequestDefaults()  # what a request leaves unset (the server's flags)
        # served name → its LoRA adapter (--lora-modules; shared by the handlers, so adapters loaded at run time
        # reach them all)
        self.loras = loras if loras is not None else {}
        self.tokenizer: Tokenizer = engine.tokenizer
        self.sampling_defaults: dict[str, Any] = engine.sampling_defaults
        self.model_names = list(model_names)
        self.max_model_len: int = engine.runtime.max_model_len
        self.vocab_size: int = engine.runtime.vocab_size
        self.num_spec_tokens: int = getattr(engine.runtime, "num_spec_tokens", 0)  # the most drafts a step verifies

    def check_model(self, name: Optional[str]) -> str:
        """The model name to answer with; 404 (as OpenAI does) for a model this server does not serve."""
        if name is None or name == "" or name in self.model_names or name in self.loras:
            return name or self.model_names[0]
        raise APIError(f"The model `{name}` does not exist (this server serves "
                       f"{', '.join([*self.model_names, *self.loras])})", 404, param="model", code="model_not_found")

    def check_request(self, request: SamplingRequest) -> tuple[str, SamplingParams]:
        """The model name to answer with and the request's sampling parameters, once the server's defaults are
        filled in (``RequestDefaults``, in place) and everything is checked."""
        self.defaults.apply(request)
        model = self.check_model(request.model)
        if self.engine.runtime.pooling_only:
            raise APIError(CLASSIFY_ONLY if self.engine.runtime.labels else POOLING_ONLY, 400, param="model",
                           code="model_not_supported")
        for name, why in [*request.unsupported(), *serving_beam.refusals(request)]:
            raise APIError(why, 400, param=name, code="unsupported_parameter")
        params: SamplingParams = request.to_sampling_params(self.sampling_defaults)  # type: ignore[attr-defined]
        return model, self.check_params(model, params)

    def response_metrics(self, choices: dict[int, ChoiceState], single: bool) -> Optional[PerRequestMetrics]:
        """A response's ``metrics`` (``request_metrics.py``), for one generation only: ``single`` when the request
        was one prompt and one sample, not a beam search."""
        if not single or len(choices) != 1:
            return None
        (choice,) = choices.values()
        return response_metrics(choice.metrics, choice.num_tokens, True, self.defaults.per_request_metrics,
                                self.defaults.spec_decode_metrics, self.num_spec_tokens)

    def check_embeds(self) -> None:
        """Embeddings (and the scores made of them) need a model whose pooled output is its hidden state: a
        classifier's is its class logits (400)."""
        if self.engine.runtime.labels:
            raise APIError(CLASSIFY_ONLY, 400, param="model", code="model_not_supported")

    def check_params(self, model: str, params: SamplingParams) -> SamplingParams:
        """``params`` with the served model's LoRA adapter, once its token ids and structured-output constraint are
        checked (here too, though the engine checks again, so a stream never starts for a request that must fail)."""
        if model in self.loras:
            params.lora_request = self.loras[model]
        params.check_token_ids(self.vocab_size)
        params.check_logprobs(self.engine.max_logprobs)
        self.engine.check_custom(params)
        if params.structured_outputs is not None:
            from pagellm.sample.structured import validate

            validate(params.structured_outputs)
        return params

    def load_prompt_embeds(self, data: bytes, where: str = "prompt_embeds: ", keep: Optional[int] = None,
                           side: Optional[str] = None) -> PromptEmbeds:
        """A prompt of input embeddings (``torch.save``'s bytes of a [tokens, hidden] tensor), read and checked, cut to
        ``keep`` rows (``truncate_prompt_tokens``, at ``side``); a 400 naming the fix, before anything is queued."""
        if not self.engine.enable_prompt_embeds:
            raise APIError(EMBEDS_OFF, 400, param="prompt_embeds")
        try:
            embeds = prompt_embeds.load(data)
        except ValueError as exc:
            raise APIError(f"{where}{exc} (send a torch.save of a [tokens, hidden] float tensor)", 400,
                           param="prompt_embeds") from None
        hidden_size = self.engine.runtime.hidden_size
        if embeds.hidden_size != hidden_size:
            raise APIError(f"{where}rows of {embeds.hidden_size} values; this model's hidden size is {hidden_size}",
                           400, param="prompt_embeds")
        kept = len(self.truncate([0] * embeds.num_tokens, keep))
        embeds = embeds.first(kept) if side == "right" else embeds.last(kept)
        if embeds.num_tokens >= self.max_model_len:
            raise APIError(f"{where}{embeds.num_tokens} rows, but max_model_len is {self.max_model_len}; send at most "
                           f"{self.max_model_len - 1}", 400, param="prompt_embeds", code="context_length_exceeded")
        return embeds

    def beam_stops(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a beam: the model's end-of-sequence tokens and the request's ``stop_token_ids``."""
        return self.tokenizer.eos_token_ids | frozenset(params.stop_token_ids or ())

    def detokenize(self, token_ids: Sequence[int]) -> str:
        bad = [t for t in token_ids if t >= self.vocab_size]
        if bad:
            raise APIError(f"token ids must be in [0, {self.vocab_size}); got {bad[0]}", 400, param="tokens")
        return self.tokenizer.decode(list(token_ids))

    def tokenize_prompts(self, raw: Any, add_special_tokens: bool, keep: Optional[int], field: str,
                         side: Optional[str] = None) -> list[tuple[Any, list[int], bool]]:
        """Each prompt of a completions ``prompt`` or embeddings ``input`` (a string, token ids, or a list of either):
        (the prompt as sent, its token ids cut to ``keep`` at ``side`` and checked, whether the cut shortened
        them)."""
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise APIError(f"{field} must not be empty", 400, param=field)
        prompts = []
        for position, item in enumerate(raw):
            if isinstance(item, str) and keep is None:  # cut to its last tokens, a long text may be what was meant
                self.check_text_length(len(item), position if len(raw) > 1 else None)
            ids = self.tokenizer.encode(item, add_special_tokens) if isinstance(item, str) else list(item)
            kept = self.truncate(ids, keep, side)
            prompts.append((item, self.check_prompt(kept, position if len(raw) > 1 else None), kept is not ids))
        return prompts

    def check_request_template(self, template: Optional[str]) -> None:
        """A request's own ``chat_template`` is a 400 unless the server trusts requests' templates."""
        if template is not None and not self.defaults.trust_request_chat_template:
            raise APIError("a request's own chat_template is taken only by a server started with "
                           "--trust-request-chat-template (a template runs on the server); omit it for the server's",
                           400, param="chat_template")

    def check_text_length(self, chars: int, position: Optional[int] = None) -> None:
        """Refuse text that cannot fit ``max_model_len`` before tokenizing it (megabytes of text take the tokenizer
        seconds): no token stands for more than the vocabulary's longest token in characters."""
        if chars <= self.max_model_len:  # fits whatever the longest token is (no vocabulary scan for short text)
            return
        longest = self.tokenizer.max_token_chars
        if chars > self.max_model_len * longest:
            where = "" if position is None else f"prompt {position}: "
            raise APIError(f"{where}the prompt has {chars} characters, more than max_model_len ({self.max_model_len}) "
                           f"tokens of at most {longest} characters each can hold; shorten it, or set "
                           "truncate_prompt_tokens to keep its last tokens", 400, param="prompt",
                           code="context_length_exceeded")

    def truncate(self, token_ids: list[int], keep: Optional[int], side: Optional[str] = None) -> list[int]:
        """The prompt's last ``keep`` tokens (``truncate_prompt_tokens``; -1: ``max_model_len``), its first with
        ``truncation_side`` "right", or all of them."""
        if keep is None:
            return token_ids
        keep = self.max_model_len if keep == -1 else keep
        if keep > self.max_model_len:
            raise APIError(f"truncate_prompt_tokens ({keep}) must be at most max_model_len ({self.max_model_len})",
                           400, param="truncate_prompt_tokens")
        return cut(token_ids, keep, side)

    def check_prompt(self, token_ids: list[int], position: Optional[int] = None) -> list[int]:
        try:
            check_prompt(token_ids, self.max_model_len, self.vocab_size)
        except ValueError as exc:
            where = "" if position is None else f"prompt {position}: "
            raise APIError(f"{where}{exc}", 400, param="prompt",
                           code="context_length_exceeded" if len(token_ids) >= self.max_model_len else None)
        return token_ids

    async def generate(self, prompts: list[list[int]], params: SamplingParams, request_id: str, priority: int,
                       beam: Optional[BeamSearchParams] = None,
                       cache_salt: Optional[str] = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas of every prompt's request, interleaved as they arrive (see the module docstring); with ``beam``,
        each prompt's best beams, prompt after prompt (``serving_beam.py``). ``cache_salt``: the prefix cache's
        salt (requests of different salts share no blocks)."""
        params = msgspec.structs.replace(params, output_kind=RequestOutputKind.DELTA)  # what the server streams
        if beam is not None:
            for index, prompt in enumerate(prompts):
                async for output in serving_beam.beam_outputs(self.engine, prompt, beam, self.beam_stops(params),
                                                              f"{request_id}-{index}", priority, self.max_model_len,
                                                              cache_salt):
                    yield index, output
            return
        if len(prompts) == 1:
            stream = self.engine.generate(prompts[0], params, request_id, priority, cache_salt)
            try:
                async for output in stream:
                    yield 0, output
            finally:
                await _close(stream)
            return
        async for item in self._generate_many(prompts, params, request_id, priority, cache_salt):
            yield item

    async def pool(self, prompts: list[list[int]], model: str, request_id: str, priority: int) -> list[list[float]]:
        """Each prompt's pooled output (its last token's final hidden state; a classifier's class logits), in prompt
        order: one pooling request per prompt, under the served model's LoRA adapter if any."""
        params = SamplingParams.for_pooling(self.loras.get(model))
        pooled: dict[int, list[float]] = {}
        async for index, output in self.generate(prompts, params, request_id, priority):
            if output.pooled is not None:
                pooled[index] = output.pooled
        if len(pooled) != len(prompts):
            raise RuntimeError("the engine finished a pooling request without its pooled output")
        return [pooled[i] for i in range(len(prompts))]

    async def _generate_many(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                             priority: int, cache_salt: Optional[str]) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump(index: int, prompt: list[int]) -> None:
            try:
                async for output in self.engine.generate(prompt, params, f"{request_id}-{index}", priority,
                                                         cache_salt):
                    queue.put_nowait((index, output))
            except Exception as exc:  # handed to the consumer, which raises it
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(_DONE)

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _close(stream: AsyncIterator[RequestOutput]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
