"""Sampling parameters end to end on a tiny random model, each against a reference computed step by step from
transformers' logits with plain PyTorch: penalties, logit_bias, bad_words, allowed_token_ids, min_tokens,
seeded random sampling with every filter, prompt / processed logprobs, n and best_of, and seeded
reproducibility whatever the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.sample.logits_processors import banned_words
from pagellm.sample.penalties import apply_penalties_reference
from pagellm.sample.sampler import mix_seed

EOS = 257
TOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory=8_000_000)


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _next_logits(hf: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def _processed(logits: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The documented order, written out plainly: penalties, bias, bans (allowed ids, bad words, min_tokens)."""
    x = apply_penalties_reference(logits, prompt, out, p.repetition_penalty, p.presence_penalty,
                                  p.frequency_penalty)
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    if p.allowed_token_ids:
        keep = torch.full_like(x, float("-inf"))
        keep[p.allowed_token_ids] = 0.0
        x = x + keep
    for token in banned_words(p.bad_words_token_ids or [], out):
        x[token] = float("-inf")
    if len(out) < p.min_tokens:
        x[[EOS, *p.stop_token_ids]] = float("-inf")
    return x


def _reference_greedy(hf: transformers.PreTrainedModel, prompt: list[int], p: SamplingParams) -> list[int]:
    out: list[int] = []
    while len(out) < (p.max_tokens or 0):
        token = int(_processed(_next_logits(hf, prompt + out), p, prompt, out).argmax())
        out.append(token)
        if token == EOS and not p.ignore_eos:
            break
    return out


def _reference_random(hf: transformers.PreTrainedModel, prompt: list[int], p: SamplingParams) -> list[int]:
    """Temperature, top-k, top-p (smallest prefix reaching the mass), min-p, then the inverse CDF at the
    request's (seed, position) uniform."""
    out: list[int] = []
    while len(out) < (p.max_tokens or 0):
        x = _processed(_next_logits(hf, prompt + out), p, prompt, out) / p.temperature
        values, order = x.sort(descending=True, stable=True)
        if p.top_k:
            values[p.top_k:] = float("-inf")
        probs = values.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        values[(mass_before >= p.top_p) & (torch.arange(len(values)) > 0)] = float("-inf")
        probs = torch.zeros_like(x).scatter_(0, order, values.softmax(-1))
        probs[probs < probs.max() * p.min_p] = 0.0
        u = torch.rand((), generator=torch.Generator().manual_seed(mix_seed(p.seed or 0, len(out))))
        cdf = probs.cumsum(-1)
        token = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True).clamp(max=len(cdf) - 1))
        out.append(token)
        if token == EOS and not p.ignore_eos:
            break
    return out


PROMPTS = [[72, 101, 108, 108, 111], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [200, 13, 13, 13, 40]]


def _cases(llm: LLM) -> list[SamplingParams]:
    greedy = dict(temperature=0.0, max_tokens=14, ignore_eos=True)
    cases = [
        SamplingParams(**greedy, repetition_penalty=1.6, presence_penalty=0.4, frequency_penalty=0.8),
        SamplingParams(**greedy, logit_bias={97: 4.0, 98: 2.5, 99: -100.0}, bad_words=["ab", "q"]),
        SamplingParams(temperature=0.0, max_tokens=14, allowed_token_ids=list(range(97, 123)) + [EOS],
                       min_tokens=6, frequency_penalty=-1.0),
        SamplingParams(**greedy, repetition_penalty=0.6),
        SamplingParams(**greedy),
    ]
    return [llm.input_processor.prepare_params(p) for p in cases]  # bad_words → token ids, as the engine does


def test_greedy_processing_matches_reference(llm: LLM, hf: transformers.PreTrainedModel) -> None:
    cases = _cases(llm)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))]
    outs = llm.generate(prompts, cases, use_tqdm=False)
    for prompt, params, out in zip(prompts, cases, outs):
        assert out.outputs[0].token_ids == _reference_greedy(hf, prompt, params), params
    # the cases really constrain: bias wins, banned ids never appear, allowed ids only, no EOS before min_tokens
    assert 99 not in outs[1].outputs[0].token_ids and 113 not in outs[1].outputs[0].token_ids
    assert set(outs[2].outputs[0].token_ids) <= set(range(97, 123)) | {EOS}
    assert EOS not in outs[2].outputs[0].token_ids[:6]


def test_penalties_over_a_long_generation_of_many_distinct_tokens(llm: LLM, hf: transformers.PreTrainedModel) -> None:
    """A request's seen-token arrays grow as it generates (room for 64 more than it starts with): a penalised
    generation past that point must go on, and still match the reference. (It once crashed the engine core.)"""
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=0.5)
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(set(tokens)) > 70  # past the first capacity of 64 + 0 output tokens (no repetition penalty)
    assert tokens == _reference_greedy(hf, PROMPTS[0], params)


