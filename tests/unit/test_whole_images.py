"""``disable_chunked_mm_input`` (``sched/whole_images.py``): no step ends inside a run of a prompt's image tokens;
a chunk is cut back to the run's start, or waits when it starts inside a run it cannot finish, and every request
still completes with every block back."""

from __future__ import annotations

import numpy as np
import pytest
from sched_fakes import make_request, run_to_completion, scheduled_trace

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.sched.scheduler import Scheduler
from pagellm.sched.whole_images import check_runs, image_runs, whole_images

IMAGE = 9


def _scheduler(budget: int, whole: bool = True, chunk_cap: int = 0) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, long_prefill_token_threshold=chunk_cap,
                                     disable_chunked_mm_input=whole),
                     CacheConfig(block_size=4, enable_prefix_caching=True), 64, 1024)


def _request(rid: str, prompt: list[int], whole: bool = True, **kwargs):
    request = make_request(rid, prompt, **kwargs)
    request.image_runs = image_runs(prompt, IMAGE) if whole else None
    return request


def _prompt(start: int) -> list[int]:
    """48 tokens: text, an image of 12 tokens at 10..21, text, one of 10 at 24..33, text, one of 8 at 36..43,
    text."""
    text = list(range(start, start + 48))
    text[10:22] = [IMAGE] * 12
    text[24:34] = [IMAGE] * 10
    text[36:44] = [IMAGE] * 8
    return text


def test_runs_and_the_cut() -> None:
    runs = image_runs(_prompt(100), IMAGE)
    assert runs.tolist() == [[10, 22], [24, 34], [36, 44]]
    assert image_runs([1, 2, 3], IMAGE) is None
    assert image_runs([IMAGE, IMAGE, 1, IMAGE], IMAGE).tolist() == [[0, 2], [3, 4]]
    assert [whole_images(runs, 0, n) for n in (10, 11, 21, 22, 25, 48)] == [10, 10, 10, 22, 24, 48]
    assert [whole_images(runs, 22, n) for n in (2, 3, 11, 12)] == [2, 2, 2, 12]
    assert [whole_images(runs, 16, n) for n in (5, 6, 11)] == [0, 6, 8]  # starts inside the first image
    check_runs(runs, 12)
    with pytest.raises(ValueError, match="an image of 12 tokens must be computed in one step here .* raise "
                                         "--max-num-batched-tokens .* to at least 12"):
        check_runs(runs, 11)


def test_no_step_ends_inside_an_image_and_every_request_completes() -> None:
    sched = _scheduler(budget=16)
    sched.add_request(_request("A", _prompt(100), max_tokens=2))
    sched.add_request(_request("B", list(range(200, 212)), max_tokens=2))
    trace = scheduled_trace(run_to_completion(sched))
    # A's first chunk (admission) is cut at its first image, its second and third (running) at the next ones
    assert trace == [{"A": 10, "B": 6}, {"A": 14}, {"A": 12}, {"A": 12, "B": 4}, {"A": 1, "B": 2}, {"B": 1}]
    ends = np.cumsum([step.get("A", 0) for step in trace])
    assert not any(10 < end < 22 or 24 < end < 34 or 36 < end < 44 for end in ends.tolist())
    plain = _scheduler(budget=16, whole=False)
    plain.add_request(_request("A", _prompt(100), whole=False, max_tokens=2))
    assert scheduled_trace(run_to_completion(plain))[:2] == [{"A": 16}, {"A": 16}]  # ends inside both images


def test_a_hit_that_ends_inside_an_image_waits_for_room_to_finish_it() -> None:
    sched = _scheduler(budget=16)
    sched.add_request(_request("A", _prompt(100), max_tokens=1))
    run_to_completion(sched)
    sched.add_request(_request("P", list(range(300, 331)), max_tokens=2))
    sched.add_request(_request("C", _prompt(100)[:18] + list(range(400, 406)), max_tokens=1))  # hits 16 of 24
    trace = run_to_completion(sched)
    # P takes the first step; the one budget token the second leaves would end C's step inside the image it
    # starts in (at 16 of 10..17): C waits, then computes 16..24 in one step
    assert scheduled_trace(trace) == [{"P": 16}, {"P": 15}, {"P": 1, "C": 8}]
    assert trace[2][0].new_reqs[0].num_computed_tokens == 16
