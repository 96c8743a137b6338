"""How one request wants its tokens chosen and its text returned.

Contract:
- ``SamplingParams`` is a ``msgspec.Struct`` so it crosses the frontend → engine-core boundary as msgpack with no
  pickling; ``__post_init__`` runs both on construction and on decode, so a decoded value is always validated and
  normalised.
- Names and defaults follow vLLM's so OpenAI-style requests map onto it field for field.
- Normalisation: ``top_k=-1`` becomes ``0`` (both mean "off"); ``stop`` and ``stop_token_ids`` become lists
  (possibly empty); numeric fields are coerced to ``float``/``int``.
- Bad values raise ``ValueError`` naming the field, the value and the valid range, so the server can map it to
  HTTP 400 verbatim.
- ``logprobs`` and ``prompt_logprobs`` are ``None`` (off) or an integer >= 0; the engine caps them at its
  ``max_logprobs`` (``check_logprobs``, by default ``MAX_LOGPROBS``).
- ``max_tokens=None`` means "up to the model's context length"; the engine resolves it (it knows
  ``max_model_len``), this module does not.
- Penalties follow transformers (``repetition_penalty``, over prompt + output tokens) and OpenAI
  (``presence_penalty``/``frequency_penalty``, over output tokens); ``logit_bias`` maps token ids to a bias in
  [-100, 100]; ``bad_words`` are strings the frontend tokenizes into ``bad_words_token_ids``;
  ``allowed_token_ids`` restricts every step to those ids. Token ids are checked against the vocabulary by the
  frontend (``check_token_ids``), which knows it.
- ``best_of`` (default ``n``) samples that many candidates and returns the ``n`` with the highest cumulative
  logprob; ``structured_outputs`` constrains the output to a JSON schema, a regex, a choice or an EBNF grammar
  (exactly one of them; see ``sample/structured.py``).
"""

from __future__ import annotations

import copy
import enum
import math
from typing import Any, ClassVar

import msgspec

from pagellm.lora import LoRARequest
from pagellm.repetition import RepetitionDetectionParams
from pagellm.structured_outputs import StructuredOutputsParams
from pagellm.thinking import ThinkingMarkers

# Below this temperature a request is treated as greedy: dividing logits by ~0 only amplifies float noise, and
# the argmax is what the user means.
_GREEDY_EPS = 1e-5
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
# The most top alternatives a request may ask for per token by default (OpenAI's limit; ``max_logprobs``).
MAX_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 128  # the most tokens ``logprob_token_ids`` may name (vLLM's limit)


