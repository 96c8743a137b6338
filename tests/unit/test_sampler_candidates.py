"""The sampler's top-k candidate path against the full-vocabulary reference path (forced by ``_SMALL_TOP_K = 0``):
same kept sets (ties at the k-th place included), same probabilities, same seeded tokens; and the greedy argmax."""

from __future__ import annotations

import pytest
import torch

from pagellm.sample import sampler
from pagellm.sample.sampler import (Sampler, SamplingTensors, first_argmax, processed_probs, random_probs,
                                    top_k_candidates)
from pagellm.sampling_params import SamplingParams


def _full_path(monkeypatch: pytest.MonkeyPatch, fn, *args):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(sampler, "_SMALL_TOP_K", 0)  # no candidate path: stable sort of the whole vocabulary
    try:
        return fn(*args)
    finally:
        monkeypatch.undo()


def _batch(gen: torch.Generator, rows: int, greedy_every: int = 0) -> list[SamplingParams]:
    params = []
    for i in range(rows):
        if greedy_every and i % greedy_every == 0:
            params.append(SamplingParams(temperature=0.0))
            continue
        params.append(SamplingParams(temperature=float(torch.rand(1, generator=gen)) * 1.9 + 0.1,
                                     top_k=int(torch.randint(1, 60, (1,), generator=gen)),
                                     top_p=1.0 if i % 3 == 0 else float(torch.rand(1, generator=gen)) * 0.6 + 0.4,
                                     min_p=0.0 if i % 2 else float(torch.rand(1, generator=gen)) * 0.3,
                                     seed=i))
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("greedy_every", [0, 4])
def test_candidate_path_equals_the_full_sort(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                             greedy_every: int) -> None:
    gen = torch.Generator().manual_seed(3)
    for trial in range(4):
        logits = ((torch.randn(16, 500, generator=gen) * 2).round() / 4).to(dtype)  # coarse: many ties
        t = SamplingTensors.from_params(_batch(gen, 16, greedy_every), list(range(16)))
        assert top_k_candidates(logits, t) is not None  # the fast path really runs
        fast = random_probs(logits, t)
        full = _full_path(monkeypatch, random_probs, logits, t)
        assert torch.equal(fast > 0, full > 0), trial  # the same kept tokens, exactly
        torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(processed_probs(logits, t),
                                   _full_path(monkeypatch, processed_probs, logits, t), rtol=1e-5, atol=1e-7)
        fast_tokens = Sampler(torch.Generator().manual_seed(trial))(logits, t)
        full_tokens = _full_path(monkeypatch, Sampler(torch.Generator().manual_seed(trial)), logits, t)
        assert torch.equal(fast_tokens, full_tokens), trial


def test_ties_wider_than_the_first_take_keep_the_lowest_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    # 300 tokens tie at the 5th place (beyond max(k) + 1 + the margin): the take must grow until they are all in.
    logits = torch.zeros(2, 1000)
    logits[:, 900:904] = 2.0
    logits[:, 100:400] = 1.0
    logits[1, 150] = 1.5
    t = SamplingTensors(torch.ones(2), torch.tensor([6, 5]), None, None, [], False, True)
    candidates = top_k_candidates(logits, t)
    assert candidates is not None
    kept = [set(candidates.ids[r][candidates.probs[r] > 0].tolist()) for r in range(2)]
    assert kept == [{900, 901, 902, 903, 100, 101}, {900, 901, 902, 903, 150}]
    assert torch.equal(random_probs(logits, t) > 0, _full_path(monkeypatch, random_probs, logits, t) > 0)


def test_temperature_above_one_ties_are_found_after_scaling(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1.0 and the float32 just below it are equal once divided by 1.7: the tie (and so the lowest id) is judged
    # on the scaled values, as the reference sorts them, not on the raw ones.
    below = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))
    assert torch.tensor(1.0) / 1.7 == torch.tensor(below) / 1.7
    logits = torch.full((1, 100), -5.0)
    logits[0, :3] = torch.tensor([below, 1.0, below])
    t = SamplingTensors(torch.tensor([1.7]), torch.tensor([1]), None, None, [], False, True)
    fast = random_probs(logits, t)
    assert set(fast[0].nonzero().flatten().tolist()) == {0}
    assert torch.equal(fast > 0, _full_path(monkeypatch, random_probs, logits, t) > 0)


def test_rows_without_top_k_take_the_full_path() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    t = SamplingTensors.from_params([SamplingParams(top_k=5), SamplingParams(top_p=0.5),
                                     SamplingParams(temperature=0.0)], [0, 0, 0])
    assert top_k_candidates(logits, t) is None
    t = SamplingTensors.from_params([SamplingParams(top_k=5), SamplingParams(temperature=0.0, top_p=0.5)], [0, 0])
    candidates = top_k_candidates(logits[:2], t)  # a greedy row's filters are off: it does not block the path
    assert candidates is not None and candidates.rows.tolist() == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_argmax_takes_the_lowest_id_among_maxima(dtype: torch.dtype) -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -3.0]], dtype=dtype)
    assert first_argmax(logits).tolist() == [1, 0, 0]
    wide = (torch.randn(8, 4096, generator=torch.Generator().manual_seed(1)) * 2).round().to(dtype)
    assert torch.equal(first_argmax(wide), wide.argmax(dim=-1))
