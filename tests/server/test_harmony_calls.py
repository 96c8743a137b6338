"""gpt-oss's forced tool calls (``server/openai/harmony_calls.py``): the constraint takes the call forms gpt-oss
writes, with or without its analysis and a preamble, and nothing that is not one call of the tools allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr
from test_harmony import TOOLS, build_harmony_model

from pagellm.sample.structured import GrammarCache
from pagellm.server.openai import harmony_calls
from pagellm.structured_outputs import StructuredOutputsParams
from pagellm.tokenizer import Tokenizer

LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}}}
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
PREAMBLE = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
WEATHER = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
WEATHER_BEFORE = ' to=functions.get_weather<|channel|>analysis json<|message|>{"city": "Paris"}<|call|>'
LOOKUP_CALL = '<|channel|>commentary to=functions.lookup json<|message|>{"q": 3}<|call|>'
FINAL = "<|channel|>final<|message|>It is sunny.<|return|>"
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def harmony_model(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_harmony_model(tiny_model_factory("gpt_oss"), tmp_path_factory.mktemp("harmony-calls"))


def _follows(model: Path, reply: str, tool_choice: object = "required", opened: str | None = None,
             after_end: bool = False) -> bool:
    """Whether ``reply`` follows the forced call's constraint to its end (a stop token)."""
    tokenizer = Tokenizer.from_dir(model)
    ids = harmony_calls.markers(lambda text: tokenizer.encode(text, add_special_tokens=False))
    tag = harmony_calls.call_tag([*TOOLS, LOOKUP], tool_choice, ids, opened, after_end)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    compiled = GrammarCache.from_model_dir(model, vocab_size).compile(StructuredOutputsParams(structural_tag=tag))
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in tokenizer.encode(reply, add_special_tokens=False)) \
        and matcher.is_terminated()


@pytest.mark.parametrize("reply", [ANALYSIS + WEATHER, WEATHER, ANALYSIS + PREAMBLE + WEATHER_BEFORE, LOOKUP_CALL,
                                   WEATHER.replace("<|call|>", "<|return|>")])
def test_a_required_call_may_think_and_announce_first(harmony_model: Path, reply: str) -> None:
    assert _follows(harmony_model, reply)


@pytest.mark.parametrize("reply", [FINAL, ANALYSIS + FINAL, WEATHER.replace("Paris\"}", "Paris\", \"x\": 1}"),
                                   LOOKUP_CALL.replace("3", '"three"'), WEATHER.replace("functions.", "browser."),
                                   WEATHER.replace("<|message|>", " <|message|>"), ANALYSIS + PREAMBLE,
                                   WEATHER.replace("Paris", "Pa<|end|>ris"), WEATHER.replace('": "', '":  "')])
def test_what_is_not_one_call_as_allowed_is_refused(harmony_model: Path, reply: str) -> None:
    assert not _follows(harmony_model, reply)


def test_a_named_call_takes_that_function_only(harmony_model: Path) -> None:
    assert _follows(harmony_model, ANALYSIS + WEATHER, NAMED)
    assert not _follows(harmony_model, LOOKUP_CALL, NAMED) and _follows(harmony_model, LOOKUP_CALL)


def test_the_prompt_decides_where_the_reply_starts(harmony_model: Path) -> None:
    """After a closed message the reply opens with its own start; inside an opened analysis it goes on with its
    text; a prompt that opened another message cannot be forced into a call."""
    assert _follows(harmony_model, "<|start|>assistant" + WEATHER, after_end=True)
    assert not _follows(harmony_model, WEATHER, after_end=True)
    opened = "<|start|>assistant<|channel|>analysis"
    assert _follows(harmony_model, "Weather, then.<|end|><|start|>assistant" + WEATHER, opened=opened)
    assert not _follows(harmony_model, WEATHER, opened=opened)
    with pytest.raises(ValueError, match="not the analysis message"):
        _follows(harmony_model, WEATHER, opened="<|start|>assistant<|channel|>final")


def test_a_tokenizer_without_harmonys_tokens_is_named() -> None:
    with pytest.raises(ValueError, match=r"no special token <\|start\|>: a forced tool call needs gpt-oss's harmony"):
        harmony_calls.markers(lambda text: list(json.dumps(text).encode()))
