"""Custom logits processors (``logits_processors`` / ``--logits-processors``): requests opt in through their
``extra_args``; each form of function (with or without the prompt) sees the right tokens, in any batch, chunked,
preempted and on parallel ranks; others are untouched; bad names and parameters are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from custom_processors import NoPromptTokens, NoRepeats, Sharpen, TargetToken

from pagellm import LLM, SamplingParams
from pagellm.sample.custom import RequestFunctions

PROCESSORS = ["custom_processors:TargetToken", "custom_processors.NoPromptTokens", NoRepeats]


def _prompts(seed: int, count: int = 4) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in torch.randint(5, 60, (count,),
                                                                                            generator=gen)]


def _greedy(**extra_args) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, extra_args=extra_args or None)


def _tokens(llm: LLM, prompts: list, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32")


@pytest.fixture(scope="module")
def custom(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", logits_processors=PROCESSORS, max_num_batched_tokens=32)


def test_only_the_requests_that_opt_in_are_processed(plain: LLM, custom: LLM) -> None:
    prompts = _prompts(1)
    params = [_greedy(target_token=65), _greedy(), _greedy(target_token=66), _greedy(other="ignored")]
    got = _tokens(custom, prompts, params)
    expected = _tokens(plain, prompts, _greedy())
    assert got[0] == [65] * 16 and got[2] == [66] * 16
    assert got[1] == expected[1] and got[3] == expected[3]  # no opt-in: exactly what no processor gives


def test_sampled_requests_are_processed_too(custom: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, extra_args={"target_token": 7})
    assert _tokens(custom, _prompts(2, 2), params) == [[7] * 16] * 2


def test_the_prompt_form_sees_the_prompt(plain: LLM, custom: LLM, tiny_llama: Path) -> None:
    """Banning the prompt's tokens is what ``allowed_token_ids`` without them does: the same tokens exactly."""
    prompts = _prompts(3)
    got = _tokens(custom, prompts, _greedy(no_prompt_tokens=True))
    for prompt, tokens in zip(prompts, got):
        allowed = sorted(set(range(320)) - set(prompt))
        expected = _tokens(plain, [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                            allowed_token_ids=allowed))[0]
        assert tokens == expected and not set(tokens) & set(prompt)


def test_history_is_seen_under_preemption(tiny_llama: Path) -> None:
    """The output so far reaches the function, also after a preempted request is recomputed."""
    llm = LLM(str(tiny_llama), dtype="float32", logits_processors=[NoRepeats], max_model_len=160,
              kv_cache_memory=12 * 16 * 512)
    prompts = [(p * 4)[:31] for p in _prompts(4, 6)]  # a token short of two full blocks: outputs need new ones
    outputs = _tokens(llm, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                   extra_args={"no_repeats": True}))
    assert sum(s.num_preemptions for s in llm.last_stats) > 0, "the pool was meant to force preemptions"
    assert all(len(set(tokens)) == len(tokens) == 40 for tokens in outputs)
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_argmax_invariant_processors_skip_greedy_requests() -> None:
    sharpen = Sharpen(320)
    assert RequestFunctions.for_request([sharpen], _greedy(), []) is None
    functions = RequestFunctions.for_request([sharpen], SamplingParams(temperature=0.7), [1, 2])
    assert functions is not None
    assert torch.equal(functions.apply(torch.ones(320), []), torch.full((320,), 2.0))


def test_parameters_a_processor_refuses_are_errors(custom: LLM) -> None:
    with pytest.raises(ValueError, match="target_token must be a token id"):
        custom.generate([[1, 2, 3]], _greedy(target_token="a"), use_tqdm=False)


@pytest.mark.parametrize("names,message", [
    (["custom_processors:Missing"], "cannot be imported"),
    (["no_such_module:Thing"], "cannot be imported"),
    (["custom_processors:NotAProcessor"], "not a subclass of pagellm.sample.custom.AdapterLogitsProcessor"),
    (["NoDots"], "name it as package.module:Name"),
])
def test_bad_processor_names_are_refused_at_start(tiny_llama: Path, names: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), dtype="float32", logits_processors=names)


def test_not_with_speculative_decoding(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="speculative decoding"):
        LLM(str(tiny_llama), logits_processors=[TargetToken],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_a_processor_that_returns_the_wrong_shape_fails_the_step(tiny_llama: Path, monkeypatch) -> None:
    monkeypatch.setattr(NoPromptTokens, "new_req_logits_processor", lambda self, params: lambda o, row: row[:5])
    llm = LLM(str(tiny_llama), dtype="float32", logits_processors=[NoPromptTokens])
    with pytest.raises(ValueError, match="it must return the row it was given"):
        llm.generate([[1, 2, 3]], _greedy(), use_tqdm=False)


def test_processors_run_on_tensor_parallel_ranks(plain: LLM, tiny_llama: Path) -> None:
    """Workers in processes of their own import the processors by name."""
    prompts = _prompts(5, 2)
    llm = LLM(str(tiny_llama), dtype="float32", logits_processors=PROCESSORS[:2], tensor_parallel_size=2)
    try:
        got = _tokens(llm, prompts, [_greedy(target_token=9), _greedy(no_prompt_tokens=True)])
    finally:
        llm.shutdown()
    assert got[0] == [9] * 16
    allowed = sorted(set(range(320)) - set(prompts[1]))
    assert got[1] == _tokens(plain, [prompts[1]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                                 allowed_token_ids=allowed))[0]
