"""The beam search's state (``pagellm/beam_search.py``) on hand-made log-probabilities: which beams live, which
finish, how the survivors are ranked, what their texts hold, and the parameters it refuses."""

from __future__ import annotations

import math

import pytest

from pagellm.beam_search import BeamSearch, BeamSearchParams

EOS = frozenset({9})


def _decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def test_beams_grow_by_their_best_candidates_and_eos_sets_one_aside() -> None:
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=3), EOS)
    search.advance([{5: -0.1, 6: -0.5, 9: -2.0, 7: -3.0}])
    assert [b.tokens for b in search.live] == [[1, 2, 5], [1, 2, 6]]
    assert [b.tokens for b in search.finished] == [[1, 2, 9]]  # an end of sequence leaves the race
    search.advance([{9: -0.2, 8: -1.0, 7: -1.1, 6: -4.0}, {5: -0.05, 7: -0.3, 9: -2.0, 8: -2.5}])
    # candidates by cumulative logprob: 6 5 at -0.55, 6 7 at -0.8, 5 8 at -1.1, ...
    assert [b.tokens[2:] for b in search.live] == [[6, 5], [6, 7]]
    assert [round(b.cum_logprob, 6) for b in search.live] == [-0.55, -0.8]
    assert [b.tokens[2:] for b in search.finished] == [[9], [5, 9], [6, 9]]
    assert not search.done
    search.advance([{1: -1.0}, {1: -1.0}])
    assert search.done  # max_tokens steps


def test_the_result_ranks_finished_and_live_beams_by_length_penalised_score() -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=1.0)
    search = BeamSearch([1, 2], params, EOS)
    search.advance([{9: -1.2, 5: -0.5, 6: -0.6}])  # [1 2 9] finishes: length 2 (its eos uncounted), score -0.6
    search.advance([{7: -0.4, 8: -2.0}, {7: -0.9, 8: -2.0}])  # live [1 2 5 7] -0.9 / 4, [1 2 6 7] -1.5 / 4
    out = search.result(_decode).sequences
    assert [b.tokens for b in out] == [[1, 2, 5, 7], [1, 2, 6, 7]]
    assert [b.finish_reason for b in out] == ["length", "length"] and out[0].text == "5 7"
    assert math.isclose(out[0].cum_logprob, -0.9)
    # a length penalty of 0 ranks by the sum alone: the finished beam's -1.2 beats -1.5
    search = BeamSearch([1, 2], BeamSearchParams(2, 2, length_penalty=0.0, include_stop_str_in_output=True), EOS)
    search.advance([{9: -1.2, 5: -0.5, 6: -0.6}])
    search.advance([{7: -0.4, 8: -2.0}, {7: -0.9, 8: -2.0}])
    out = search.result(_decode).sequences
    assert [b.tokens for b in out] == [[1, 2, 5, 7], [1, 2, 9]]
    assert out[1].finish_reason == "stop" and out[1].text == "9"  # the end-of-sequence token's text kept


def test_ignore_eos_keeps_eos_candidates_in_the_race_and_no_live_beam_ends_the_search() -> None:
    search = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True), EOS)
    search.advance([{9: -0.1, 5: -0.2}])
    assert [b.tokens for b in search.live] == [[1, 9]] and not search.finished
    search = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=5), EOS)
    search.advance([{9: -0.1}])
    assert search.done and not search.live  # every candidate finished
    out = search.result(_decode).sequences
    assert [(b.tokens, b.finish_reason, b.text) for b in out] == [([1, 9], "stop", "")]


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(beam_width=0, max_tokens=4), r"beam_width must be an integer in \[1, 10\]"),
    (dict(beam_width=11, max_tokens=4), r"beam_width must be an integer in \[1, 10\]"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be a positive integer"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty must be a finite number"),
])
def test_parameters_out_of_range_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_each_step_asks_for_one_token_and_twice_the_width_of_raw_logprobs() -> None:
    step = BeamSearchParams(beam_width=4, max_tokens=8).step_params()
    assert (step.max_tokens, step.logprobs, step.temperature, step.ignore_eos) == (1, 8, 0.0, True)
    assert not step.processed_logprobs
