"""Sampler: greedy, the top-k/top-p/min-p masks (exact kept sets), the sampled distribution, seeded determinism."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm.sample.sampler import (Sampler, SamplingTensors, apply_top_k_top_p, min_p_mask, mix_seed,
                                    sample_inverse_cdf,
                                    random_probs)
from pagellm.sampling_params import SamplingParams

# chi-square critical value for 4 degrees of freedom at p = 0.001
_CHI2_DF4_P001 = 18.467


def _tensors(params: list[SamplingParams], positions: list[int] | None = None) -> SamplingTensors:
    return SamplingTensors.from_params(params, positions if positions is not None else [0] * len(params))


def _kept(row: torch.Tensor) -> set[int]:
    """Token ids that survive in a masked logits row (finite entries)."""
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def _support(row: torch.Tensor) -> set[int]:
    """Token ids with non-zero probability."""
    return set(torch.nonzero(row > 0).flatten().tolist())


def _log(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float64).log().float()


# ---- SamplingTensors ------------------------------------------------------------------------------------------

def test_from_params_builds_only_used_filters() -> None:
    t = _tensors([SamplingParams(temperature=0.0, top_k=5, seed=1), SamplingParams(temperature=0.5)])
    assert t.top_k is None and t.top_p is None and t.min_p is None  # the greedy row's filters are ignored
    assert t.seeds == [] and not t.all_greedy and not t.all_random
    assert t.temperature.tolist() == [0.0, 0.5]

    t = _tensors([SamplingParams(top_k=3, seed=9), SamplingParams(top_p=0.5), SamplingParams(min_p=0.1)], [4, 0, 2])
    assert t.top_k.tolist() == [3, 0, 0] and t.top_k.dtype == torch.int64
    assert t.top_p.tolist() == [1.0, 0.5, 1.0] and t.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert t.seeds == [(0, 9, 4)] and t.all_random and not t.all_greedy


def test_from_params_rejects_mismatched_positions() -> None:
    with pytest.raises(ValueError, match="one output position per row"):
        SamplingTensors.from_params([SamplingParams()], [0, 1])


# ---- greedy -----------------------------------------------------------------------------------------------------

def test_greedy_is_argmax_and_never_touches_generator() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(123)
    before = generator.get_state()
    out = Sampler(generator)(logits, _tensors([SamplingParams(temperature=0.0, seed=4)] * 6))
    assert out.dtype == torch.int64 and torch.equal(out, logits.argmax(dim=-1))
    assert torch.equal(generator.get_state(), before)


def test_mixed_batch_greedy_rows_are_argmax_and_random_rows_use_generator() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(7)
    before = generator.get_state()
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0), SamplingParams()]
    out = Sampler(generator)(logits, _tensors(params))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert not torch.equal(generator.get_state(), before)


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.1, 0.5, 1.0, 2.0, 5.0, 1.0, 0.3, 9.0)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, _tensors(params))
    assert torch.equal(out, logits.argmax(dim=-1))


def test_low_precision_logits_accepted() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = Sampler(torch.Generator().manual_seed(0))(logits, _tensors([SamplingParams(top_k=1)] * 3))
    assert torch.equal(out, logits.float().argmax(dim=-1))


def test_bad_logits_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        Sampler()(torch.zeros(3, 5), _tensors([SamplingParams()] * 2))


# ---- masks, hand-computed ---------------------------------------------------------------------------------------

def test_top_k_keeps_exactly_k_and_breaks_ties_towards_lower_ids() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]] * 4)
    out = apply_top_k_top_p(logits, torch.tensor([2, 3, 0, 99]), None)
    assert [_kept(row) for row in out] == [{0, 2}, {0, 2, 3}, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}]
    assert torch.equal(out[2], logits[2])  # kept logits are untouched by the sort/scatter


def test_top_p_keeps_smallest_prefix_reaching_mass() -> None:
    logits = _log([0.5, 0.25, 0.125, 0.125]).repeat(4, 1)
    out = apply_top_k_top_p(logits, None, torch.tensor([0.3, 0.7, 0.76, 1.0]))
    assert [_kept(row) for row in out] == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}]


def test_top_p_always_keeps_top_token_and_breaks_ties_towards_lower_ids() -> None:
    logits = _log([0.2, 0.4, 0.2, 0.2]).repeat(2, 1)
    out = apply_top_k_top_p(logits, None, torch.tensor([1e-9, 0.5]))
    assert [_kept(row) for row in out] == [{1}, {1, 0}]


def test_top_k_applies_before_top_p() -> None:
    # After top-2 the distribution is [4/7, 3/7]: top_p 0.5 then keeps only the first (without top-k it keeps 2).
    logits = _log([0.4, 0.3, 0.2, 0.1]).repeat(2, 1)
    t = SamplingTensors(torch.ones(2), torch.tensor([2, 0]), torch.tensor([0.5, 0.5]), None, [], False, True)
    assert [_support(row) for row in random_probs(logits, t)] == [{0}, {0, 1}]


def test_min_p_drops_below_fraction_of_max() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    drop = min_p_mask(probs, torch.tensor([0.0, 0.25, 0.5, 1.0]))
    assert [set(torch.nonzero(~row).flatten().tolist()) for row in drop] == [{0, 1, 2, 3}, {0, 1, 2}, {0, 1}, {0}]
    ties = min_p_mask(torch.tensor([[0.4, 0.4, 0.2]]), torch.tensor([1.0]))
    assert (~ties[0]).tolist() == [True, True, False]


def test_min_p_applies_after_top_p() -> None:
    # top_p 0.8 keeps [0.4, 0.3, 0.2]; min_p 0.6 then needs >= 0.24 of the total: 0.2 goes.
    logits = _log([0.4, 0.3, 0.2, 0.1])
    t = SamplingTensors(torch.ones(1), None, torch.tensor([0.8]), torch.tensor([0.6]), [], False, True)
    assert _support(random_probs(logits, t)[0]) == {0, 1}


def test_temperature_applies_before_filters() -> None:
    # At T=0.5 the probabilities are ∝ p² = [0.94, 0.06], so top_p 0.9 keeps one token; at T=1 ([0.8, 0.2]) both.
    logits = _log([0.8, 0.2]).repeat(2, 1)
    t = SamplingTensors(torch.tensor([0.5, 1.0]), None, torch.tensor([0.9, 0.9]), None, [], False, True)
    assert [_support(row) for row in random_probs(logits, t)] == [{0}, {0, 1}]


# ---- masks against the slow, obvious twin -------------------------------------------------------------------------

def _reference_kept(logits: list[float], temperature: float, k: int, p: float, min_p: float) -> set[int]:
    """Per-row, pure-Python statement of the filter order: temperature, top-k, top-p, min-p."""
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    kept = order[:k] if k > 0 else order
    weights = {i: math.exp((logits[i] - logits[order[0]]) / temperature) for i in kept}
    total = sum(weights.values())
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= p and p < 1.0:
            break
        nucleus.append(i)
        mass += weights[i] / total
    top = max(weights[i] for i in nucleus)
    return {i for i in nucleus if weights[i] >= min_p * top}


def test_filters_match_reference_on_random_rows() -> None:
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 64, 40
    logits = torch.randn(rows, vocab, generator=gen) * 2
    params = [SamplingParams(temperature=float(torch.rand(1, generator=gen)) * 2 + 0.1,
                             top_k=int(torch.randint(0, vocab + 5, (1,), generator=gen)),
                             top_p=float(torch.rand(1, generator=gen)) * 0.99 + 0.01,
                             min_p=float(torch.rand(1, generator=gen)) * 0.5) for _ in range(rows)]
    probs = random_probs(logits, _tensors(params))
    for row, sp in enumerate(params):
        expected = _reference_kept(logits[row].tolist(), sp.temperature, sp.top_k, sp.top_p, sp.min_p)
        assert _support(probs[row]) == expected, f"row {row}: {sp}"


# ---- the sampled distribution -------------------------------------------------------------------------------------

def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_sampling_matches_softmax() -> None:
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    n = 20_000
    out = Sampler(torch.Generator().manual_seed(2024))(base.repeat(n, 1),
                                                        _tensors([SamplingParams(temperature=0.7)] * n))
    assert _chi_square(out, (base / 0.7).softmax(dim=-1)) < _CHI2_DF4_P001


def test_top_k_sampling_matches_renormalised_softmax_and_never_picks_dropped() -> None:
    base = torch.tensor([0.2, 1.0, -0.3, 0.7, 0.0])
    n = 20_000
    out = Sampler(torch.Generator().manual_seed(5))(base.repeat(n, 1), _tensors([SamplingParams(top_k=3)] * n))
    assert set(out.unique().tolist()) <= {0, 1, 3}
    kept = torch.tensor([0, 1, 3])
    counts = torch.bincount(out, minlength=5)[kept].double()
    expected = base[kept].softmax(dim=-1).double() * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 13.816  # df 2, p 0.001


# ---- determinism ----------------------------------------------------------------------------------------------

def _seeded_tokens(batch_logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                   generator_seed: int) -> torch.Tensor:
    return Sampler(torch.Generator().manual_seed(generator_seed))(batch_logits, _tensors(params, positions))


def test_seeded_row_is_independent_of_batch_and_row_index() -> None:
    vocab = 1000
    gen = torch.Generator().manual_seed(0)
    mine = torch.randn(vocab, generator=gen) * 0.1  # nearly flat: the token is decided by the noise
    seeded = SamplingParams(seed=1234, top_p=0.95)
    tokens_a, tokens_b = [], []
    for position in range(20):
        others_a = torch.randn(2, vocab, generator=gen)
        batch_a = torch.stack([mine, others_a[0], others_a[1]])
        params_a = [seeded, SamplingParams(), SamplingParams(temperature=0.0)]
        tokens_a.append(int(_seeded_tokens(batch_a, params_a, [position, 3, 9], 1)[0]))
        others_b = torch.randn(4, vocab, generator=gen)
        batch_b = torch.cat([others_b, mine[None]])
        params_b = [SamplingParams(seed=1), SamplingParams(top_k=5), SamplingParams(), SamplingParams(), seeded]
        tokens_b.append(int(_seeded_tokens(batch_b, params_b, [position] * 5, 99)[4]))
    assert tokens_a == tokens_b
    assert len(set(tokens_a)) > 15  # different output positions give different draws


def test_seeded_draws_depend_on_seed_and_position_only() -> None:
    sampler = Sampler(torch.Generator().manual_seed(0))
    probs = torch.full((4, 64), 1 / 64)
    noise = sampler._uniforms(probs, [(0, 7, 3), (1, 7, 4), (2, 8, 3)])
    again = Sampler(torch.Generator().manual_seed(1))._uniforms(probs[:1], [(0, 7, 3)])
    assert torch.equal(noise[0], again[0])  # same (seed, position), different batch generator and batch size
    assert not torch.equal(noise[0], noise[1])  # next position
    assert not torch.equal(noise[0], noise[2])  # other seed
    assert not torch.equal(noise[0], noise[3])  # unseeded row draws from the batch generator


def test_unseeded_rows_follow_the_batch_generator() -> None:
    logits = torch.zeros(32, 1000)
    params = [SamplingParams()] * 32
    first = _seeded_tokens(logits, params, [0] * 32, 5)
    assert torch.equal(first, _seeded_tokens(logits, params, [0] * 32, 5))
    assert not torch.equal(first, _seeded_tokens(logits, params, [0] * 32, 6))


def test_mix_seed_separates_nearby_inputs_and_fits_manual_seed() -> None:
    values = {mix_seed(seed, position) for seed in range(-3, 30) for position in range(30)}
    assert len(values) == 33 * 30
    assert all(0 <= v < 2 ** 63 for v in values)
    assert mix_seed(1, 0) != mix_seed(0, 1)


def test_inverse_cdf_never_picks_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.25]])
    uniforms = torch.tensor([0.0, 0.999999])
    assert sample_inverse_cdf(probs, uniforms).tolist() == [1, 4]
    edges = sample_inverse_cdf(probs[:1].expand(3, -1), torch.tensor([0.49, 0.5, 0.99]))
    assert edges.tolist() == [1, 3, 3]
