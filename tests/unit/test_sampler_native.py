"""The fused sampling kernel (``sample/native.py``) against its twin: the float64 inverse CDF of
``softmax(logits / T)``, the first argmax for greedy rows, bans never drawn, rows independent of their batch."""

from __future__ import annotations

import pytest
import torch

from pagellm.sample import native, sampler
from pagellm.sample.sampler import Sampler, SamplingTensors, first_argmax
from pagellm.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not native.available(), reason="fused sampling kernel needs AVX-512 and a compiler")

VOCAB = 49152 + 7  # a tail that is not a multiple of the kernel's 16 lanes or 1024-token chunks


def _logits(rows: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen) * 3).to(dtype)


def _cdf64(row: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(row.double() / temperature, dim=-1).cumsum(0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_draw_is_the_inverse_cdf_of_the_tempered_softmax(dtype: torch.dtype) -> None:
    rows = 48
    logits = _logits(rows, dtype)
    gen = torch.Generator().manual_seed(1)
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.2
    uniforms = torch.rand(rows, generator=gen)
    picked = native.sample_rows(logits, temperature, uniforms)
    for r in range(rows):
        cdf = _cdf64(logits[r], float(temperature[r]))
        i, u = int(picked[r]), float(uniforms[r])
        below = float(cdf[i - 1]) if i else 0.0
        assert below - 1e-6 <= u <= float(cdf[i]) + 1e-6, (r, i, u, below, float(cdf[i]))


def test_greedy_rows_take_the_first_maximum() -> None:
    logits = _logits(6, torch.bfloat16)
    logits[1, [5, 900, 40_000]] = 100.0  # a three-way tie: the lowest id wins
    logits[2, -1] = 100.0                # the maximum in the ragged tail
    temperature = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.5])
    picked = native.sample_rows(logits, temperature, torch.full((6,), 0.5))
    greedy = logits.max(dim=-1).indices  # the twin
    assert picked[[0, 1, 2, 4]].tolist() == greedy[[0, 1, 2, 4]].tolist()
    assert picked[1].item() == 5 and picked[2].item() == VOCAB - 1


def _ties(rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows, each with its maximum repeated at a few ids (same lane, other lanes, the ragged tail), some rows
    with every value -inf or +inf among -inf."""
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    for r in range(rows):
        count = 1 + r % 4
        ids = torch.randint(0, vocab, (count,), generator=gen)
        logits[r, ids] = 50.0 + r % 3
        if r % 5 == 0:
            logits[r, ids % 16] = 50.0 + r % 3  # the same lane of an earlier vector
    if rows > 2:
        logits[1] = float("-inf")
        logits[2] = float("-inf")
        logits[2, vocab // 2:] = float("inf")
    return logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1024, VOCAB])
def test_greedy_argmax_is_torchs_first_maximum(dtype: torch.dtype, vocab: int) -> None:
    logits = _ties(37, vocab, dtype)
    assert torch.equal(native.first_argmax_rows(logits), logits.max(dim=-1).indices)
    wide = _ties(9, vocab + 40, dtype)[:, 3:3 + vocab]  # rows apart by more than their length
    assert torch.equal(native.first_argmax_rows(wide), wide.max(dim=-1).indices)
    one = logits[5:6]
    assert torch.equal(native.first_argmax_rows(one), one.max(dim=-1).indices)  # one row: no threads


def test_greedy_argmax_passes_over_nan_and_gives_0_without_a_value() -> None:
    logits = torch.full((3, 100), float("-inf"))
    logits[0, [10, 60]] = float("nan")
    logits[0, 70] = 1.0
    logits[1, 20] = float("nan")
    assert native.first_argmax_rows(logits).tolist() == [70, 0, 0]
    assert native.first_argmax_rows(torch.zeros(0, 100)).shape == (0,)
    assert first_argmax(logits.to(torch.float16)).tolist() == [10, 20, 0]  # float16: the torch twin (NaN wins)


def test_banned_tokens_are_never_drawn_even_at_the_ends() -> None:
    logits = torch.full((4, VOCAB), float("-inf"))
    allowed = [3, 2_000, 30_001, VOCAB - 2]
    logits[:, allowed] = torch.tensor([0.0, 1.0, -1.0, 0.5])
    uniforms = torch.tensor([0.0, 0.5, 1.0 - 2.0 ** -24, 0.9999])
    picked = native.sample_rows(logits.to(torch.bfloat16), torch.ones(4), uniforms).tolist()
    assert picked[0] == allowed[0] and picked[2] == allowed[-1]
    assert set(picked) <= set(allowed)


def test_a_row_draws_the_same_token_in_any_batch_and_layout() -> None:
    logits = _logits(16, torch.bfloat16, seed=3)
    temperature, uniforms = torch.full((16,), 0.8), torch.linspace(0.01, 0.99, 16)
    whole = native.sample_rows(logits, temperature, uniforms)
    alone = torch.cat([native.sample_rows(logits[r:r + 1], temperature[r:r + 1], uniforms[r:r + 1])
                       for r in range(16)])
    wide = torch.zeros(16, VOCAB + 64, dtype=torch.bfloat16)
    wide[:, 32:32 + VOCAB] = logits
    strided = native.sample_rows(wide[:, 32:32 + VOCAB], temperature, uniforms)  # rows VOCAB + 64 apart
    assert whole.tolist() == alone.tolist() == strided.tolist()


def test_kernel_declines_what_it_does_not_serve() -> None:
    assert native.sample_rows(_logits(2, torch.float16), torch.ones(2), torch.rand(2)) is None
    assert native.sample_rows(_logits(2, torch.float32).t(), torch.ones(VOCAB), torch.rand(VOCAB)) is None


def test_sampler_fast_path_matches_its_torch_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = _logits(32, torch.bfloat16, seed=5)
    params = [SamplingParams(temperature=0.0 if r % 4 == 0 else 0.6 + r / 40) for r in range(32)]
    tensors = SamplingTensors.from_params(params, [0] * 32)
    fast = Sampler(torch.Generator().manual_seed(9))(logits, tensors)
    monkeypatch.setattr(sampler.native, "sample_rows", lambda *args: None)
    monkeypatch.setattr(sampler.native, "first_argmax_rows", lambda *args: None)
    twin = Sampler(torch.Generator().manual_seed(9))(logits, tensors)
    assert fast.tolist() == twin.tolist()
