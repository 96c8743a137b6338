"""``AsyncLLM``: the asyncio frontend engine the server uses, over an engine core in its own process.

Contract:
- ``AsyncLLM.from_config(config)`` (or vLLM's ``from_engine_args(AsyncEngineArgs(...))``) starts the core
  (``client.MPClient``; with ``data_parallel_size > 1``, that many cores behind ``dp_client.DPClient``), resolves
  the model and loads the tokenizer while the core imports torch, compiles its kernels and loads the model (two
  processes, so the work overlaps; on a cold start the core waits for this process's GGUF conversion,
  ``model/loader.py``), and waits for its ``RuntimeInfo`` (``runtime``); a start-up ``ValueError`` (bad model or
  config, KV cache too small, no tokenizer files) is re-raised as is, and the core is stopped.
- ``generate(prompt, sampling_params, request_id)`` is an async generator of ``RequestOutput``s, as the
  parameters' ``output_kind`` (vLLM's ``RequestOutputKind``) asks:
  - ``CUMULATIVE``, the default (vLLM's): each output holds every sibling's whole completion so far (index order);
  - ``DELTA`` (what the servers stream): each output carries one sibling's text and token ids new since its previous
    one (``outputs[0].index`` is the sibling; a sibling's last delta has its ``finish_reason`` set);
  - ``FINAL_ONLY``: one output, when all are done (``request_stream.Accumulated`` builds it and ``CUMULATIVE``'s
    from the deltas).
  The last output has ``finished=True``. A bad prompt raises ``ValueError`` on the first ``__anext__``, before
  anything reaches the core. Tokenization, detokenization, stop strings and timing are the
  ``InputProcessor``/``OutputProcessor`` that ``LLM`` uses; a stop string aborts the request in the core.
- Outputs report the caller's ``request_id``; internally each core request gets a unique id, so callers may
  reuse ids. ``abort(request_id)`` aborts every live request with that id (its streams end with ``"abort"``).
- ``n > 1`` (or ``best_of``) runs sibling requests (``parallel_sampling.py``: sibling ``i`` gets ``seed + i``
  when a seed is set; the siblings share the prompt's KV blocks through the prefix cache). With ``best_of > n``
  nothing is yielded until every sibling is done; then the best ``n`` come as one whole output each, whatever the
  kind.
- ``stream_interval`` (vLLM's; the engine's ``--stream-interval``, or a request's own when larger): a sibling's
  outputs come after every that many new tokens, its first and last at once (``request_stream.Paced``).
- When the consumer stops iterating (``break`` + close, ``GeneratorExit``, ``CancelledError``), the live requests
  of that call are aborted in the core, so their KV blocks come back.
- A dead core (crash, kill) fails every pending ``generate`` and every later call with ``EngineDeadError``;
  ``check_health()`` raises it; ``errored`` turns True. ``shutdown()`` stops the core; later calls raise it too.
- ``get_stats()`` returns the latest gauges (running, waiting, KV usage) and the counters accumulated since start.
- Stats: every batch of core outputs goes to ``stats_sink`` (``metrics.sink.StatsSink``; the null sink by default)
  as the core's ``SchedulerStats`` plus the frontend's ``IterationStats``; aborted requests are counted there too.
  A request's OpenTelemetry parent (``metrics.tracing.current_context()`` when ``generate`` starts) rides along.

Threads: core outputs are handled on the client's output thread (detokenization included) under ``_lock`` and
handed to each stream's event loop with ``call_soon_threadsafe``, so an engine may serve several event loops.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterable

import msgspec

from pagellm import generation_config, prompt_embeds
from pagellm.config import EngineConfig
from pagellm.engine.client import MPClient
from pagellm.engine.dp_client import DPClient
from pagellm.engine.exceptions import ASLEEP, EngineDeadError, EngineOverloadedError, EngineSleepingError
from pagellm.engine.input_processor import InputProcessor, PromptType, as_prompt, load_tokenizer
from pagellm.engine.operations import EngineOperations
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.parallel_sampling import needs_ranking, sibling_params
from pagellm.engine.pause import PauseGate
from pagellm.engine.request_log import RequestLog
from pagellm.engine.request_stream import (Accumulated, Paced, RequestStream, Tracked, aborted_output,
                                           best_of, coalesce)
from pagellm.engine.wire import EngineCoreOutputs, EngineCoreRequest, RequestError
from pagellm.lora import LoRARequest
from pagellm.metrics import tracing
from pagellm.metrics.log import LogStatsSink
from pagellm.metrics.sink import NullStatsSink, StatsSink
from pagellm.metrics.stats import IterationStats, SchedulerStats
from pagellm.mm_config import MultiModalConfig
from pagellm.model.loader import resolve_model_dir
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.tokenizer import Tokenizer
from pagellm.worker.runtime import RuntimeInfo

logger = logging.getLogger(__name__)

class AsyncLLM(EngineOperations):
    """Frontend engine for the server (see the module docstring for the contract; its operations beyond requests
    in ``operations.EngineOperations``)."""

    tokenizer: Tokenizer
    output_processor: OutputProcessor
    sampling_defaults: dict[str, Any]  # the model's generation_config.json (generation_config.py)

    def __init__(self, config: EngineConfig, load_text: Callable[[], tuple[Tokenizer, dict[str, Any]]],
                 startup_timeout_s: float = 600.0, stats_sink: StatsSink | None = None) -> None:
        """``load_text`` (the tokenizer and the sampling defaults) runs while the core starts (see ``MPClient``'s
        ``while_starting``). ``config`` takes the online-serving defaults where it leaves them open
        (``EngineConfig.for_serving``)."""
        config = config.for_serving()
        self.config = config
        self.stats_sink: StatsSink = stats_sink or NullStatsSink()
        self._lock = threading.Lock()
        self._tracked: dict[str, Tracked] = {}            # core request id → its call
        self._by_request_id: dict[str, set[str]] = {}       # caller's id → live core request ids
        self._ids = itertools.count()
        self._stats = SchedulerStats()
        self._dead_reason: str | None = None
        self._shut_down = False
        self._request_log: RequestLog | None = None  # requests are logged only when asked (``log_requests``)
        self._asleep = False  # sleep mode: new requests are refused
        sched = config.scheduler_config  # pausing, and the limits of requests in flight and of the prefill backlog
        self._pause = PauseGate(sched.max_num_queued_reqs, sched.max_num_queued_tokens)

        def load_text_side() -> None:  # no output can arrive before the handshake, so none meets a half-made engine
            self.tokenizer, self.sampling_defaults = load_text()
            self.output_processor = OutputProcessor(self.tokenizer)

        client = DPClient if config.parallel_config.data_parallel_size > 1 else MPClient
        self.client: MPClient | DPClient = client(config, self._on_outputs, self._on_dead, startup_timeout_s,
                                                  while_starting=load_text_side)
        self.runtime: RuntimeInfo = self.client.runtime
        self.input_processor = InputProcessor.for_engine(self.tokenizer, self.runtime, config,
                                                         resolve_model_dir(config.model_config.model))
        if config.model_config.enable_prompt_embeds:
            prompt_embeds.preload()

    @classmethod
    def from_config(cls, config: EngineConfig, startup_timeout_s: float = 600.0,
                    stats_sink: StatsSink | None = None) -> AsyncLLM:
        def load_text() -> tuple[Tokenizer, dict[str, Any]]:
            # while the core starts; a GGUF conversion here is the core's to wait for
            model_dir = resolve_model_dir(config.model_config.model)
            return load_tokenizer(config.model_config, model_dir), generation_config.for_model(config.model_config,
                                                                                                model_dir)

        return cls(config, load_text, startup_timeout_s, stats_sink)

    @classmethod
    def from_engine_args(cls, engine_args: Any, startup_timeout_s: float = 600.0) -> AsyncLLM:
        """From vLLM's ``AsyncEngineArgs`` (``pagellm.engine_args``): its ``disable_log_stats=False`` (the default)
        logs the periodic stats line, its ``enable_log_requests`` each request."""
        engine = cls.from_config(engine_args.create_engine_config(), startup_timeout_s,
                                 None if engine_args.disable_log_stats else LogStatsSink())
        if getattr(engine_args, "enable_log_requests", False):
            engine.log_requests()
        return engine

    @property
    def enable_prompt_embeds(self) -> bool:
        """Whether requests may give prompts as input embeddings (``enable_prompt_embeds``)."""
        return self.input_processor.enable_prompt_embeds

    @property
    def image_placeholder(self) -> str | None:
        """What a prompt writes where an image goes (a vision-language model's; None: this model takes no images)."""
        return self.input_processor.image_placeholder

    @property
    def media(self) -> MultiModalConfig:
        """Where image URLs may point (``images.fetch``), among the multimodal settings."""
        return self.input_processor.mm

    def process_chat_images(self, text: str, urls: list[str], fetched: dict[str, bytes],
                            kwargs: dict[str, Any] | None = None) -> list[int]:
        """A rendered chat's text and images (``InputProcessor.process_chat_images``, ``kwargs`` the processor's):
        its token ids, carrying the images (a prompt ``generate`` takes as it is)."""
        return self.input_processor.process_chat_images(text, urls, fetched, kwargs)

    @property
    def max_logprobs(self) -> int:
        """The most logprobs per token a request may ask for (``max_logprobs``; -1 resolved to the vocabulary)."""
        return self.input_processor.max_logprobs

    # ------------------------------------------------------------------------------------------- requests
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0,
                       cache_salt: str | None = None, *,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The outputs of one prompt (n siblings when ``sampling_params.n > 1``) as its ``output_kind`` asks; see the
        module docstring. Requests of different ``cache_salt``s never share prefix-cache blocks. ``lora_request``
        (vLLM's keyword) runs it under that adapter, as ``sampling_params.lora_request`` does."""
        params = sampling_params if lora_request is None else \
            msgspec.structs.replace(sampling_params, lora_request=lora_request)
        prompt = as_prompt(prompt)
        requests = self._make_requests(prompt, params, request_id, priority, cache_salt)
        if self._request_log is not None:
            self._request_log.request(request_id, prompt, requests[0], self.tokenizer)
        core_ids = [r.request_id for r in requests]
        try:
            await self._pause.enter(core_ids, len(requests[0].prompt_token_ids))
        except EngineOverloadedError as exc:
            self.stats_sink.record(None, IterationStats(time.time(), admission_rejections={exc.reason: 1}))
            raise
        stream = RequestStream(asyncio.get_running_loop())
        try:
            self._raise_if_dead()  # it may have died while this call waited at a pause
            self._register(request_id, requests, prompt if isinstance(prompt, str) else None, stream)
            self.client.add_requests(requests)
            if needs_ranking(params):
                for item in await best_of(stream, params, len(requests)):
                    yield item
                return
            done: set[int] = set()
            kind = params.output_kind
            whole = None if kind == RequestOutputKind.DELTA else Accumulated()
            interval = max(self.config.scheduler_config.stream_interval, params.stream_interval or 1)
            paced = Paced(interval) if interval > 1 else None
            while len(done) < len(requests):
                for item in coalesce(await stream.take()):
                    if isinstance(item, BaseException):
                        raise item
                    if paced is not None and (item := paced.add(item)) is None:
                        continue
                    if item.outputs[0].finished:
                        done.add(item.outputs[0].index)
                    item.finished = len(done) == len(requests)
                    if whole is None:
                        yield item
                        continue
                    whole.add(item)
                    if kind == RequestOutputKind.CUMULATIVE or item.finished:
                        yield whole.snapshot(item.finished)
        finally:
            self._drop(core_ids, notify=False)
            self._pause.leave(len(requests))
            self._pause.prefilled(core_ids)

    def log_requests(self, max_len: int | None = None, outputs: bool = False) -> None:
        """Log each request as it arrives (vLLM's ``--enable-log-requests``): its prompt, sampling parameters and
        token ids, the prompt cut to ``max_len`` characters and the ids to ``max_len`` ids (None: whole); with
        ``outputs`` (``--enable-log-outputs``), each sample's text and token ids as it finishes, cut alike."""
        self._request_log = RequestLog(max_len, outputs)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort every live request with this caller id (or these ids); their ``generate`` streams end with
        ``"abort"``."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            ids = [core_id for i in request_ids for core_id in self._by_request_id.get(i, ())]
        self._drop(ids, notify=True)

    def _make_requests(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int, cache_salt: str | None = None) -> list[EngineCoreRequest]:
        self._raise_if_dead()
        if self._asleep:  # alive (healthy), but taking no requests
            raise EngineSleepingError(ASLEEP)
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        base = self.input_processor.process(request_id, prompt, params, priority, cache_salt)
        return [msgspec.structs.replace(base, request_id=self._unique_id(request_id), sampling_params=sibling)
                for sibling in sibling_params(base.sampling_params)]

    def _unique_id(self, request_id: str) -> str:
        # The suffix after the last "-" is unique per core request, so the whole id is unique.
        return f"{request_id}-{next(self._ids)}"

    def _register(self, request_id: str, requests: list[EngineCoreRequest], prompt: str | None,
                  stream: RequestStream) -> None:
        with self._lock:
            self._raise_if_dead()  # under the lock: _on_dead either sees these requests or we see it
            trace_context = tracing.current_context()
            for index, request in enumerate(requests):
                self.output_processor.add_request(request, prompt)
                state = self.output_processor.requests[request.request_id]
                assert state.stats is not None
                state.stats.caller_id, state.stats.trace_context = request_id, trace_context
                logged = self._request_log is not None and self._request_log.outputs
                self._tracked[request.request_id] = Tracked(request_id, index, stream, prompt, state.prompt_token_ids,
                                                            ([], []) if logged else None)
                self._by_request_id.setdefault(request_id, set()).add(request.request_id)

    def _untrack(self, core_id: str) -> Tracked:
        tracked = self._tracked.pop(core_id)
        siblings = self._by_request_id[tracked.request_id]
        siblings.discard(core_id)
        if not siblings:
            del self._by_request_id[tracked.request_id]
        self.output_processor.abort(core_id)
        return tracked

    def _drop(self, core_ids: list[str], notify: bool) -> None:
        """Forget live requests and abort them in the core; ``notify`` then ends their streams with "abort" (after
        the abort is sent: a caller that asks the core anything next finds them gone)."""
        with self._lock:
            live = [i for i in core_ids if i in self._tracked]
            ended = [(self.output_processor.requests.get(i), self._untrack(i)) for i in live]
        self.client.abort_requests(live)
        for state, tracked in ended if notify else ():
            tracked.stream.put(aborted_output(tracked, state))
        if live:
            self.stats_sink.record(None, IterationStats(time.time(), num_aborted=len(live)))

    # ------------------------------------------------------------------------------------------- core side
    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Runs on the client's output thread: detokenize, route deltas to their streams, abort stop strings."""
        with self._lock:
            if outputs.stats is not None:
                self._stats.accumulate(outputs.stats)
            for error in outputs.errors:
                self._fail(error)
            iteration = IterationStats()
            results, to_abort = self.output_processor.process_outputs(outputs.step, delta=True,
                                                                      iteration=iteration)
        self.client.abort_requests(to_abort)  # first: a caller whose stream has ended finds its request gone
        with self._lock:
            for out in results:
                self._route(out)
        if outputs.stats is not None or outputs.step.req_ids:
            self.stats_sink.record(outputs.stats, iteration)

    def _route(self, out: RequestOutput) -> None:
        core_id = out.request_id
        if core_id not in self._tracked:  # its caller left (``_drop``) since the outputs were processed
            return
        tracked = self._untrack(core_id) if out.finished else self._tracked[core_id]
        if not tracked.prefilled:  # its first output: its prompt leaves the prefill backlog
            tracked.prefilled = True
            self._pause.prefilled([core_id])
        completion = out.outputs[0]
        completion.index = tracked.index
        out.request_id = tracked.request_id
        if tracked.output is not None:
            self._request_log.output(tracked, completion)  # type: ignore[union-attr]
        tracked.stream.put(out)

    def _fail(self, error: RequestError) -> None:
        if error.request_id not in self._tracked:
            return
        tracked = self._untrack(error.request_id)
        if error.error_type == "ValueError":
            tracked.stream.put(ValueError(error.message))
        else:
            tracked.stream.put(RuntimeError(f"the engine core refused the request: {error.error_type}: "
                                            f"{error.message}"))

    def _on_dead(self, error: EngineDeadError) -> None:
        with self._lock:
            self._dead_reason = str(error)
            streams = {id(t.stream): t.stream for t in self._tracked.values()}
            for core_id in list(self._tracked):
                self._untrack(core_id)
        for stream in streams.values():
            stream.put(EngineDeadError(str(error)))
        self._pause.open()  # the calls waiting at a pause fail too

    # ------------------------------------------------------------------------------------------- engine
    @property
    def is_running(self) -> bool:
        return self._dead_reason is None and not self._shut_down

    @property
    def dead_error(self) -> EngineDeadError:
        """vLLM's: the error a call to this engine raises once it is dead."""
        return EngineDeadError(self._dead_reason or "the engine was shut down")

    @property
    def model_config(self) -> Any:
        return self.config.model_config

    async def get_model_config(self) -> Any:
        """vLLM's: the engine's model settings (``config.model_config``)."""
        return self.config.model_config

    def kv_event_sources(self) -> dict[int, Any]:
        """vLLM's: where each engine core (by data-parallel rank) publishes its KV cache events; empty when none
        does."""
        events, size = self.config.kv_events_config, self.config.parallel_config.data_parallel_size
        return {rank: events.for_rank(rank) for rank in range(size)} if events.publishes else {}

    async def get_tokenizer(self) -> Any:
        """vLLM's: the model's Hugging Face tokenizer, the one the engine encodes with."""
        return self.tokenizer.hf

    @property
    def errored(self) -> bool:
        """True when the core died on its own (not after ``shutdown()``)."""
        return self._dead_reason is not None and not self._shut_down

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    async def check_health(self) -> None:
        self._raise_if_dead()

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._shut_down:
            raise EngineDeadError("the engine was shut down")

    def check_custom(self, params: SamplingParams) -> None:
        """Raise ValueError when a custom logits processor refuses ``params`` (its ``validate_params``)."""
        self.input_processor.check_custom(params)

    def check_lora(self, request: LoRARequest) -> None:
        """Raise ValueError unless this engine can run ``request``'s adapter (``lora.check_adapter``)."""
        self.input_processor.check_adapter(request)

    def shutdown(self) -> None:
        """Stop the core process; pending and later requests fail with ``EngineDeadError``."""
        self._shut_down = True
        self._pause.open()
        self.client.shutdown()
        self.stats_sink.shutdown()
