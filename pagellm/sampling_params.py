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
- ``logprobs`` is ``None`` (off) or an integer in ``[0, MAX_LOGPROBS]``.
- ``max_tokens=None`` means "up to the model's context length"; the engine resolves it (it knows
  ``max_model_len``), this module does not.
"""

from __future__ import annotations

import enum
import math
from typing import ClassVar

import msgspec

# Below this temperature a request is treated as greedy: dividing logits by ~0 only amplifies float noise, and
# the argmax is what the user means.
_GREEDY_EPS = 1e-5
# The most top alternatives a request may ask for per generated token (OpenAI's limit).
MAX_LOGPROBS = 20


class SamplingType(enum.IntEnum):
    """How the sampler treats a row; seeded rows need their own generator."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


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

    GREEDY_EPS: ClassVar[float] = _GREEDY_EPS

    def __post_init__(self) -> None:
        self._coerce_numbers()
        self._normalise_lists()
        self._validate_sampling()
        self._validate_lengths()
        self._validate_stops()

    # ---- derived views -------------------------------------------------------------------------------------

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
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (it is always a list after ``__post_init__``; this keeps type checkers happy)."""
        return self.stop if isinstance(self.stop, list) else []

    # ---- validation helpers --------------------------------------------------------------------------------

    def _coerce_numbers(self) -> None:
        # Python callers may pass ints for floats (temperature=0) or numpy scalars; msgspec only type-checks on
        # decode, so coerce here to keep downstream tensor construction uniform.
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}.")
            setattr(self, name, float(value))
        for name in ("n", "top_k", "min_tokens", "seed", "max_tokens", "logprobs"):
            value = getattr(self, name)
            if value is None and name in ("seed", "max_tokens", "logprobs"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
        if self.top_k == -1:
            self.top_k = 0

    def _normalise_lists(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)

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
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (0 = only the sampled token, None = off), "
                             f"got {self.logprobs}.")

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (or None for up to the context length), "
                             f"got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}.")

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
