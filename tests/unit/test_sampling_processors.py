"""Logits processing without a model: penalties against their one-row twin, bias/bans/allowed ids, bad words,
grammar compilation cache and validation, processed distributions."""

from __future__ import annotations

import pytest
import torch

from pagellm.sample.logits_processors import RequestProcessing, RowContext, apply_processing, banned_words
from pagellm.sample.penalties import TokenCounts, apply_penalties, apply_penalties_reference, gather_counts
from pagellm.sample.sampler import SamplingTensors, processed_logprobs, processed_probs
from pagellm.sample.structured import validate
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams

V = 50


def _state(params: SamplingParams, prompt: list[int], output: list[int]) -> RequestProcessing:
    state = RequestProcessing.create(params, prompt, output, V, None)
    assert state is not None
    return state


def test_penalties_match_the_reference_row_by_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    cases = [([1, 2, 3, 3], [3, 4, 4, 4, 9], 1.3, 0.5, 0.25),
             ([7], [7, 7, 8], 1.0, -0.5, 1.5),   # presence/frequency only
             ([10, 11], [], 0.7, 0.0, 0.0)]      # repetition < 1 rewards, prompt only
    rows, ids, counts, in_prompt = gather_counts([TokenCounts(p, o, True) for p, o, *_ in cases])
    out = logits.clone()
    apply_penalties(out, rows, ids, counts, in_prompt, torch.tensor([c[2] for c in cases]),
                    torch.tensor([c[3] for c in cases]), torch.tensor([c[4] for c in cases]))
    for row, (p, o, rep, pres, freq) in enumerate(cases):
        expected = apply_penalties_reference(logits[row], p, o, rep, pres, freq)
        torch.testing.assert_close(out[row], expected, rtol=0, atol=1e-6)
    # spot check the semantics by hand: token 4 occurs 3x in row 0's output, token 3 in prompt and output
    assert out[0, 4].item() == pytest.approx(_rep(logits[0, 4].item(), 1.3) - 0.25 * 3 - 0.5, abs=1e-6)
    assert out[2, 10].item() == pytest.approx(_rep(logits[2, 10].item(), 0.7), abs=1e-6)
    assert out[2, 20].item() == logits[2, 20].item()


def _rep(x: float, p: float) -> float:
    return x / p if x > 0 else x * p


def test_counts_follow_observed_tokens() -> None:
    state = _state(SamplingParams(frequency_penalty=1.0), [1, 2], [5])
    state.observe([5, 6])
    assert state.counts is not None
    ids, counts, in_prompt = state.counts.view()  # no repetition penalty: prompt tokens are not tracked
    assert ids.tolist() == [5, 6] and counts.tolist() == [2.0, 1.0] and not in_prompt.any()
    many = TokenCounts([1, 1, 2], list(range(300)), True)
    ids, counts, in_prompt = many.view()
    assert ids.tolist()[:2] == [1, 2] and len(ids) == 300 and in_prompt.sum() == 2 and counts.sum() == 300
    growing = TokenCounts([1, 2], [3], True)  # room for 67 tokens at first; a generation adds one token a step
    for token in range(1000, 1300):
        growing.add([token])
        growing.add([token])  # its slot already taken: counted twice
    ids, counts, in_prompt = growing.view()
    assert ids.tolist() == [1, 2, 3, *range(1000, 1300)] and counts.tolist() == [0.0, 0.0, 1.0] + [2.0] * 300
    assert in_prompt.tolist() == [True, True] + [False] * 301


def test_processing_order_and_untouched_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    bias = _state(SamplingParams(logit_bias={3: 100.0, 4: -100.0}), [0], [])
    allowed = _state(SamplingParams(allowed_token_ids=[5, 6, 7], logit_bias={6: 2.0}), [0], [])
    penal = _state(SamplingParams(repetition_penalty=2.0, logit_bias={1: 1.0}), [1], [])
    rows = [RowContext(bias, ()), RowContext(None, ()), RowContext(allowed, (), banned=(7,)), RowContext(penal, ())]
    out = apply_processing(logits.clone(), rows)
    assert torch.equal(out[1], logits[1])  # a row that asks for nothing is unchanged
    assert out[0, 3] == logits[0, 3] + 100 and out[0, 4] == logits[0, 4] - 100
    allowed_row = out[2]
    assert torch.isinf(allowed_row[[i for i in range(V) if i not in (5, 6)]]).all()  # 7 allowed but min_tokens-banned
    assert allowed_row[6] == logits[2, 6] + 2.0 and allowed_row[5] == logits[2, 5]
    # penalties come before the bias: (x / 2 or x * 2) + 1
    assert out[3, 1].item() == pytest.approx(_rep(logits[3, 1].item(), 2.0) + 1.0, abs=1e-6)
    plain = logits.clone()
    assert apply_processing(plain, [RowContext(None, ())] * 4) is plain  # nothing to do: no copy at all