class SamplingType(enum.IntEnum):
    """How the sampler treats a row; seeded rows need their own generator."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.IntEnum):
    """What ``AsyncLLM.generate`` yields and ``LLMEngine.step`` returns (vLLM's ``output_kind``): every output so far
    (``CUMULATIVE``, the default, as vLLM's), what is new since the last one (``DELTA``, which the servers stream), or
    the whole output once (``FINAL_ONLY``). ``LLM.generate`` returns whole outputs whatever the kind."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Per-request sampling and output options (see the module docstring for the contract)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    # vLLM's: keep the prompt's last k tokens (-1: max_model_len); None keeps it whole
    truncate_prompt_tokens: int | None = None
    # vLLM's: which end truncate_prompt_tokens cuts: "left" (the default) keeps the last k tokens, "right" the first k
    truncation_side: str | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what AsyncLLM.generate yields (RequestOutputKind)
    # vLLM's: AsyncLLM.generate yields after every this many new tokens (the first and the last at once); raised to
    # the engine's --stream-interval when below it. None: the engine's.
    stream_interval: int | None = None
    # None is accepted and normalised to []; the list default lets omit_defaults drop empty lists from the wire.
    stop: str | list[str] | None = msgspec.field(default_factory=list)
    stop_token_ids: list[int] | None = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Accepted for API compatibility; `tokenizers` (fast) decoders have no such switch, so it has no effect.
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # Per generated token, return the log-probability (raw logits, before any sampling transform) of the sampled
    # token and of the ``logprobs`` most likely tokens; 0 = only the sampled token's, None = no logprobs at all.
    logprobs: int | None = None
    # Per prompt token (from the second on), its logprob under the model plus the ``prompt_logprobs`` most
    # likely tokens at that position; None = off. Requests that ask skip the prefix cache (every prompt
    # position must be computed).
    prompt_logprobs: int | None = None
    # Logprobs of the processed distribution (after penalties, bans, bias, temperature, top-k/top-p/min-p)
    # instead of the raw one (the same as ``logprobs_mode="processed_logprobs"``).
    processed_logprobs: bool = False
    # What the logprobs carry (vLLM's ``--logprobs-mode``): raw_logprobs (the model's), processed_logprobs (of the
    # distribution sampled from), raw_logits or processed_logits (the logit values themselves: after processing,
    # temperature and filters, dropped tokens -inf); None: the engine's default (raw_logprobs unless set).
    logprobs_mode: str | None = None
    # vLLM's: the logprobs of these tokens (and the sampled one's) at each generated position, in place of the top
    # ``logprobs``; implies logprobs (0 when unset). At most MAX_LOGPROB_TOKEN_IDS ids.
    logprob_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # filled by the frontend from ``bad_words``
    allowed_token_ids: list[int] | None = None
    # Predicted output (OpenAI's ``prediction``): the tokens the reply is expected to repeat; with n-gram speculation
    # they are drafted first (spec/ngram.py), and verification keeps the output exactly what it would be without.
    prediction_token_ids: list[int] | None = None
    best_of: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # An embedding request (``LLM.embed``, ``/v1/embeddings``): the engine also returns the final hidden state of
    # the prompt's last token (``RequestOutput.pooled``); it runs as a one-token greedy request.
    pooling: bool = False
    # The LoRA adapter to run the request with (``LLM.generate(lora_request=...)``; ``pagellm/lora.py``).
    lora_request: LoRARequest | None = None
    # Arguments of the request's own for custom logits processors (vLLM's ``extra_args``; the API's ``vllm_xargs``):
    # JSON values by name, read by ``AdapterLogitsProcessor.new_req_logits_processor`` (``sample/custom.py``).
    extra_args: dict[str, Any] | None = None
    # vLLM's: end the request once its output repeats a pattern (``pagellm/repetition.py``; a dict of its fields works)
    repetition_detection: RepetitionDetectionParams | None = None
    # vLLM's: at most this many tokens inside a thinking block, then its end is forced (``pagellm/thinking.py``;
    # -1 or None: no cap); needs the engine's reasoning tags, which the frontend puts in ``thinking_markers``
    thinking_token_budget: int | None = None
    thinking_markers: ThinkingMarkers | None = None

    GREEDY_EPS: ClassVar[float] = _GREEDY_EPS

    @classmethod
    def from_optional(cls, **fields: Any) -> SamplingParams:
        """vLLM's ``SamplingParams.from_optional``: the fields given, those given as None left at their defaults."""
        return cls(**{name: value for name, value in fields.items() if value is not None})

    def clone(self) -> SamplingParams:
        """vLLM's ``clone``: a deep copy (its lists and structured-output constraints are its own)."""
        return copy.deepcopy(self)

    @classmethod
    def for_pooling(cls, lora_request: LoRARequest | None = None) -> SamplingParams:
        """An embedding request's parameters: one greedy token, the last prompt token's hidden state returned."""
        return cls(max_tokens=1, temperature=0.0, pooling=True, detokenize=False, lora_request=lora_request)

    def __post_init__(self) -> None:
        self._coerce_numbers()
        self._normalise_lists()
        self._validate_sampling()
        self._validate_lengths()
        self._validate_stops()
        self._validate_processing()

    # ---- derived views -------------------------------------------------------------------------------------

    @property
    def values_mode(self) -> str:
        """What this request's logprobs carry (``logprobs_mode``, ``processed_logprobs`` an older name of one)."""
        return self.logprobs_mode or ("processed_logprobs" if self.processed_logprobs else "raw_logprobs")

    @property
    def is_greedy(self) -> bool:
        """True when the request is decoded by argmax (top-k/top-p/min-p and seed are then ignored)."""
        return self.temperature < _GREEDY_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def num_candidates(self) -> int:
        """How many samples run: ``best_of`` when set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def depends_on_history(self) -> bool:
        """True when the processing of a step depends on earlier tokens (penalties, multi-token bad words,
        grammar state, a thinking budget): such requests never receive draft tokens."""
        multi_bad = any(len(ids) > 1 for ids in self.bad_words_token_ids or [])
        return self.has_penalties or multi_bad or self.structured_outputs is not None \
            or self.thinking_token_budget is not None

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError naming the field when a token id is outside ``[0, vocab_size)``."""
        begin_after = self.structured_outputs.begin_after if self.structured_outputs is not None else None
        for name, ids in (("logit_bias", list(self.logit_bias or {})), ("allowed_token_ids",
                          self.allowed_token_ids or []), ("stop_token_ids", self.stop_token_ids or []),
                          ("structured_outputs.begin_after", begin_after or []),
                          ("prediction", self.prediction_token_ids or []),
                          ("logprob_token_ids", self.logprob_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name}: token ids must be in [0, {vocab_size}), got {bad[:5]}.")

    def check_logprobs(self, cap: int) -> None:
        """Raise ValueError when ``logprobs`` or ``prompt_logprobs`` asks for more than ``cap`` per token (the
        engine's ``max_logprobs``)."""
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None and value > cap:
                raise ValueError(f"{name}={value} (chat's top_logprobs, beam search's 2 × beam_width) is more than "
                                 f"this engine's max_logprobs ({cap}); ask for at most {cap}, or raise the cap "
                                 f"(--max-logprobs {value}; -1: the whole vocabulary)")

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (it is always a list after ``__post_init__``; this keeps type checkers happy)."""
        return self.stop if isinstance(self.stop, list) else []

    # ---- validation helpers --------------------------------------------------------------------------------

    def _coerce_numbers(self) -> None:
        # Python callers may pass ints for floats (temperature=0) or numpy scalars; msgspec only type-checks on
        # decode, so coerce here to keep downstream tensor construction uniform.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}.")
            setattr(self, name, float(value))
        for name in ("n", "top_k", "min_tokens", "seed", "max_tokens", "logprobs", "prompt_logprobs", "best_of",
                     "truncate_prompt_tokens", "stream_interval", "thinking_token_budget"):
            value = getattr(self, name)
            if value is None and name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "best_of",
                                          "truncate_prompt_tokens", "stream_interval", "thinking_token_budget"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
        if self.top_k == -1:
            self.top_k = 0
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None

    def _normalise_lists(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if isinstance(self.repetition_detection, dict):
            try:
                self.repetition_detection = RepetitionDetectionParams(**self.repetition_detection)
            except TypeError as exc:
                raise ValueError(f"repetition_detection takes max_pattern_size, min_pattern_size and min_count "
                                 f"({exc})") from None
        if self.logit_bias is not None:
            # OpenAI sends string keys ("50256"); msgspec gives ints after a round trip.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}.") from None
            if not self.logit_bias:
                self.logit_bias = None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(dict.fromkeys(self.logprob_token_ids)) or None  # each once, in order
            if self.logprob_token_ids is not None and self.logprobs is None:
                self.logprobs = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

    def _validate_sampling(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}.")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (both off) or a positive integer, got {self.top_k}.")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be an integer >= 0 (0 = only the sampled token, None = off), "
                             f"got {self.logprobs}.")

    def _validate_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value}.")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), "
                             f"got {self.repetition_penalty}.")
        for token, bias in (self.logit_bias or {}).items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (omit it to allow every token).")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be non-negative integers, got {self.allowed_token_ids}.")
        if self.bad_words is not None and not all(isinstance(w, str) and w for w in self.bad_words):
            raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}.")
        if self.logprob_token_ids is not None:
            if len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS:
                raise ValueError(f"logprob_token_ids names {len(self.logprob_token_ids)} tokens; at most "
                                 f"{MAX_LOGPROB_TOKEN_IDS} may be asked for.")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.logprob_token_ids):
                raise ValueError(f"logprob_token_ids must be non-negative integers, got {self.logprob_token_ids}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be an integer >= 0 (None = off), got {self.prompt_logprobs}.")
        if self.logprobs_mode is not None and self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}.")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}.")
        if self.best_of is not None and self.best_of > 1 and self.is_greedy and self.best_of > self.n:
            raise ValueError("best_of > n needs random sampling (temperature > 0): greedy candidates are "
                             "all the same.")

    def _validate_lengths(self) -> None:
        if self.pooling and (self.max_tokens != 1 or self.n != 1 or self.best_of not in (None, 1)):
            raise ValueError("a pooling (embedding) request runs as one greedy token: max_tokens=1, n=1, no best_of.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (or None for up to the context length), "
                             f"got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}.")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens == -1
                                                            or self.truncate_prompt_tokens >= 1):
            raise ValueError(f"truncate_prompt_tokens must be -1 (max_model_len) or >= 1, got "
                             f"{self.truncate_prompt_tokens}.")
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            raise ValueError(f"thinking_token_budget must be an integer >= 0 (-1 = no cap), got "
                             f"{self.thinking_token_budget}.")
        if self.truncation_side not in (None, "left", "right"):
            raise ValueError(f"truncation_side must be 'left' (keep the prompt's last tokens) or 'right' (its first), "
                             f"got {self.truncation_side!r}.")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 (new tokens per streamed output), got "
                             f"{self.stream_interval}.")

    def _validate_stops(self) -> None:
        for stop in self.stop_strings:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}.")
        if self.stop_strings and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched on text); "
                             "set detokenize=True or use stop_token_ids instead.")
        for token_id in self.stop_token_ids or []:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {token_id!r}.")
