"""``thinking_token_budget`` offline (vLLM's): a request whose prompt opened a thinking block thinks as the model would
for its budget, then writes the configured end string, then goes on as the model would after it; outputs without an
open block are untouched; it holds under speculation and preemption, and without thinking tags it is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams

TAGS = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
FREE = dict(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", reasoning_config=TAGS)


def _tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def _encode(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_the_budget_ends_the_block_and_the_model_goes_on_from_there(llm: LLM) -> None:
    end = _encode(llm, "</think>")
    opened, counted = _encode(llm, "Q: 2+2? <think>"), _encode(llm, "Q: 2+2? <think>ab")  # 2 thinking in the prompt
    plain, three, one = _tokens(llm, [opened, opened, counted], [
        SamplingParams(**FREE), SamplingParams(**FREE, thinking_token_budget=3),
        SamplingParams(**FREE, thinking_token_budget=3)])
    assert three[:3] == plain[:3] and three[3:3 + len(end)] == end
    assert one[1:1 + len(end)] == end  # the prompt's two thinking tokens count
    after = 3 + len(end)  # once the block is closed, the output is the model's own again
    (rest,) = _tokens(llm, [opened + three[:after]], [SamplingParams(**{**FREE, "max_tokens": 24 - after})])
    assert three[after:] == rest


def test_outputs_without_an_open_block_are_untouched(llm: LLM) -> None:
    prompts = [_encode(llm, "Q: 2+2?"), _encode(llm, "<think>x</think> Q:"), _encode(llm, "<think>x")]
    plain = _tokens(llm, prompts, [SamplingParams(**FREE)] * 3)
    budgeted = _tokens(llm, prompts, [SamplingParams(**FREE, thinking_token_budget=0)] * 2
                       + [SamplingParams(**FREE, thinking_token_budget=-1)])  # -1: no cap
    assert budgeted == plain


def test_the_same_under_speculation_and_preemption(tiny_llama: Path, llm: LLM) -> None:
    """Budgeted requests get no drafts (every token is counted) and are rebuilt from their tokens when preempted;
    the others keep drafting."""
    prompts = [_encode(llm, f"Question {i}: <think>") for i in range(4)]
    # the last to come are preempted first: the budgeted ones
    params = [SamplingParams(**{**FREE, "max_tokens": 40})] \
        + [SamplingParams(**{**FREE, "max_tokens": 40}, thinking_token_budget=i * 3) for i in range(3)]
    expected = _tokens(llm, prompts, params)
    spec = LLM(str(tiny_llama), dtype="float32", reasoning_parser="qwen3", max_model_len=160,
               kv_cache_memory=12 * 16 * 512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    results = spec.generate(prompts, params, use_tqdm=False)
    assert [list(r.outputs[0].token_ids) for r in results] == expected
    assert sum(s.num_preemptions for s in spec.last_stats) > 0, "the pool was meant to force preemptions"
    assert [r.metrics.num_draft_tokens > 0 for r in results] == [True, False, False, False]
    kv = spec.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_without_thinking_tags_a_budget_is_refused_by_name(tiny_llama: Path) -> None:
    plain = LLM(str(tiny_llama), dtype="float32")
    with pytest.raises(ValueError, match="thinking_token_budget needs the model's thinking tags.*--reasoning-parser"):
        plain.generate([[1, 2, 3]], SamplingParams(thinking_token_budget=4), use_tqdm=False)
    assert plain.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"reasoning_config: unknown keys \['think_end_str'\]"):
        LLM(str(tiny_llama), reasoning_config={"think_end_str": "</think>"})