@pytest.mark.parametrize("extra", [dict(top_k=20, top_p=0.9, min_p=0.05, frequency_penalty=0.5),
                                   dict(top_p=0.7, repetition_penalty=1.3, logit_bias={101: 2.0}),
                                   dict(min_p=0.2, presence_penalty=-0.5)])
def test_seeded_random_processing_matches_reference(llm: LLM, hf: transformers.PreTrainedModel,
                                                    extra: dict) -> None:
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True, **extra)
    others = [SamplingParams(temperature=1.0, max_tokens=12), SamplingParams(temperature=0, max_tokens=5)]
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [params, *others], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == _reference_random(hf, PROMPTS[0], params)


def test_seed_gives_the_same_output_in_any_batch(tiny_llama: Path) -> None:
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True,
                            presence_penalty=0.3)
    filler = [SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True, frequency_penalty=0.2) for n in (3, 20)]
    alone = LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory=4_000_000)
    ref = alone.generate([PROMPTS[1]], target, use_tqdm=False)[0].outputs[0].token_ids
    mixed = alone.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [filler[0], target, filler[1]],
                           use_tqdm=False)[1].outputs[0].token_ids
    small = LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory=4_000_000, max_num_seqs=2,
                max_num_batched_tokens=8)
    squeezed = small.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [filler[1], filler[0], target],
                              use_tqdm=False)[2].outputs[0].token_ids
    assert ref == mixed == squeezed


def test_prompt_logprobs_match_transformers(tiny_llama: Path, hf: transformers.PreTrainedModel) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory=4_000_000,
              max_num_batched_tokens=16)  # the prompt is scored over several chunks
    prompt = list(range(30, 70))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm the prefix cache
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[i], ref[i - 1]
        assert entry is not None
        assert entry[prompt[i]].logprob == pytest.approx(row[prompt[i]].item(), abs=TOL)
        assert entry[prompt[i]].rank == int((row > row[prompt[i]]).sum()) + 1
        assert list(entry)[:3] == row.topk(3).indices.tolist()


def test_processed_logprobs_describe_the_sampling_distribution(llm: LLM,
                                                               hf: transformers.PreTrainedModel) -> None:
    params = SamplingParams(temperature=0.5, seed=3, max_tokens=4, ignore_eos=True, logprobs=2,
                            processed_logprobs=True, logit_bias={50: 3.0})
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    for step, token in enumerate(out.token_ids):
        x = _processed(_next_logits(hf, PROMPTS[0] + out.token_ids[:step]), params, PROMPTS[0],
                       out.token_ids[:step])
        expected = (x / 0.5).log_softmax(-1)
        assert out.logprobs is not None
        assert out.logprobs[step][token].logprob == pytest.approx(expected[token].item(), abs=TOL)


def test_n_and_best_of_offline(llm: LLM) -> None:
    base = dict(temperature=1.0, seed=21, max_tokens=8, ignore_eos=True)
    three = llm.generate([PROMPTS[0]], SamplingParams(n=3, **base), use_tqdm=False)[0]
    assert [c.index for c in three.outputs] == [0, 1, 2]
    singles = [llm.generate([PROMPTS[0]], SamplingParams(**{**base, "seed": 21 + i}), use_tqdm=False)[0]
               for i in range(3)]
    assert [c.token_ids for c in three.outputs] == [s.outputs[0].token_ids for s in singles]

    candidates = llm.generate([PROMPTS[0]], SamplingParams(n=4, logprobs=0, **base), use_tqdm=False)[0].outputs
    best = llm.generate([PROMPTS[0]], SamplingParams(n=2, best_of=4, **base), use_tqdm=False)[0].outputs
    ranked = sorted(candidates, key=lambda c: -(c.cumulative_logprob or 0.0))[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1] and all(c.logprobs is None for c in best)
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob  # type: ignore[operator]


def test_min_tokens_and_stop_token_ids(llm: LLM, hf: transformers.PreTrainedModel) -> None:
    greedy = _reference_greedy(hf, PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop_at = greedy[2]
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                    stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[:greedy.index(stop_at) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)
    late = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=8,
                                                     stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    ref = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=8, stop_token_ids=[stop_at])
    expected = _reference_greedy(hf, PROMPTS[2], ref)
    cut = next((i for i, t in enumerate(expected) if t == stop_at and i >= 7), len(expected) - 1)
    assert late.token_ids == expected[:cut + 1]
