"""``LLMEngine``: vLLM's step-wise engine, for a generation loop of your own over an in-process engine core.
``LLM`` is built on it (``llm.llm_engine``).

Contract:
- ``LLMEngine(config, log_stats=False)``, ``from_config(config)`` or ``from_engine_args(EngineArgs(...))`` (its
  ``disable_log_stats=False``, vLLM's default there, keeps stats: the periodic log line and ``get_metrics()``).
- ``add_request(request_id, prompt, params=None, arrival_time=None, lora_request=None, priority=0)`` queues one
  prompt (text, token ids, or a prompt dict, as ``LLM.generate`` takes) with its ``SamplingParams`` (None: the
  model's defaults, ``get_default_sampling_params()``). A bad prompt or parameter raises ValueError, as does a
  ``request_id`` that is still unfinished; nothing is queued then. ``n > 1`` or ``best_of`` run sibling requests
  (``parallel_sampling.py``). The core knows a one-sample request by its own id, sample ``i`` of more as
  ``f"{i}_{request_id}"`` (vLLM's child ids).
- ``step()`` runs one scheduler step and returns the ``RequestOutput``s it produced, each with its caller's
  ``request_id``, as the request's ``params.output_kind`` asks (vLLM's ``RequestOutputKind``):
  - ``CUMULATIVE`` (the default): one output per request that moved, holding every sample's whole completion so
    far (index order);
  - ``DELTA``: one output per sample that moved, with only its new text and token ids (``outputs[0].index`` is the
    sample; its last one has its ``finish_reason``);
  - ``FINAL_ONLY``: one output per request, when every sample is done;
  - ``best_of > n``, whatever the kind: one output, when every candidate is done, holding the best ``n``.
  A request's last output has ``finished=True``; a step may return nothing (a prompt chunk samples no token).
- ``abort_request(request_ids)`` (one id or several) ends those requests at once: no further output, and their KV
  blocks come back. Ids that are not unfinished are ignored.
- ``has_unfinished_requests()`` and ``get_num_unfinished_requests()`` count the caller's requests (a request with
  ``n`` samples is one); ``step_stats`` is the last step's ``SchedulerStats``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import msgspec

from pagellm import generation_config
from pagellm.config import EngineConfig
from pagellm.engine.client import InprocClient
from pagellm.engine.exceptions import ASLEEP, EngineSleepingError
from pagellm.engine.input_processor import InputProcessor, PromptType, as_prompt, load_tokenizer
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.parallel_sampling import needs_ranking, select_best, sibling_params
from pagellm.engine.request_stream import Accumulated
from pagellm.lora import LoRARequest
from pagellm.metrics.log import LogStatsSink
from pagellm.metrics.reader import Metric, snapshot
from pagellm.metrics.sink import FanoutSink
from pagellm.metrics.stats import IterationStats, SchedulerStats
from pagellm.model.loader import resolve_model_dir
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams


@dataclasses.dataclass
class _Request:
    """One ``add_request`` call: its samples' core requests and, unless it streams deltas, their outputs so far."""

    request_id: str
    params: SamplingParams
    core_ids: list[str]
    done: set[int] = dataclasses.field(default_factory=set)
    whole: Accumulated | None = None  # None: DELTA without ranking

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.core_ids)

    def add(self, out: RequestOutput, index: int) -> RequestOutput | None:
        """Take one sample's delta; returns it when this request streams deltas."""
        out.request_id, out.outputs[0].index = self.request_id, index
        if out.outputs[0].finished:
            self.done.add(index)
        out.finished = self.finished
        if self.whole is None:
            return out
        self.whole.add(out)
        return None

    def output(self) -> RequestOutput | None:
        """The output this step owes the caller (after ``add``), if any."""
        assert self.whole is not None
        if needs_ranking(self.params):
            if not self.finished:
                return None
            whole = self.whole.snapshot(True)
            whole.outputs = select_best(whole.outputs, self.params)
            return whole
        if self.params.output_kind == RequestOutputKind.CUMULATIVE or self.finished:
            return self.whole.snapshot(self.finished)
        return None


