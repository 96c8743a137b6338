"""What users get back: ``RequestOutput`` with one ``CompletionOutput`` per sample, and per-request timing."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability under the model's raw logits at one output position."""

    logprob: float
    rank: int            # 1 = most likely; 1 + the number of tokens with a strictly greater logprob
    decoded_token: str   # the token's own text (special tokens included)


@dataclass
class CompletionOutput:
    """One sample. ``logprobs`` (only when ``SamplingParams.logprobs`` is set) has one dict per token in
    ``token_ids``: the top-``logprobs`` tokens in rank order, then the sampled token when it is not among them.
    ``cumulative_logprob`` is the sum of the sampled tokens' logprobs over the whole output so far (also in
    delta mode)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None   # "stop", "length" or "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()``) of the request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """``prompt_logprobs`` (only when ``SamplingParams.prompt_logprobs`` is set) has one entry per prompt token:
    None for the first (nothing predicts it), then ``{token_id: Logprob}`` with the top-k alternatives in rank
    order and the prompt's own token; it is complete on the first output that carries it (in delta mode only
    that one does)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
