"""Repetition detection (vLLM's ``repetition_detection``): which outputs repeat, and the parameters' checks."""

from __future__ import annotations

import pytest

from pagellm import SamplingParams
from pagellm.repetition import RepetitionDetectionParams, repeats_at

PAIRS = RepetitionDetectionParams(max_pattern_size=3, min_count=3)


@pytest.mark.parametrize(("output", "first", "index"), [
    ([1, 2, 3, 1, 2, 3, 1, 2, 3, 4], 0, 8),   # a 3-token pattern, third copy complete at index 8
    ([7, 5, 5, 5], 0, 3),                     # one token three times
    ([1, 2, 1, 2, 1], 0, None),               # two and a half copies
    ([9, 1, 2, 1, 2, 1, 2], 0, 6),
    ([1, 2, 1, 2, 1, 2], 6, None),            # only tokens from ``first`` on are looked at
    ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4], 0, None),  # a 4-token pattern is longer than max_pattern_size
])
def test_an_output_repeats_when_its_end_is_min_count_copies(output: list[int], first: int, index: int | None) -> None:
    assert repeats_at(output, first, PAIRS) == index


def test_min_pattern_size_skips_shorter_patterns() -> None:
    long_only = RepetitionDetectionParams(max_pattern_size=3, min_pattern_size=2, min_count=2)
    assert repeats_at([4, 4, 4, 4], 0, long_only) == 3  # 4 4 | 4 4: a 2-token pattern twice
    assert repeats_at([4, 4, 4], 0, long_only) is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_pattern_size": 2, "min_count": 1}, "min_count must be >= 2"),
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size <= max_pattern_size"),
    ({"max_pattern_size": -1}, "must be >= 0"),
    ({"max_pattern_size": 2.5, "min_count": 2}, "must be integers"),
])
def test_bad_parameters_say_what_to_fix(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(repetition_detection=fields)


def test_sampling_params_take_a_dict_and_off_by_default() -> None:
    params = SamplingParams(repetition_detection={"max_pattern_size": 4, "min_count": 2})
    assert params.repetition_detection == RepetitionDetectionParams(max_pattern_size=4, min_count=2)
    assert not RepetitionDetectionParams().active and SamplingParams().repetition_detection is None
    with pytest.raises(ValueError, match="takes max_pattern_size, min_pattern_size and min_count"):
        SamplingParams(repetition_detection={"window": 3})
