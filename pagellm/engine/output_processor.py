"""Frontend output side: token-id deltas from the core (one ``StepOutput`` per step) become ``RequestOutput``s.

Per request it keeps the incremental detokenizer (stop strings, held-back partial matches) and the timing. A stop
string can only be seen here, so when one matches the request is reported finished and its id is returned for the
caller to abort in the core. For requests that asked for logprobs it turns the core's per-token ``TokenLogprobs``
into one ``{token_id: Logprob}`` dict per generated token (the top-k in rank order, then the sampled token when
it is not among them) and keeps the running ``cumulative_logprob``; token texts are decoded one id at a time
(special tokens kept) and cached per processor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.engine.wire import EngineCoreRequest, StepOutput
from pagellm.metrics.stats import IterationStats, RequestStats
from pagellm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagellm.sched.output import FirstOutput, TokenLogprobs
from pagellm.repetition import STOP_REASON as REPEATED
from pagellm.repetition import RepetitionDetectionParams, repeats_at
from pagellm.request import FinishReason
from pagellm.tokenizer import Tokenizer


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int]
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens_sent: int = 0  # delta mode: token ids already returned
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per token in token_ids; None = not asked
    cumulative_logprob: float | None = None
    stats: RequestStats | None = None  # timings and counts for metrics and traces
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [None] + one per scored prompt token
    prompt_logprobs_sent: bool = False
    pooled: list[float] | None = None  # a pooling request's hidden state, once the core sent it
    repetition: RepetitionDetectionParams | None = None  # set: the output is checked for repeats
    min_tokens: int = 0

    def make_output(self, delta: bool) -> RequestOutput:
        """The request's output so far; with ``delta``, only the text, token ids and logprobs not returned
        before (``cumulative_logprob`` is always the running total)."""
        finished = self.finish_reason is not None
        text = self.detokenizer.get_next_output_text(finished, delta)
        start = self.num_tokens_sent if delta else 0
        token_ids = self.token_ids[start:]
        logprobs = None if self.logprobs is None else self.logprobs[start:]
        if delta:
            self.num_tokens_sent = len(self.token_ids)
        completion = CompletionOutput(0, text, token_ids, self.finish_reason, self.stop_reason, logprobs,
                                      self.cumulative_logprob)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion], finished,
                             self.metrics, self.num_cached_tokens, prompt_logprobs=self._take_prompt_logprobs(delta),
                             pooled=self.pooled)

    def _take_prompt_logprobs(self, delta: bool) -> list[dict[int, Logprob] | None] | None:
        """The whole prompt's logprobs once every token is scored (in delta mode only the first time)."""
        lps = self.prompt_logprobs
        if lps is None or len(lps) < len(self.prompt_token_ids) or (delta and self.prompt_logprobs_sent):
            return None
        self.prompt_logprobs_sent = True
        return lps


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._token_texts: dict[int, str] = {}  # token id → its own text, for logprobs

    def add_request(self, req: EngineCoreRequest, prompt: str | None) -> None:
        prompt_ids = req.prompt_token_ids if req.prompt_embeds is None else []  # embeddings: no prompt tokens
        detok = IncrementalDetokenizer(self.tokenizer.backend, prompt_ids, req.sampling_params)
        state = RequestState(req.request_id, prompt, prompt_ids, detok, RequestMetrics(req.arrival_time), [],
                             stats=RequestStats(req.arrival_time, len(req.prompt_token_ids), req.sampling_params))
        if req.sampling_params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        if req.sampling_params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        repetition = req.sampling_params.repetition_detection
        if repetition is not None and repetition.active:
            state.repetition, state.min_tokens = repetition, req.sampling_params.min_tokens
        self.requests[req.request_id] = state

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, step: StepOutput, delta: bool = False,
                        iteration: IterationStats | None = None) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's deltas; returns the updated outputs and the ids to abort in the core (stop strings).
        ``iteration`` (when given) receives the step's token counts, timings and finished requests."""
        now = time.time()
        iteration = iteration if iteration is not None else IterationStats()
        iteration.time = now
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        flat, start = step.new_token_ids, 0
        for request_id, count in zip(step.req_ids, step.num_new_tokens):
            new_token_ids = flat[start:start + count]
            start += count
            state = self.requests.get(request_id)
            if state is None:
                continue
            finish_reason = step.finish_reasons.get(request_id)
            repeated = state.repetition is not None and _repeated(state, new_token_ids, finish_reason is not None)
            if repeated:  # the output ends with the token that made it repeat
                new_token_ids = new_token_ids[:repeated]
            first = step.first.get(request_id)
            _note_times(state, first, bool(new_token_ids), now)
            if state.logprobs is not None:
                self._add_logprobs(state, new_token_ids, step.logprobs.get(request_id))
            assert state.stats is not None
            iteration.observe_tokens(state.stats, count, first.times if first is not None else None, now)
            if request_id in step.pooled:
                state.pooled = np.frombuffer(step.pooled[request_id], dtype=np.float32).tolist()
            prompt_logprobs = step.prompt_logprobs.get(request_id)
            if state.prompt_logprobs is not None and prompt_logprobs is not None:
                self._add_prompt_logprobs(state, prompt_logprobs)
            if request_id in step.spec_counts:
                state.metrics.observe_spec(*step.spec_counts[request_id])
            if self._apply(state, new_token_ids, finish_reason, step.stop_reasons.get(request_id), bool(repeated)):
                to_abort.append(request_id)
            if state.finish_reason is not None:
                state.metrics.finished_time = now
                iteration.observe_finished(request_id, state.finish_reason, state.stats, now)
                del self.requests[request_id]
            results.append(state.make_output(delta))
        return results, to_abort

    def _add_logprobs(self, state: RequestState, token_ids: list[int], new: TokenLogprobs | None) -> None:
        """Append one dict per new token (``new`` has one entry per token) and grow the cumulative sum."""
        if new is None or not token_ids:
            return
        assert state.logprobs is not None and state.cumulative_logprob is not None
        state.logprobs.extend(self._entries(token_ids, new))
        state.cumulative_logprob += sum(new.sampled_logprobs[:len(token_ids)])

    def _add_prompt_logprobs(self, state: RequestState, new: TokenLogprobs) -> None:
        """Write the entries of prompt tokens ``new.start ...`` (overwriting any from before a preemption)."""
        assert state.prompt_logprobs is not None
        targets = state.prompt_token_ids[new.start:new.start + len(new)]
        del state.prompt_logprobs[max(new.start, 1):]
        state.prompt_logprobs.extend(self._entries(targets, new))

    def _entries(self, token_ids: list[int], new: TokenLogprobs) -> list[dict[int, Logprob]]:
        """One ``{token_id: Logprob}`` per token: the top-k in rank order, then the token itself if not among them;
        with ``logprob_token_ids`` (``top_ranks`` set) the token itself first, then those asked in their order, as
        vLLM's entries are."""
        text = self._token_text
        entries = []
        for i, token in enumerate(token_ids):
            listed = new.top_ranks is not None
            ranks = new.top_ranks[i] if listed else range(1, len(new.top_ids[i]) + 1)  # type: ignore[index]
            entry = {token: Logprob(new.sampled_logprobs[i], new.sampled_ranks[i], text(token))} if listed else {}
            entry.update({tid: Logprob(value, rank, text(tid)) for rank, tid, value
                          in zip(ranks, new.top_ids[i], new.top_logprobs[i]) if tid not in entry})
            if token not in entry:
                entry[token] = Logprob(new.sampled_logprobs[i], new.sampled_ranks[i], text(token))
            entries.append(entry)
        return entries

    def _token_text(self, token_id: int) -> str:
        """One token decoded on its own, special tokens kept (a lone partial UTF-8 byte decodes to U+FFFD)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.backend.decode([token_id],
                                                                               skip_special_tokens=False)
        return text

    @staticmethod
    def _apply(state: RequestState, new_token_ids: list[int], finish_reason: FinishReason | None,
               stop_reason: int | None, repeated: bool = False) -> bool:
        """Add the new tokens; True when a stop string or a repeat ended a request the core still runs (with
        ``repeated`` the tokens end with the one that made the output repeat)."""
        state.token_ids.extend(new_token_ids)
        stop = state.detokenizer.update(new_token_ids, finish_reason == FinishReason.STOP)
        if stop is not None:
            state.finish_reason, state.stop_reason = str(FinishReason.STOP), stop
            return finish_reason is None
        if repeated:
            state.finish_reason, state.stop_reason = str(FinishReason.REPETITION), REPEATED
            return finish_reason is None
        if finish_reason is not None:
            state.finish_reason, state.stop_reason = str(finish_reason), stop_reason
        return False


def _note_times(state: RequestState, first: FirstOutput | None, got_tokens: bool, now: float) -> None:
    """The request's times in its metrics: the core's queue and schedule times with its first output, and the
    frontend's first and last token times."""
    metrics = state.metrics
    if first is not None:
        state.num_cached_tokens = first.num_cached_tokens
        metrics.queued_time, metrics.scheduled_time = first.times.queued, first.times.scheduled
    if got_tokens:
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now


def _repeated(state: RequestState, new_token_ids: list[int], core_finished: bool) -> int:
    """How many of the new tokens the output keeps when one of them made it repeat (0: none did). On the step's
    last token the core's own end (EOS, a stop token, the length) comes first, as in vLLM. Only the output's last
    ``max_pattern_size * min_count`` tokens can take part in a repeat, so only those are copied beside the new."""
    params, done = state.repetition, len(state.token_ids)
    assert params is not None
    kept = state.token_ids[max(0, done - params.max_pattern_size * params.min_count):]
    tail = kept + new_token_ids  # the output from ``done - len(kept)`` on
    index = repeats_at(tail, max(done, state.min_tokens - 1) - (done - len(kept)), params)
    if index is None or (core_finished and index == len(tail) - 1):
        return 0
    return index + 1 - len(kept)
