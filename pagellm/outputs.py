"""What users get back: ``RequestOutput`` with one ``CompletionOutput`` per sample, and per-request timing."""

from __future__ import annotations

import math
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
    """Wall-clock times (``time.time()``) of the request's life, and its speculative decoding so far."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: draft tokens verified for it, and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    queued_time: float | None = None      # the engine core's: into its waiting queue (known with the first token)
    scheduled_time: float | None = None   # the engine core's: first admitted into the running batch
    last_token_time: float | None = None
    # Per verify step: ``spec_histogram[j]`` steps accepted j drafts; ``spec_steps`` each step's (drafted, accepted)
    spec_histogram: list[int] = field(default_factory=list)
    spec_steps: list[tuple[int, int]] = field(default_factory=list)

    def observe_spec(self, drafted: int, accepted: int) -> None:
        """One verify step of this request: ``drafted`` draft tokens, ``accepted`` of them accepted."""
        self.num_draft_tokens += drafted
        self.num_accepted_draft_tokens += accepted
        if len(self.spec_histogram) <= accepted:
            self.spec_histogram.extend([0] * (accepted + 1 - len(self.spec_histogram)))
        self.spec_histogram[accepted] += 1
        self.spec_steps.append((drafted, accepted))

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
    # Pooling (embedding) requests: the final hidden state of the prompt's last token, float32, unnormalised.
    pooled: list[float] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s result for one prompt (vLLM's shape: ``output.outputs.embedding``; ``output.embedding`` is the
    same list): the final hidden state of the prompt's last token (the last-token pooling of decoder embedding models
    such as Qwen3-Embedding or e5-mistral), L2-normalised unless asked not to be."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    num_cached_tokens: int = 0
    finished: bool = True

    @property
    def embedding(self) -> list[float]:
        return self.outputs.embedding


@dataclass
class ScoringOutput:
    score: float  # the cosine similarity of the pair's two embeddings (a cross-encoder's: its probability)


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s result for one pair (vLLM's shape: ``output.outputs.score``)."""

    index: int
    text_1: str
    text_2: str
    outputs: ScoringOutput


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per class, in class order: softmax of the class logits (sigmoid with one class)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """``LLM.classify``'s result for one prompt (vLLM's shape: ``output.outputs.probs``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    num_cached_tokens: int = 0


def class_probs(logits: list[float] | None) -> list[float]:
    """A classifier's class probabilities from its logits: softmax, or a sigmoid for a one-class (score) head, as
    vLLM's classify does."""
    if logits is None:
        raise RuntimeError("the engine returned no class logits for a classify request")
    if len(logits) == 1:
        return [1.0 / (1.0 + math.exp(-logits[0]))]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def pooled_embedding(pooled: list[float] | None, normalize: bool = True) -> list[float]:
    """A pooling request's hidden state as an embedding (L2-normalised with ``normalize``)."""
    if pooled is None:
        raise RuntimeError("the engine returned no hidden state for a pooling request")
    if not normalize:
        return pooled
    norm = math.sqrt(sum(x * x for x in pooled)) or 1.0
    return [x / norm for x in pooled]
