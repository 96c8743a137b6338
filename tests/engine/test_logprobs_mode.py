"""``logprobs_mode`` (vLLM's ``--logprobs-mode``): raw logits equal transformers' logits, processed logits are the
logits the sampler draws from (temperature applied, filtered tokens -inf), processed logprobs the log of that
distribution; the engine's default applies to requests that choose none."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams

TOL = 1e-4


def _prompt(seed: int = 0, length: int = 20) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(model_dir: Path, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V] transformers' logits for each generated token's prefix (float32)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) + len(generated) - 1]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32")


def test_raw_logits_are_the_models_logits(llm: LLM, tiny_llama: Path) -> None:
    prompt = _prompt()
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True, logprobs=5,
                            logprobs_mode="raw_logits", repetition_penalty=1.5)  # processing changes nothing here
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ref = _hf_logits(tiny_llama, prompt, out.token_ids)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top_values, top_ids = ref[step].topk(5)
        assert list(entry)[:5] == top_ids.tolist()
        for tid, value in zip(top_ids.tolist(), top_values.tolist()):
            assert abs(entry[tid].logprob - value) < TOL
        assert abs(entry[token].logprob - ref[step, token].item()) < TOL
    assert abs(torch.logsumexp(ref[0], dim=-1).item()) > 0.01  # logits, not normalised: the modes differ


def test_processed_logits_are_what_the_sampler_draws_from(llm: LLM, tiny_llama: Path) -> None:
    """At temperature 0.5 with top_k 4: the four kept tokens' logits halved, the fifth -inf."""
    prompt = _prompt(1)
    params = SamplingParams(temperature=0.5, top_k=4, seed=2, max_tokens=6, ignore_eos=True, logprobs=5,
                            logprobs_mode="processed_logits")
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ref = _hf_logits(tiny_llama, prompt, out.token_ids)
    for step, entry in enumerate(out.logprobs):
        top_values, top_ids = ref[step].topk(4)
        values = [entry[tid].logprob for tid in top_ids.tolist()]
        assert all(abs(v - 2 * r) < 2 * TOL for v, r in zip(values, top_values.tolist()))
        fifth = [lp.logprob for tid, lp in entry.items() if tid not in top_ids.tolist()]
        assert fifth and all(v == -math.inf for v in fifth)


def test_processed_logprobs_are_the_log_of_the_sampling_distribution(llm: LLM) -> None:
    prompt = _prompt(2)
    common = dict(temperature=0.5, top_k=4, seed=3, max_tokens=6, ignore_eos=True, logprobs=4)
    logits = llm.generate([prompt], SamplingParams(**common, logprobs_mode="processed_logits"),
                          use_tqdm=False)[0].outputs[0]
    logprobs = llm.generate([prompt], SamplingParams(**common, logprobs_mode="processed_logprobs"),
                            use_tqdm=False)[0].outputs[0]
    assert logits.token_ids == logprobs.token_ids  # the mode changes what is reported, never what is sampled
    for a, b in zip(logits.logprobs, logprobs.logprobs):
        row = torch.tensor([a[t].logprob for t in a])
        expected = torch.log_softmax(row, dim=-1)  # the four kept tokens hold the whole distribution
        assert torch.allclose(torch.tensor([b[t].logprob for t in a]), expected, atol=TOL)


def test_the_engines_default_applies_where_a_request_chooses_none(tiny_llama: Path, llm: LLM) -> None:
    engine = LLM(str(tiny_llama), dtype="float32", logprobs_mode="raw_logits")
    prompt = _prompt(3)
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    by_default = engine.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    asked = llm.generate([prompt], SamplingParams(**greedy, logprobs_mode="raw_logits"), use_tqdm=False)[0].outputs[0]
    own = engine.generate([prompt], SamplingParams(**greedy, logprobs_mode="raw_logprobs"),
                          use_tqdm=False)[0].outputs[0]
    plain = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    assert [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in by_default.logprobs] == \
        [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in asked.logprobs]
    assert [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in own.logprobs] == \
        [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in plain.logprobs]
    with pytest.raises(ValueError, match="best_of > n ranks candidates by their logprobs"):
        engine.generate([prompt], SamplingParams(temperature=1.0, n=1, best_of=2), use_tqdm=False)


def test_unknown_modes_are_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="logprobs_mode must be one of raw_logprobs, processed_logprobs"):
        SamplingParams(logprobs_mode="logits")
    with pytest.raises(ValueError, match="logprobs_mode='probs'; use one of"):
        LLM(str(tiny_llama), logprobs_mode="probs")
