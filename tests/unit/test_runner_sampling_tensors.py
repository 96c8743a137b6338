"""The model runner keeps a decoding batch's sampling tensors from step to step (``ModelRunner._sampling_tensors``):
reused only while the same requests sample in the same order and none is seeded, rebuilt otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pagellm.sampling_params import SamplingParams
from pagellm.worker.model_runner import ModelRunner


def _runner() -> SimpleNamespace:
    return SimpleNamespace(_last_sampling=None)


def _tensors(runner: SimpleNamespace, params: list[SamplingParams], positions: list[int]):
    return ModelRunner._sampling_tensors(runner, params, positions)  # type: ignore[arg-type]


def test_the_same_rows_reuse_their_tensors_and_any_change_rebuilds_them() -> None:
    runner = _runner()
    cool, hot = SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_k=5)
    first = _tensors(runner, [cool, hot], [0, 0])
    assert first.temperature.tolist() == [0.5, 1.0] and first.top_k.tolist() == [0, 5]
    assert _tensors(runner, [cool, hot], [1, 1]) is first  # a decoding step later: the same tensors
    swapped = _tensors(runner, [hot, cool], [2, 2])
    assert swapped is not first and swapped.temperature.tolist() == [1.0, 0.5]
    fewer = _tensors(runner, [hot], [3])
    assert fewer.temperature.tolist() == [1.0] and fewer.top_k.tolist() == [5]
    greedy = _tensors(runner, [SamplingParams(temperature=0.0)], [0])  # another request in the same place
    assert greedy.all_greedy and greedy.temperature.tolist() == [0.0]


def test_seeded_rows_are_rebuilt_every_step_for_their_position() -> None:
    runner = _runner()
    seeded = SamplingParams(temperature=1.0, seed=7)
    first = _tensors(runner, [seeded], [0])
    second = _tensors(runner, [seeded], [1])
    assert second is not first
    assert (first.seeds, second.seeds) == ([(0, 7, 0)], [(0, 7, 1)])
    assert torch.equal(first.temperature, second.temperature)
