"""EngineCore: the scheduler, the KV memory and the executor, stepped as one loop.

``step()`` = ``schedule()`` → ``execute_model()`` → ``update_from_output()``; it returns the step's token-id deltas
(one ``StepOutput``) and a plain stats object. The core knows nothing of text; requests arrive tokenized and
validated against the limits only the core knows (context length, vocabulary).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from typing import Any

import numpy as np

from pagellm import envs, native_build
from pagellm.config import CacheConfig, EngineConfig, SchedulerConfig
from pagellm.engine.exceptions import ASLEEP, SLEEP_MODE_OFF, EngineSleepingError, check_sleep_level, wake_tags
from pagellm.engine.input_processor import check_prompt
from pagellm.engine.wire import EngineCoreRequest, StepOutput
from pagellm.executor.base import Executor, make_executor
from pagellm.kv.events import KVEventRecorder
from pagellm.metrics.profiler import span
from pagellm.metrics.stats import SchedulerStats
from pagellm.multimodal import MultiModalInputs
from pagellm.request import ImageSpan, Request, image_spans
from pagellm.sched.native import build_extension
from pagellm.sched.scheduler import Scheduler
from pagellm.sched.whole_images import check_runs, image_runs

logger = logging.getLogger(__name__)


def _whole_prompts(sched_config: SchedulerConfig, cache_config: CacheConfig,
                   max_model_len: int) -> tuple[SchedulerConfig, CacheConfig]:
    """An encoder-only model's settings: chunked prefill and prefix caching off (a token's state depends on its
    whole prompt), and a step budget that holds the longest prompt."""
    budget = sched_config.max_num_batched_tokens
    if budget is not None and budget < max_model_len:
        raise ValueError(f"an encoder-only model computes each prompt in one step: max_num_batched_tokens ({budget}) "
                         f"must be >= max_model_len ({max_model_len}); raise it, or lower max_model_len")
    return (dataclasses.replace(sched_config, enable_chunked_prefill=False, long_prefill_token_threshold=0),
            dataclasses.replace(cache_config, enable_prefix_caching=False))


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        if envs.native_scheduler():  # a cold start compiles the scheduler's extension while the model loads
            native_build.start_in_background([build_extension])
        self.executor = executor or make_executor(config)
        self.runtime = self.executor.runtime
        spec, events = config.speculative_config, config.kv_events_config
        self.kv_events = KVEventRecorder(config.cache_config.block_size, self.runtime.kv_window) \
            if events.enable_kv_cache_events else None
        sched_config, cache_config = config.scheduler_config, config.cache_config
        if self.runtime.bidirectional_images:  # an image computed in two steps would miss its later tokens
            sched_config = dataclasses.replace(sched_config, disable_chunked_mm_input=True)
        if self.runtime.encoder_only:  # each token's state depends on its whole prompt: one step, nothing shared
            sched_config, cache_config = _whole_prompts(sched_config, cache_config, self.runtime.max_model_len)
        self.scheduler = Scheduler(sched_config, cache_config, self.runtime.num_blocks,
                                   self.runtime.max_model_len, spec.num_lookahead_tokens, spec.disable_by_batch_size,
                                   kv_window=self.runtime.kv_window, kv_events=self.kv_events)
        self.asleep = False  # sleep mode: the KV cache's memory is the OS's, requests are refused
        self.paused = False  # AsyncLLM.pause_generation(mode="keep"): no step runs; requests wait where they are
        # vLLM's --enable-logging-iteration-details: a log line per step (its requests and tokens by phase, its time)
        self._log_iterations, self._iteration = config.scheduler_config.enable_logging_iteration_details, 0
        self.kv_publisher = None
        if events.publishes:
            from pagellm.engine.kv_events import KVEventPublisher

            self.kv_publisher = KVEventPublisher(events)
        if config.kv_transfer_config.loads:  # a consumer: admission takes stored prompt blocks as hits
            from pagellm.disagg.connector import StoredBlocks

            self.scheduler.stored = StoredBlocks(self.runtime.kv_store_dir)

    def add_request(self, req: EngineCoreRequest) -> None:
        if self.asleep:
            raise EngineSleepingError(ASLEEP)
        check_prompt(req.prompt_token_ids, self.runtime.max_model_len, self.runtime.vocab_size)
        params = req.sampling_params
        room = self.runtime.max_model_len - len(req.prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        embeds = req.prompt_embeds
        if embeds is not None and (embeds.num_tokens != len(req.prompt_token_ids) or not req.cache_salt
                                   or embeds.hidden_size != self.runtime.hidden_size):
            raise ValueError("prompt_embeds must have one row of the model's hidden size per prompt position, and a "
                             "cache salt (the frontend's InputProcessor makes both)")
        self.scheduler.add_request(Request(
            req.request_id, req.prompt_token_ids, params, frozenset(req.eos_token_ids), req.arrival_time,
            req.priority, req.cache_salt, max_tokens, embeds, *self._check_images(req), self._image_runs(req)))

    def _check_images(self, req: EngineCoreRequest) -> tuple[MultiModalInputs | None, list[ImageSpan] | None]:
        """A request's images, where this model takes them and its prompt has image tokens for them, and the spans
        of their tokens' positions (``image_spans``); image tokens without images are refused too (their rows would
        be the tokens' own embeddings)."""
        image_token = self.runtime.image_token_id
        ids = req.prompt_token_ids
        has_tokens = image_token is not None and image_token in ids
        if req.mm_inputs is None and not has_tokens:
            return None, None
        if image_token is None:
            raise ValueError("this model takes no images; serve a vision-language model (SmolVLM, LLaVA, Gemma 3), "
                             "without --language-model-only, for them")
        if req.mm_inputs is None or not has_tokens or not req.cache_salt:
            raise ValueError("a prompt's image tokens and its images come together, with a cache salt: give the "
                             "prompt as text with one image placeholder per image and the images as "
                             "multi_modal_data (the frontend's InputProcessor expands and salts them)")
        embeds = req.mm_inputs.tensors.get("image_embeds")
        width = self.runtime.image_row_width or self.runtime.hidden_size
        if embeds is not None and (len(embeds.shape) != 2 or embeds.shape[1] != width):
            raise ValueError(f"image embeddings must be [rows, {width}] (the model's image rows); "
                             f"got {embeds.shape}")
        return req.mm_inputs, image_spans(ids, image_token, req.mm_inputs)

    def _image_runs(self, req: EngineCoreRequest) -> np.ndarray | None:
        """The prompt's runs of image tokens, where no step may end inside one (``disable_chunked_mm_input``);
        refused where one is longer than a step."""
        scheduler = self.scheduler
        if not scheduler.whole_images or req.mm_inputs is None or self.runtime.image_token_id is None:
            return None
        runs = image_runs(req.prompt_token_ids, self.runtime.image_token_id)
        if runs is not None:
            check_runs(runs, min(scheduler.budget, scheduler.chunk_cap or scheduler.budget))
        return runs

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> tuple[StepOutput, SchedulerStats]:
        if not self.scheduler.has_unfinished_requests():
            return StepOutput(), self.scheduler.make_stats()
        start = time.perf_counter()
        with span("schedule"):
            sched_out = self.scheduler.schedule()
        details = self._iteration_details(sched_out) if self._log_iterations else None
        runner_out = self.executor.execute_model(sched_out)
        with span("update_from_output"):
            outputs = self.scheduler.update_from_output(sched_out, runner_out)
        if self.kv_events is not None:
            self._publish_kv_events()
        stats = self.scheduler.make_stats()
        if details is not None:
            self._log_iteration(details, time.perf_counter() - start, stats.kv_cache_usage)
        return outputs, stats

    def _iteration_details(self, sched_out: Any) -> tuple[int, int, int, int]:
        """vLLM's iteration details of a scheduled step: (context requests, their tokens, generation requests,
        their tokens); a request with no output token yet is in its context phase (a prompt chunk)."""
        requests, counts = self.scheduler.requests, [0, 0, 0, 0]
        for req_id, num_tokens in zip(sched_out.req_ids, sched_out.num_scheduled_tokens):
            request = requests.get(req_id)
            generating = request is not None and request.num_output_tokens > 0
            counts[2 * generating] += 1
            counts[2 * generating + 1] += num_tokens
        return counts[0], counts[1], counts[2], counts[3]

    def _log_iteration(self, details: tuple[int, int, int, int], elapsed_s: float, kv_usage: float) -> None:
        logger.info("Iteration(%d): %d context requests, %d context tokens, %d generation requests, %d generation "
                    "tokens, iteration elapsed time: %.2f ms, KV cache usage: %.1f%%", self._iteration, *details,
                    elapsed_s * 1000, kv_usage * 100)
        self._iteration += 1

    def _publish_kv_events(self) -> None:
        batch = self.kv_events.take(self.config.kv_events_config.data_parallel_rank)
        if batch is not None and self.kv_publisher is not None:
            self.kv_publisher.publish(batch)

    def set_idle(self, idle: bool) -> None:
        """The core process says when it waits for inputs with no request unfinished: the workers' idle-time work
        (populating the KV cache's memory, worker/kv_prefault.py) runs in the background only then."""
        self.executor.set_idle(idle)

    def pause(self) -> bool:
        """Freeze: the core loop runs no step, so every request stays where it is (KV blocks, tokens so far) until
        ``resume`` (``engine/pause.py``'s ``keep`` mode)."""
        self.paused = True
        return True

    def resume(self) -> bool:
        self.paused = False
        return True

    def sleep(self, level: int = 1) -> bool:
        """Sleep mode (``enable_sleep_mode``): the workers give their KV caches' memory back to the OS (at ``level`` 2
        their weights too, loaded again on ``wake_up``), the prefix cache forgets every block (their contents go),
        and requests are refused until ``wake_up``. Only an idle engine sleeps."""
        check_sleep_level(level)
        if not self.config.cache_config.enable_sleep_mode:
            raise ValueError(SLEEP_MODE_OFF)
        if level == 2 and self.config.speculative_config.method is not None:
            raise ValueError("sleep level 2 runs without speculative decoding (the proposer holds the weights); "
                             "use level 1")
        if self.scheduler.has_unfinished_requests():
            raise ValueError(f"only an idle engine sleeps: {self.scheduler.num_unfinished_requests} requests are "
                             "unfinished (let them finish, or abort them)")
        if not self.reset_prefix_cache():  # no block may keep a hash once its contents are gone
            raise RuntimeError("the prefix cache could not be reset: KV blocks are still held")
        self.executor.set_asleep(True, level)
        self.asleep = True
        return True

    def update_weights(self, model: str | None = None) -> bool:
        """Serve ``model``'s weights (a checkpoint of the same architecture and shapes; None: the served model's
        own, read again) from now on, as SGLang's ``update_weights_from_disk`` does: only an idle engine updates, and
        the prefix cache forgets every block, which the old weights computed."""
        if self.scheduler.has_unfinished_requests():
            raise ValueError(f"only an idle engine updates its weights: {self.scheduler.num_unfinished_requests} "
                             "requests are unfinished (let them finish, or abort them)")
        self.executor.update_weights(model)
        if not self.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset: KV blocks are still held")
        return True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake what ``tags`` names (``exceptions.wake_tags``): "weights" alone loads those a level-2 sleep dropped
        (the checkpoint last loaded) and leaves the engine asleep, as at level 1; "kv_cache" wakes the engine, its
        weights loaded first if still dropped (the workers know: ``Worker.set_asleep``)."""
        if "kv_cache" not in wake_tags(tags):
            if self.asleep:
                self.executor.set_asleep(True, 1)
            return True
        self.executor.set_asleep(False)
        self.asleep = False
        return True

    def collective_rpc_pickled(self, payload: bytes, timeout: float | None = None) -> bytes:
        """``AsyncLLM.collective_rpc`` in the core's process: the pickled ``(method, args, kwargs)`` in, the pickled
        list of the ranks' results out (the frontend trusts its own core, and the core its frontend)."""
        method, args, kwargs = pickle.loads(payload)
        return pickle.dumps(self.executor.collective_rpc(method, args, kwargs, timeout))

    def is_sleeping(self) -> bool:
        return self.asleep

    def reset_prefix_cache(self) -> bool:
        done = self.scheduler.kv.reset_prefix_cache()
        if self.kv_events is not None:  # AllBlocksCleared goes out now, not with the next step's events
            self._publish_kv_events()
        return done

    def start_profile(self) -> bool:
        """Start the workers' torch profiler (``profiler_dir``); False when a session records already."""
        return self.executor.start_profile()

    def stop_profile(self) -> list[str]:
        """Stop it; the files written (none when nothing was recording)."""
        return self.executor.stop_profile()

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
