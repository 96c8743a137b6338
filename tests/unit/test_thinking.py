"""A thinking budget (vLLM's ``thinking_token_budget``): one request's count of thinking tokens as its tokens arrive,
the tokens it forces once spent, the same state rebuilt from a whole output, the reasoning config's tags, and the
parameter's checks."""

from __future__ import annotations

import random

import pytest
import torch

from pagellm import SamplingParams
from pagellm.sample.logits_processors import RequestProcessing, RowContext, apply_processing
from pagellm.thinking import ReasoningConfig, ThinkingBudget, ThinkingMarkers

# A start tag of two tokens; a forced end of three (a transition phrase, then the end tag 7); the end tag alone.
TAGS = ThinkingMarkers(start=[1, 2], forced_end=[9, 8, 7], end=[7])


def _feed(budget: ThinkingBudget, tokens: list[int]) -> list[int | None]:
    """What ``forced()`` said before each token, feeding them one by one."""
    said = []
    for token in tokens:
        said.append(budget.forced())
        budget.observe([token])
    return said


def test_a_spent_budget_forces_the_end_string_token_by_token_then_lets_go() -> None:
    budget = ThinkingBudget(2, TAGS, [5, 1, 2])  # the prompt opened the block
    assert _feed(budget, [30, 31, 9, 8, 7, 40, 41]) == [None, None, 9, 8, 7, None, None]
    assert not budget.thinking and budget.forced() is None


def test_thinking_tokens_in_the_prompt_count() -> None:
    assert ThinkingBudget(2, TAGS, [1, 2, 40, 41]).forced() == 9
    assert ThinkingBudget(3, TAGS, [1, 2, 40, 41]).forced() is None
    assert ThinkingBudget(0, TAGS, [3, 1, 2]).forced() == 9  # a budget of 0: the end at once


@pytest.mark.parametrize("prompt", [[5, 6], [1, 2, 30, 7], [1, 2, 7, 1]])
def test_no_open_block_forces_nothing(prompt: list[int]) -> None:
    """No start tag, a closed block, and a start tag cut short are not thinking."""
    budget = ThinkingBudget(0, TAGS, prompt)
    assert _feed(budget, [30, 31, 32]) == [None, None, None] and not budget.thinking


def test_a_block_the_model_opens_and_closes_itself_starts_a_new_count_each_time() -> None:
    budget = ThinkingBudget(2, TAGS, [5])
    said = _feed(budget, [1, 2, 30, 7, 40, 1, 2, 50, 51, 9, 8, 7, 60])
    assert said == [None] * 9 + [9, 8, 7, None]  # the first block ended within its budget; the second ran out


def test_the_state_rebuilt_from_a_whole_output_is_the_one_fed_token_by_token() -> None:
    """A preempted request's processing is rebuilt from its tokens: it must land in the same state."""
    rng = random.Random(7)
    for _ in range(200):
        prompt = [rng.choice([1, 2, 7, 9, 30]) for _ in range(rng.randint(0, 6))]
        fed = ThinkingBudget(rng.randint(0, 3), TAGS, prompt)
        output = []
        for _ in range(rng.randint(0, 12)):
            token = fed.forced() or rng.choice([1, 2, 7, 8, 9, 30])
            output.append(token)
            fed.observe([token])
            whole = ThinkingBudget(fed.budget, TAGS, prompt, output)
            assert (whole.thinking, whole.count, whole.forcing) == (fed.thinking, fed.count, fed.forcing)


def test_forced_rows_keep_only_their_token_and_others_are_untouched() -> None:
    params = SamplingParams(thinking_token_budget=1, thinking_markers=TAGS)
    spent = RequestProcessing.create(params, [1, 2, 30], [], vocab_size=16, grammars=None)
    lasting = RequestProcessing.create(params, [1, 2], [], vocab_size=16, grammars=None)
    logits = torch.randn(3, 16)
    out = apply_processing(logits.clone(), [RowContext(spent, []), RowContext(lasting, []), RowContext(None, [])])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [9] and out[0, 9] == 0
    assert torch.equal(out[1:], logits[1:])


def test_the_parameter_takes_vllm_values() -> None:
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # -1: no cap
    assert SamplingParams(thinking_token_budget=0).depends_on_history  # no drafts: every token is counted
    assert not SamplingParams().depends_on_history
    for bad, message in ((-2, "must be an integer >= 0"), (True, "must be an integer"), (1.5, "must be an integer")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(thinking_token_budget=bad)


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_the_reasoning_config_takes_a_parsers_tags_and_its_own_strings() -> None:
    qwen3 = ReasoningConfig.parse(None, reasoning_parser="qwen3").markers(_encode)
    assert qwen3 == ThinkingMarkers(_encode("<think>"), _encode("</think>"), _encode("</think>"))
    phrase = ReasoningConfig.parse('{"reasoning_parser": "qwen3", "reasoning_end_str": "Done.</think>"}')
    assert phrase.markers(_encode) == ThinkingMarkers(_encode("<think>"), _encode("Done.</think>"),
                                                       _encode("</think>"))  # the parser's tag ends a block
    own = ReasoningConfig.parse({"reasoning_start_str": "[T]", "reasoning_end_str": "[/T]"}).markers(_encode)
    assert own == ThinkingMarkers(_encode("[T]"), _encode("[/T]"), _encode("[/T]"))
    assert ReasoningConfig().markers(_encode) is None


@pytest.mark.parametrize(("value", "message"), [
    ('{"think_start_str": "<think>"}', r"unknown keys \['think_start_str'\]"),
    ("{nope", "not valid JSON"),
    ('{"reasoning_start_str": "<think>"}', "give both reasoning_start_str and reasoning_end_str"),
    ('["<think>"]', "must be a JSON object"),
])
def test_a_bad_reasoning_config_says_what_to_fix(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReasoningConfig.parse(value)


def test_an_unknown_parser_is_named_when_its_tags_are_needed() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'kimi_k2'"):
        ReasoningConfig(reasoning_parser="kimi_k2").markers(_encode)


def test_the_flags_and_engine_args_reach_the_engine_config() -> None:
    import argparse

    from pagellm.config import EngineConfig
    from pagellm.engine_args import EngineArgs, add_engine_args, engine_kwargs

    cmd = argparse.ArgumentParser()
    add_engine_args(cmd)
    args = cmd.parse_args(["--reasoning-config", '{"reasoning_start_str": "[T]", "reasoning_end_str": "[/T]"}'])
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert config.reasoning_config == ReasoningConfig("", "[T]", "[/T]")
    args.reasoning_parser = "qwen3"  # ``pagellm serve``'s own --reasoning-parser, in the same namespace
    assert EngineConfig.from_kwargs(**engine_kwargs(args)).reasoning_config.reasoning_parser == "qwen3"
    parsed = EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--reasoning-parser", "deepseek_r1"]))
    assert parsed.create_engine_config().reasoning_config == ReasoningConfig(reasoning_parser="deepseek_r1")
