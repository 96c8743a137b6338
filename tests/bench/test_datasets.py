"""Dataset loaders: exact lengths, shared prefixes, real conversations and the HumanEval prompts, reproducibly."""

from __future__ import annotations

import math

import pytest

from pagellm.bench import datasets
from pagellm.bench.datasets import DatasetOptions
from pagellm.bench.arrivals import arrival_gaps


def test_random_has_exact_lengths_and_ordinary_ids() -> None:
    reqs = datasets.load("random", DatasetOptions(num_prompts=5, input_len=7, output_len=3, vocab_size=300))
    assert len(reqs) == 5
    for req in reqs:
        assert len(req.prompt) == req.prompt_len == 7 and req.output_len == 3
        assert all(100 <= t < 300 for t in req.prompt)
        assert req.ignore_eos and not req.is_chat


def test_random_range_ratio_bounds_and_seed_reproducibility() -> None:
    opts = DatasetOptions(num_prompts=200, input_len=100, output_len=50, range_ratio=0.2, seed=3)
    reqs = datasets.random_requests(opts)
    assert {len(r.prompt) for r in reqs} <= set(range(80, 121)) and len({len(r.prompt) for r in reqs}) > 10
    assert all(40 <= r.output_len <= 60 for r in reqs)
    assert [r.prompt for r in datasets.random_requests(opts)] == [r.prompt for r in reqs]
    opts.seed = 4
    assert [r.prompt for r in datasets.random_requests(opts)] != [r.prompt for r in reqs]


def test_prefix_requests_share_their_prefix_and_differ_after_it() -> None:
    reqs = datasets.load("prefix", DatasetOptions(num_prompts=6, input_len=5, prefix_len=32, num_prefixes=2))
    assert all(len(r.prompt) == 37 for r in reqs)
    assert reqs[0].prompt[:32] == reqs[2].prompt[:32] == reqs[4].prompt[:32]
    assert reqs[1].prompt[:32] == reqs[3].prompt[:32] != reqs[0].prompt[:32]
    assert reqs[0].prompt[32:] != reqs[2].prompt[32:]


def test_chat_requests_are_real_multi_turn_conversations_ending_with_the_user() -> None:
    reqs = datasets.load("chat", DatasetOptions(num_prompts=30, output_len=16, seed=1))
    assert all(r.is_chat and r.prompt is None and r.output_len == 16 for r in reqs)
    for req in reqs:
        roles = [m["role"] for m in req.messages]
        assert roles == ["user" if i % 2 == 0 else "assistant" for i in range(len(roles))]
        assert roles[-1] == "user" and all(m["content"] for m in req.messages)
    assert max(len(r.messages) for r in reqs) >= 3  # multi-turn, not only openers
    assert len(datasets.load_conversations()) > 7000


def test_code_requests_are_the_164_humaneval_prompts() -> None:
    prompts = datasets.load_humaneval_prompts()
    assert len(prompts) == 164
    assert "def has_close_elements" in prompts[0]
    reqs = datasets.load("code", DatasetOptions(num_prompts=170, output_len=8))
    assert len(reqs) == 170 and set(r.prompt for r in reqs) == set(prompts)  # all 164, then repeats
    assert all(isinstance(r.prompt, str) and r.output_len == 8 for r in reqs)


@pytest.mark.parametrize("name, opts, message", [
    ("nope", DatasetOptions(), "unknown dataset 'nope'"),
    ("random", DatasetOptions(num_prompts=0), "at least 1"),
    ("random", DatasetOptions(range_ratio=1.5), "range ratio"),
    ("random", DatasetOptions(vocab_size=50), "vocab size"),
    ("prefix", DatasetOptions(num_prefixes=0), "num-prefixes"),
    ("random", DatasetOptions(input_len=0), "--input-len and --output-len must be at least 1 token"),
    ("code", DatasetOptions(output_len=-4), r"at least 1 token \(got 128 and -4\)"),
])
def test_bad_options_raise_value_errors(name: str, opts: DatasetOptions, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        datasets.load(name, opts)


def test_arrival_gaps() -> None:
    assert arrival_gaps(4, math.inf, 1.0, 0) == [0.0] * 4
    gaps = arrival_gaps(2000, 10.0, 1.0, 0)
    assert gaps == arrival_gaps(2000, 10.0, 1.0, 0) and all(g > 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate (2000 seeded draws)
    bursty = arrival_gaps(2000, 10.0, 0.25, 0)
    assert max(bursty) > max(gaps)  # same mean, heavier tail
    with pytest.raises(ValueError, match="request-rate"):
        arrival_gaps(1, 0.0, 1.0, 0)