class LLMEngine:
    """vLLM's ``LLMEngine`` (see the module docstring for the contract)."""

    def __init__(self, config: EngineConfig, log_stats: bool = False) -> None:
        self.config = config
        model_dir = resolve_model_dir(config.model_config.model)
        self.tokenizer = load_tokenizer(config.model_config, model_dir)
        self.sampling_defaults = generation_config.for_model(config.model_config, model_dir)
        self.engine_core = InprocClient(config)
        runtime = self.engine_core.runtime
        self.input_processor = InputProcessor.for_engine(self.tokenizer, runtime, config, model_dir)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats_sink, self._metrics = _stats_sinks(config, runtime) if log_stats else (None, None)
        self.step_stats: SchedulerStats | None = None
        self._requests: dict[str, _Request] = {}            # caller's id → its request
        self._core: dict[str, tuple[_Request, int]] = {}    # core request id → (its request, sample index)

    @classmethod
    def from_config(cls, config: EngineConfig, log_stats: bool = False) -> LLMEngine:
        return cls(config, log_stats)

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> LLMEngine:
        """From vLLM's ``EngineArgs`` (``pagellm.engine_args.EngineArgs``)."""
        return cls(engine_args.create_engine_config(), log_stats=not engine_args.disable_log_stats)

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the defaults of the model's generation_config.json."""
        return SamplingParams(**self.sampling_defaults)

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (ValueError with ``skip_tokenizer_init``)."""
        return self.tokenizer.hf

    # ------------------------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> None:
        """Queue one prompt (see the module docstring)."""
        if self.engine_core.is_sleeping():
            raise EngineSleepingError(ASLEEP)
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is unfinished already: give each live request its own id")
        params = params if params is not None else self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if lora_request is not None:
            params = msgspec.structs.replace(params, lora_request=lora_request)
        prompt = as_prompt(prompt)
        base = self.input_processor.process(request_id, prompt, params, priority)
        if arrival_time is not None:
            base = msgspec.structs.replace(base, arrival_time=arrival_time)
        siblings = sibling_params(base.sampling_params)
        core_ids = [request_id] if len(siblings) == 1 else [f"{i}_{request_id}" for i in range(len(siblings))]
        for core_id in core_ids:
            if core_id in self._core:
                raise ValueError(f"request id {request_id!r} clashes with the core id {core_id!r} of the unfinished "
                                 f"request {self._core[core_id][0].request_id!r}: pick another")
        core = [msgspec.structs.replace(base, request_id=core_id, sampling_params=s)
                for core_id, s in zip(core_ids, siblings)]
        streams = params.output_kind == RequestOutputKind.DELTA and not needs_ranking(params)
        request = _Request(request_id, params, [r.request_id for r in core], whole=None if streams else Accumulated())
        self._requests[request_id] = request
        text = prompt if isinstance(prompt, str) else None
        for index, core_request in enumerate(core):
            self._core[core_request.request_id] = (request, index)
            self.output_processor.add_request(core_request, text)
        self.engine_core.add_requests(core)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """End these requests now (see the module docstring)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        core_ids = [core_id for i in ids if (request := self._requests.pop(i, None)) is not None
                    for core_id in request.core_ids]
        for core_id in core_ids:
            self._core.pop(core_id, None)
            self.output_processor.abort(core_id)
        self.engine_core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def step(self) -> list[RequestOutput]:
        """One scheduler step; the outputs it produced (see the module docstring)."""
        if not self._requests:
            return []
        message = self.engine_core.get_output()
        self.step_stats = message.stats
        iteration = IterationStats() if self.stats_sink is not None else None
        outputs, to_abort = self.output_processor.process_outputs(message.step, delta=True, iteration=iteration)
        if self.stats_sink is not None:
            self.stats_sink.record(message.stats, iteration)
        self.engine_core.abort_requests(to_abort)
        results: list[RequestOutput] = []
        moved: dict[str, _Request] = {}
        for out in outputs:
            core_id, sample_done = out.request_id, out.outputs[0].finished
            request, index = self._core.pop(core_id) if sample_done else self._core[core_id]
            delta = request.add(out, index)
            if delta is not None:
                results.append(delta)
            else:
                moved[request.request_id] = request
            if request.finished:
                del self._requests[request.request_id]
        results.extend(whole for request in moved.values() if (whole := request.output()) is not None)
        return results

    # ------------------------------------------------------------------------------------------- engine
    def get_metrics(self) -> list[Metric]:
        """The engine's Prometheus series so far (``log_stats``; ``LLM.get_metrics``)."""
        if self._metrics is None:
            raise ValueError("get_metrics reads the engine's stats, which are off: create the LLM with "
                             "disable_log_stats=False (LLMEngine with log_stats=True)")
        return snapshot(self._metrics)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def _stats_sinks(config: EngineConfig, runtime: Any) -> tuple[FanoutSink, Any]:
    """The server's Prometheus series (on a registry of the engine's own) and its periodic stats log line; and that
    registry."""
    from pagellm.metrics.prometheus import PrometheusSink

    prometheus = PrometheusSink(config.model_config.model or "default", config.cache_config, runtime.max_model_len,
                                runtime.num_blocks)
    return FanoutSink([prometheus, LogStatsSink()]), prometheus.registry
