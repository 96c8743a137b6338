"""``disable_chunked_mm_input`` (vLLM's flag; always on for a model whose image tokens attend both ways, Gemma 3):
no step ends inside a run of a prompt's image tokens (an image, or a tile of one). A prompt chunk that would is cut
back to the run's start; one that starts inside a run (a prefix-cache hit can end there) waits for a step with room
for the rest of it. Runs longer than a step's budget are refused when the request arrives (``check_runs``), so every
request still gets through.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pagellm.request import Request


def image_runs(prompt: Sequence[int], image_token: int) -> np.ndarray | None:
    """[runs, 2] the start and end of each run of consecutive ``image_token`` in ``prompt`` (None: there is none)."""
    is_image = np.asarray(prompt) == image_token
    if not is_image.any():
        return None
    edges = np.flatnonzero(np.diff(np.concatenate([[False], is_image, [False]]).astype(np.int8)))
    return edges.reshape(-1, 2).astype(np.int64)


def check_runs(runs: np.ndarray, step_limit: int) -> None:
    """A ValueError naming the fix when an image run is longer than a step can compute."""
    longest = int((runs[:, 1] - runs[:, 0]).max())
    if longest > step_limit:
        raise ValueError(f"an image of {longest} tokens must be computed in one step here (disable_chunked_mm_input, "
                         f"or images that attend both ways), more than a step's {step_limit}; raise "
                         "--max-num-batched-tokens (and --long-prefill-token-threshold, where set) to at least "
                         f"{longest}")


def whole_images(runs: np.ndarray, computed: int, count: int) -> int:
    """The tokens of ``count`` from position ``computed`` on that a step may compute without ending inside one of
    ``runs``: all of them, or up to the run's start, or none when the step starts inside the run and cannot finish
    it."""
    end = computed + count
    i = int(np.searchsorted(runs[:, 0], end)) - 1  # the last run that starts before the step's end
    if i < 0 or end >= runs[i, 1]:
        return count
    return max(int(runs[i, 0]) - computed, 0)


def cut_grants(requests: list[Request], computed: np.ndarray, grant: np.ndarray) -> None:
    """``whole_images`` over the running rows' grants, in place (rows still before their last image's end)."""
    for row in np.flatnonzero(grant).tolist():
        runs = requests[row].image_runs
        if runs is not None and computed[row] < runs[-1, 1]:
            grant[row] = whole_images(runs, int(computed[row]), int(grant[row]))
