"""``LLM``: the offline facade over an ``LLMEngine`` (``llm.llm_engine``: the tokenizer, an in-process engine core
and the output processor); it turns a batch of prompts into ``RequestOutput``s in input order, with a progress bar.

``n > 1`` and ``best_of`` run sibling requests (``engine/parallel_sampling.py``); each prompt's ``RequestOutput``
holds its ``n`` ``CompletionOutput``s in index order (rank order for ``best_of > n``)."""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Callable, Iterator, Sequence

import msgspec
from tqdm.auto import tqdm

from pagellm import images
from pagellm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pagellm.chat_content import image_urls
from pagellm.config import EngineConfig
from pagellm.engine.exceptions import check_sleep_level
from pagellm.engine.input_processor import CLASSIFY_ONLY, PromptType
from pagellm.engine.llm_engine import LLMEngine
from pagellm.lora import LoRARequest
from pagellm.metrics.reader import Metric
from pagellm.metrics.stats import SchedulerStats
from pagellm.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput, EmbeddingRequestOutput,
                             RequestOutput, ScoringOutput, ScoringRequestOutput, class_probs, pooled_embedding)
from pagellm.prompt_embeds import PromptEmbeds
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.scoring import Texts, cosine, distinct, pair_texts
from pagellm.tokenizer import load_chat_template

logger = logging.getLogger(__name__)

Messages = list[dict[str, Any]]