def test_bad_words_ban_the_last_token_after_the_prefix() -> None:
    words = [[9], [1, 2], [3, 4, 5]]
    assert banned_words(words, []) == [9]
    assert banned_words(words, [7, 1]) == [9, 2]
    assert banned_words(words, [3, 4]) == [9, 5]
    assert banned_words(words, [4, 3]) == [9]


def test_processed_distribution_for_rejection_sampling() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.5, top_k=5), SamplingParams(temperature=0), SamplingParams(top_p=0.5)]
    t = SamplingTensors.from_params(params, [0, 0, 0])
    probs = processed_probs(logits, t)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    top5 = (logits[0] / 0.5).topk(5)
    expected = torch.zeros(V).scatter_(0, top5.indices, top5.values.softmax(-1))
    torch.testing.assert_close(probs[0], expected)
    assert probs[1].argmax() == logits[1].argmax() and probs[1].max() == 1.0
    lp = processed_logprobs(logits, t)
    torch.testing.assert_close(lp[1], logits[1].log_softmax(-1))
    assert torch.isinf(lp[0]).sum() == V - 5


@pytest.mark.parametrize("so,fragment", [
    (StructuredOutputsParams(json={"type": "wat"}), "invalid structured_outputs.json"),
    (StructuredOutputsParams(json="{oops"), "not valid JSON"),
    (StructuredOutputsParams(regex="[a-"), "invalid structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= nothing_here"), "invalid structured_outputs.grammar"),
])
def test_invalid_constraints_name_the_problem(so: StructuredOutputsParams, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        validate(so)


def test_constraint_params_validate() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).key == StructuredOutputsParams(json='{"a": 2, "b": 1}').key
    for so in (StructuredOutputsParams(json_object=True), StructuredOutputsParams(choice=["x", "y"]),
               StructuredOutputsParams(regex=r"\d+"), StructuredOutputsParams(grammar='root ::= "a" | "b"')):
        validate(so)


def test_sampling_params_new_fields_validate() -> None:
    with pytest.raises(ValueError, match="presence_penalty must be in"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="repetition_penalty must be"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={1: -101.0})
    with pytest.raises(ValueError, match="best_of must be >= n"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer >= 0"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="logit_bias: token ids must be in"):
        SamplingParams(logit_bias={"400": 1}).check_token_ids(320)  # type: ignore[dict-item]
    assert SamplingParams(logit_bias={"7": 1}).logit_bias == {7: 1.0}  # type: ignore[dict-item]
    assert SamplingParams(frequency_penalty=0.1).depends_on_history
    assert not SamplingParams(logit_bias={1: 1.0}).depends_on_history  # stateless: drafts stay allowed
    assert SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")).depends_on_history


def test_small_top_k_path_equals_the_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagellm.sample import sampler

    gen = torch.Generator().manual_seed(5)
    for trial in range(20):
        logits = (torch.randn(6, 300, generator=gen) * 2).round() / 2  # coarse values: many ties
        top_k = torch.randint(1, 40, (6,), generator=gen)
        top_k[0] = 0 if trial % 4 == 1 else top_k[0]  # a row without top-k (only top-p) forces the full sort
        top_p = torch.rand(6, generator=gen) * 0.5 + 0.5
        fast = sampler.apply_top_k_top_p(logits, top_k, top_p if trial % 3 else None)
        monkeypatch.setattr(sampler, "_SMALL_TOP_K", 0)
        full = sampler.apply_top_k_top_p(logits, top_k, top_p if trial % 3 else None)
        monkeypatch.undo()
        assert torch.equal(fast, full), trial
        if trial % 4 != 1:
            assert sampler._small_top_k(logits, top_k, top_p if trial % 3 else None) is not None  # ties too
