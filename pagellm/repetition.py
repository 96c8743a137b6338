"""Ending a request whose output repeats itself (vLLM's ``repetition_detection``): small models in particular fall into
loops (``abcabcabc...``) that only ``max_tokens`` would end.

Contract:
- ``RepetitionDetectionParams(max_pattern_size, min_pattern_size, min_count)``: the output repeats when, for some
  pattern length ``L`` from ``min_pattern_size`` (0 meaning 1) to ``max_pattern_size``, its last ``L * min_count``
  tokens are ``min_count`` copies of its last ``L``. ``max_pattern_size`` 0 turns detection off; otherwise
  ``min_count`` must be at least 2 and ``min_pattern_size <= max_pattern_size`` (a ValueError says what to fix).
- ``repeats_at(output, first, params)``: the index of the first of the output tokens from ``first`` on whose arrival
  made the output repeat (None when none did). The frontend checks each new token once ``min_tokens`` are out and
  ends the request there with finish reason ``"repetition"`` and stop reason ``"repetition_detected"``, as vLLM 0.32
  does (``engine/output_processor.py``); an EOS, stop token or length limit on the same token wins.
"""

from __future__ import annotations

from typing import Sequence

import msgspec

STOP_REASON = "repetition_detected"


class RepetitionDetectionParams(msgspec.Struct, omit_defaults=True, frozen=True):
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        sizes = (self.max_pattern_size, self.min_pattern_size, self.min_count)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in sizes):
            raise ValueError(f"repetition_detection's sizes and count must be integers, got {sizes}")
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValueError("repetition_detection: max_pattern_size and min_pattern_size must be >= 0, with "
                             f"min_pattern_size <= max_pattern_size (got {self.min_pattern_size} and "
                             f"{self.max_pattern_size}); set max_pattern_size to 0 to turn detection off")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(f"repetition_detection: min_count must be >= 2 (got {self.min_count}): a pattern "
                             "repeats when it appears at least twice in a row")

    @property
    def active(self) -> bool:
        return self.max_pattern_size > 0


def repeats(output: Sequence[int], end: int, params: RepetitionDetectionParams) -> bool:
    """Whether ``output[:end]`` ends in ``params.min_count`` copies of a pattern of an allowed length."""
    count = params.min_count
    for length in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        span = length * count
        if span > end:
            return False
        pattern = output[end - length:end]
        if all(output[end - length * (k + 1):end - length * k] == pattern for k in range(1, count)):
            return True
    return False


def repeats_at(output: Sequence[int], first: int, params: RepetitionDetectionParams) -> int | None:
    for index in range(first, len(output)):
        if repeats(output, index + 1, params):
            return index
    return None