class LLM:
    """Generate offline: ``LLM(model=None, **engine_args).generate(prompts, sampling_params)``.

    ``model`` is a Hugging Face directory or a .gguf file (None: the built-in SmolLM2-135M-Instruct). Engine
    arguments keep vLLM's names: ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
    ``enable_prefix_caching``, ``enable_chunked_prefill``, ``dtype``, ``kv_cache_dtype`` ("auto", "fp8",
    "fp8_e4m3", "fp8_e5m2"), ``quantization`` ("w8a8_int8" or "w4a8_int4"; a compressed-tensors W8A8 int8
    checkpoint needs none, and a GPTQ, AWQ or compressed-tensors weight-only one is dequantized without it),
    ``seed``; plus ``kv_cache_memory`` (bytes, or a size such as "4GiB") and ``scheduling_policy`` ("fcfs" or
    "priority"). ``disable_log_stats=False`` keeps the server's Prometheus series, read by ``get_metrics()``.
    """

    def __init__(self, model: str | None = None, disable_log_stats: bool = True, **engine_args: Any) -> None:
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs engine cores behind a server (pagellm serve, AsyncLLM); "
                             "offline, run one LLM per process on its share of the CPUs")
        self.llm_engine = LLMEngine(config, log_stats=not disable_log_stats)
        self.config = config
        self.tokenizer = self.llm_engine.tokenizer
        self.sampling_defaults = self.llm_engine.sampling_defaults
        self.engine = self.llm_engine.engine_core
        self.input_processor = self.llm_engine.input_processor
        self._ids = itertools.count()
        self.last_stats: list[SchedulerStats] = []

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Prompts are strings or token-id lists (or one of either); outputs come back in input order.
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt (needs ``enable_lora``).
        ``tokenization_kwargs`` (vLLM's): ``truncate_prompt_tokens`` and ``truncation_side`` for every prompt."""
        batch = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params if sampling_params is not None else self.get_default_sampling_params(),
                             len(batch), "sampling_params")
        if tokenization_kwargs:
            fields = _tokenization(tokenization_kwargs)
            params = [msgspec.structs.replace(p, **fields) for p in params]
        if lora_request is not None:
            adapters = _per_prompt(lora_request, len(batch), "lora_request")  # type: ignore[arg-type]
            params = [msgspec.structs.replace(p, lora_request=a) for p, a in zip(params, adapters)]
        priorities = _per_prompt(list(priority) if priority is not None else 0, len(batch), "priority")
        ids = self._add_requests(batch, params, priorities)
        finished = self._run(ids, use_tqdm)
        return [finished[i] for i in ids]

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no parameters: ``SamplingParams()`` with the
        defaults of the model's generation_config.json (``generation_config`` engine argument, as vLLM does)."""
        return SamplingParams(**self.sampling_defaults)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template_content_format: str = "auto",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}`` dicts) or a list of them, via the chat template:
        the model's, or ``chat_template`` (Jinja text or a file holding it), with ``chat_template_kwargs`` and
        ``tools`` (OpenAI's function definitions, for templates that list them to the model);
        ``continue_final_message`` (with ``add_generation_prompt=False``) has the model continue the last message;
        ``chat_template_content_format`` (auto, string, openai: ``pagellm/chat_content.py``) how content reaches it;
        ``lora_request`` and ``tokenization_kwargs`` as ``generate`` takes them."""
        if not messages:  # else an empty list would silently become an empty batch
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts "
                             "(or a list of such conversations)")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)  # type: ignore
        template = load_chat_template(chat_template) if chat_template is not None else None
        if tools:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        prompts = [self._chat_prompt(c, add_generation_prompt, chat_template_kwargs, template, continue_final_message,
                                     chat_template_content_format, mm_processor_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request,
                             tokenization_kwargs=tokenization_kwargs)

    def _chat_prompt(self, conversation: Messages, add_generation_prompt: bool, kwargs: dict[str, Any] | None,
                     template: str | None, continue_final_message: bool, content_format: str,
                     mm_kwargs: dict[str, Any] | None = None) -> PromptType:
        """One conversation's prompt: its token ids, or for a vision-language model with image parts its text and
        images (``images.py``: data URLs, http(s) URLs fetched; ``mm_kwargs`` for the processor)."""
        urls = image_urls(conversation) if self.input_processor.image_token_id is not None else []  # type: ignore
        if not urls:
            return self.tokenizer.apply_chat_template(conversation, add_generation_prompt, kwargs, template,
                                                      continue_final_message, content_format=content_format)
        placeholder = self.input_processor.image_placeholder
        text = self.tokenizer.render_chat(conversation, add_generation_prompt, kwargs, template,  # type: ignore
                                          continue_final_message, content_format, placeholder)
        fetched = images.fetch_sync(urls, self.input_processor.mm)
        return self.input_processor.process_chat_images(text, urls, fetched, mm_kwargs)

    def _add_requests(self, prompts: list[PromptType], params: list[SamplingParams],
                      priorities: list[int]) -> list[str]:
        """Queue every prompt for its final output only; all or none (a bad one takes back those queued)."""
        final = {id(p): msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        ids: list[str] = []
        try:
            for prompt, param, priority in zip(prompts, params, priorities):
                ids.append(str(next(self._ids)))
                self.llm_engine.add_request(ids[-1], prompt, final[id(param)], priority=priority)
        except BaseException:
            self.llm_engine.abort_request(ids)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        generated = 0
        self.last_stats = []
        while self.llm_engine.has_unfinished_requests():
            for out in self.llm_engine.step():
                finished[out.request_id] = out
                generated += sum(len(c.token_ids) for c in out.outputs)
                bar.update(1)
            if self.llm_engine.step_stats is not None:
                self.last_stats.append(self.llm_engine.step_stats)
            if use_tqdm:
                bar.set_postfix_str(f"output {generated / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s",
                                    refresh=False)
        bar.close()
        return finished

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: each prompt's ``params.beam_width`` best beams, best first (see
        ``pagellm/beam_search.py``). Every step runs all live beams of all prompts as one batch."""
        searches = [BeamSearch(ids, params, self.tokenizer.eos_token_ids, self.input_processor.max_model_len)
                    for ids in map(self.input_processor.tokenize, _as_prompt_list(prompts))]
        step = params.step_params()
        while live := [s for s in searches if not s.done]:
            outputs = iter(self.generate([b.tokens for s in live for b in s.live], step, use_tqdm=False,
                                         lora_request=lora_request))
            for search in live:
                search.advance([{t: lp.logprob for t, lp in next(outputs).outputs[0].logprobs[0].items()}
                                for _ in search.live])
        return [s.result(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)) for s in searches]

    def embed(self, prompts: PromptType | Sequence[PromptType], normalize: bool = True, use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              tokenization_kwargs: dict[str, Any] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), in input order: the final hidden state of its last token,
        L2-normalised with ``normalize`` (under ``lora_request``'s adapter, as in ``generate``). Each prompt runs as
        a one-token greedy request through the same scheduler, prefix cache and batches as generation."""
        if self.engine.runtime.labels:
            raise ValueError(CLASSIFY_ONLY)
        outputs = self.generate(prompts, SamplingParams.for_pooling(), use_tqdm,  # type: ignore[arg-type]
                                lora_request=lora_request, tokenization_kwargs=tokenization_kwargs)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids,
                                       EmbeddingOutput(pooled_embedding(o.pooled, normalize)), o.num_cached_tokens)
                for o in outputs]

    def classify(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify`` for a sequence classifier (a ``*ForSequenceClassification`` checkpoint): each
        prompt's class probabilities from its last token's state through the model's score head (softmax; a sigmoid
        with one class), in input order; the class names are ``self.labels``."""
        if not self.engine.runtime.labels:
            raise ValueError("this model has no classification head: LLM.classify needs a *ForSequenceClassification "
                             "checkpoint (Llama, Mistral, Qwen2, Qwen3, BERT, RoBERTa, XLM-RoBERTa, ModernBERT)")
        outputs = self.generate(prompts, SamplingParams.for_pooling(), use_tqdm,  # type: ignore[arg-type]
                                lora_request=lora_request, tokenization_kwargs=tokenization_kwargs)
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids,
                                            ClassificationOutput(class_probs(o.pooled)), o.num_cached_tokens)
                for o in outputs]

    @property
    def labels(self) -> tuple[str, ...]:
        """A classifier's class names, in the order of ``classify``'s probabilities (none for other models)."""
        return self.engine.runtime.labels

    def sleep(self, level: int = 1) -> None:
        """vLLM's ``LLM.sleep`` (``enable_sleep_mode``): the KV cache's memory goes back to the OS and the prefix cache
        forgets every block; requests are refused until ``wake_up``. Level 2 drops the weights too: ``wake_up`` loads
        the checkpoint last loaded again, unless ``update_weights_from_disk`` loaded another meanwhile."""
        check_sleep_level(level)
        self.engine.sleep(level)

    def update_weights_from_disk(self, model: str | None = None) -> None:
        """Serve the weights of ``model`` (a checkpoint of the served model's architecture and shapes; None: the
        served model's own, read again) from now on, e.g. the policy an RL step just wrote; the prefix cache starts
        empty (SGLang's ``update_weights_from_disk``)."""
        self.engine.update_weights(model)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """The engine takes requests again; its KV cache's memory comes back as blocks are used. vLLM's ``tags``:
        ``["weights"]`` only loads the weights a level-2 sleep dropped and leaves the engine asleep; ``["kv_cache"]``
        or none wakes it."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def score(self, text_1: Texts, text_2: Texts, use_tqdm: bool = True,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: each pair of ``text_1`` with ``text_2`` (one and one, one and N, or N and N index by
        index) scored by the cosine similarity of the two embeddings, each distinct text embedded once; with a
        cross-encoder (a classifier of one class), by the sigmoid of its class logit over the pair joined by the
        tokenizer's pair template."""
        pairs = pair_texts(text_1, text_2)
        if len(self.engine.runtime.labels) == 1:
            joined = [self.tokenizer.encode_pair(a, b) for a, b in pairs]
            return [ScoringRequestOutput(i, a, b, ScoringOutput(out.outputs.probs[0])) for i, ((a, b), out)
                    in enumerate(zip(pairs, self.classify(joined, use_tqdm, lora_request)))]
        texts, positions = distinct(pairs)
        vectors = [e.embedding for e in self.embed(texts, use_tqdm=use_tqdm, lora_request=lora_request)]
        return [ScoringRequestOutput(i, a, b, ScoringOutput(cosine(vectors[x], vectors[y])))
                for i, ((a, b), (x, y)) in enumerate(zip(pairs, positions))]

    def shutdown(self) -> None:
        """Stop the engine now (tensor-parallel worker processes included) rather than at interpreter exit."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's ``LLM.collective_rpc``: run ``method`` on every worker (each tensor- and pipeline-parallel rank)
        and return their results in rank order. ``method`` is a worker method's name (``worker_extension_cls`` adds
        methods of your own) or a function called as ``method(worker, *args, **kwargs)``; what crosses to other
        ranks must pickle (a module-level function). A failure on any rank raises, naming it, once every rank has
        answered. Between steps only: no request runs meanwhile."""
        return self.engine.collective_rpc(method, args, kwargs, timeout)

    def get_metrics(self) -> list[Metric]:
        """vLLM's ``LLM.get_metrics()``: the engine's Prometheus series so far (those ``pagellm serve`` exposes on
        ``/metrics``) as ``Counter``, ``Gauge``, ``Histogram`` and ``Vector`` items (``pagellm.metrics.reader``).
        Needs ``LLM(..., disable_log_stats=False)``."""
        return self.llm_engine.get_metrics()

    def get_tokenizer(self) -> Any:
        """vLLM's ``LLM.get_tokenizer``: the model's Hugging Face tokenizer (ValueError with
        ``skip_tokenizer_init``)."""
        return self.tokenizer.hf

    def start_profile(self) -> bool:
        """Start recording a torch profile of the engine (needs ``profiler_dir``: the worker's ValueError says so);
        False when one records already."""
        return self.engine.start_profile()

    def stop_profile(self) -> list[str]:
        """Stop it and write its Chrome trace and op summary into ``profiler_dir``; returns their paths."""
        return self.engine.stop_profile()

    @contextlib.contextmanager
    def profile(self) -> Iterator[list[str]]:
        """``with llm.profile() as files: llm.generate(...)``: the block inside one profile (a ValueError when one
        records already); ``files`` holds the trace and summary paths once the block is left, however it is left."""
        if not self.start_profile():
            raise ValueError("a profile is recording already: stop_profile() ends it")
        files: list[str] = []
        try:
            yield files
        finally:
            files.extend(self.stop_profile())


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict, PromptEmbeds)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


def _tokenization(kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``tokenization_kwargs`` as the ``SamplingParams`` fields they set (ValueError naming any other key)."""
    unknown = sorted(set(kwargs) - {"truncate_prompt_tokens", "truncation_side"})
    if unknown:
        raise ValueError(f"tokenization_kwargs: unknown keys {unknown}; this engine takes truncate_prompt_tokens and "
                         "truncation_side")
    return dict(kwargs)


def _per_prompt(value: Any, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts; pass one, or one per prompt")
        return list(value)
    return [value] * count

