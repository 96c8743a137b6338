"""A reasoning model's thinking tags, and a budget on its thinking (vLLM's ``thinking_token_budget``).

Contract:
- ``ReasoningParser`` names a thinking block's tags (``<think>`` ... ``</think>``; Granite's are phrases, in two
  spellings each); ``PARSERS`` holds them by ``--reasoning-parser`` name (``deepseek_r1``, ``qwen3``, ``olmo3``,
  ``granite``, ``openai_gptoss``: gpt-oss's analysis message, and what a ``--reasoning-parser-plugin`` file registers
  with ``register_reasoning_parser``). The server's reply splitting (``server/openai/reasoning.py``; gpt-oss's,
  ``harmony.py``) reads them.
- ``ReasoningConfig`` is vLLM's ``--reasoning-config`` (``reasoning_parser``, ``reasoning_start_str``,
  ``reasoning_end_str``; ``--reasoning-parser`` fills ``reasoning_parser``): the strings that open a thinking block,
  the one written when a budget runs out (it may hold a transition phrase before the parser's end tag), and the
  parser's end tag, which ends a block the model closes itself. ``markers(encode)`` tokenizes them once.
- A request's ``thinking_token_budget`` (``SamplingParams``; -1 means none) caps the tokens inside a thinking block:
  a block is open while the last start tag of the prompt and output so far comes after the last end tag, and its
  tokens are those after the start tag, the prompt's included (a template that opens the block in the prompt
  counts from there). Once a block holds ``budget`` tokens, the end string's tokens are forced one per step (every
  other token's logit -inf), which closes it; a later block starts a new count. ``ThinkingBudget`` is one request's
  count, rebuilt from its prompt and output (so preemption changes nothing) and fed each accepted token.
- Tags are matched as token-id sequences, as vLLM does: a tag the model spells in other tokens is not seen.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

START, END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """A thinking block's tags, and whether a reply thinks without opening one (its template opened it); what a
    spent budget forces (``forced_end``: the end tag by default) and where a constrained answer begins
    (``answer_start``: after the end tag by default); ``harmony``: gpt-oss's messages (``server/openai/harmony.py``)."""

    start: str = START
    end: str = END
    thinks_by_default: bool = False
    forced_end: str = ""
    answer_start: str = ""
    harmony: bool = False
    other_starts: tuple[str, ...] = ()  # other spellings a reply may open or close its block with (the budget and
    other_ends: tuple[str, ...] = ()  # constraints see ``start`` and ``end`` alone, as token ids)

    @property
    def starts(self) -> tuple[str, ...]:
        return (self.start, *self.other_starts)

    @property
    def ends(self) -> tuple[str, ...]:
        return (self.end, *self.other_ends)


# gpt-oss's thinking is its analysis channel's message; its answer the final channel's (``openai_gptoss``)
HARMONY = ReasoningParser("<|channel|>analysis<|message|>", "<|end|>",
                          forced_end="<|end|><|start|>assistant<|channel|>final<|message|>",
                          answer_start="<|channel|>final<|message|>", harmony=True)
# granite: Granite 3.2 / 3.3 with thinking on (chat_template_kwargs {"thinking": true}) write these phrases, some
# quantized ones "Here's" (vLLM's parser takes both)
GRANITE = ReasoningParser("Here is my thought process:", "Here is my response:",
                          other_starts=("Here's my thought process:",), other_ends=("Here's my response:",))
# olmo3: OLMo 3 Think, whose template opens <think> in the prompt (vLLM's parser starts in its reasoning state)
PARSERS: dict[str, ReasoningParser] = {"deepseek_r1": ReasoningParser(thinks_by_default=True),
                                       "qwen3": ReasoningParser(), "openai_gptoss": HARMONY,
                                       "olmo3": ReasoningParser(thinks_by_default=True), "granite": GRANITE}


def register_reasoning_parser(name: str, start: str = START, end: str = END,
                              thinks_by_default: bool = False) -> ReasoningParser:
    """What a ``--reasoning-parser-plugin`` file calls: serve the block ``start`` ... ``end`` as parser ``name``."""
    if not (isinstance(start, str) and isinstance(end, str) and start and end and start != end):
        raise ValueError(f"reasoning parser {name!r}: start and end must be two different non-empty tags")
    parser = ReasoningParser(start, end, bool(thinks_by_default))
    if PARSERS.get(name, parser) != parser:
        raise ValueError(f"a reasoning parser named {name!r} exists already; register yours as another name")
    PARSERS[name] = parser
    return parser


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(PARSERS)} (or register one "
                         "in a --reasoning-parser-plugin file)")
    return PARSERS[name]


class ThinkingMarkers(msgspec.Struct, frozen=True):
    """The token ids of a block's start tag, of what a spent budget forces, and of the tag that ends a block."""

    start: list[int]
    forced_end: list[int]
    end: list[int]


NO_CONFIG = ("thinking_token_budget needs the model's thinking tags: start the server with --reasoning-parser NAME "
             "(or --reasoning-config '{\"reasoning_start_str\": \"<think>\", \"reasoning_end_str\": \"</think>\"}'; "
             "LLM(..., reasoning_parser=NAME) offline)")


@dataclasses.dataclass(frozen=True)
class ReasoningConfig:
    """vLLM's ``--reasoning-config`` (see the module doc); empty strings take the parser's tags."""

    reasoning_parser: str = ""
    reasoning_start_str: str = ""
    reasoning_end_str: str = ""

    def __post_init__(self) -> None:
        for name in ("reasoning_parser", "reasoning_start_str", "reasoning_end_str"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"reasoning_config.{name} must be a string, got {getattr(self, name)!r}")
        if bool(self.reasoning_start_str) != bool(self.reasoning_end_str) and not self.reasoning_parser:
            raise ValueError("reasoning_config: give both reasoning_start_str and reasoning_end_str, or a "
                             "reasoning_parser whose tags fill the one left out")

    @classmethod
    def parse(cls, value: ReasoningConfig | dict[str, Any] | str | None,
              reasoning_parser: str | None = None) -> ReasoningConfig:
        """From JSON text, a dict or a config; ``reasoning_parser`` (``--reasoning-parser``) fills its parser."""
        spec: Any = value
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"reasoning_config is not valid JSON ({exc})") from None
        if isinstance(spec, ReasoningConfig):
            spec = dataclasses.asdict(spec)
        if not isinstance(spec, (dict, type(None))):
            raise ValueError(f"reasoning_config must be a JSON object, got {spec!r}")
        spec = dict(spec or {})
        unknown = sorted(set(spec) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"reasoning_config: unknown keys {unknown}; valid ones: reasoning_parser, "
                             "reasoning_start_str, reasoning_end_str")
        if reasoning_parser:
            spec["reasoning_parser"] = reasoning_parser
        return cls(**spec)

    @property
    def enabled(self) -> bool:
        return bool(self.reasoning_parser or self.reasoning_start_str)

    def markers(self, encode: Callable[[str], list[int]]) -> ThinkingMarkers | None:
        """The tags as token ids (``encode`` without special tokens); None when no tags are configured. The parser
        is looked up now, so one a plugin registers after the engine started is found."""
        if not self.enabled:
            return None
        tags = get_reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None
        start = self.reasoning_start_str or tags.start  # type: ignore[union-attr]
        forced = self.reasoning_end_str or tags.forced_end or tags.end  # type: ignore[union-attr]
        end = tags.end if tags is not None else forced
        ids = {name: encode(text) for name, text in (("start", start), ("forced_end", forced), ("end", end))}
        empty = [name for name, value in ids.items() if not value]
        if empty:
            raise ValueError(f"reasoning_config: the tags {start!r} / {forced!r} give no tokens ({', '.join(empty)})")
        return ThinkingMarkers(**ids)


def _ends_with(tail: Sequence[int], tag: Sequence[int]) -> bool:
    return len(tail) >= len(tag) and list(tail[len(tail) - len(tag):]) == list(tag)


def _last(ids: Sequence[int], tag: Sequence[int]) -> int:
    """Where the last occurrence of ``tag`` in ``ids`` begins (-1: none)."""
    for i in range(len(ids) - len(tag), -1, -1):
        if list(ids[i:i + len(tag)]) == list(tag):
            return i
    return -1


class ThinkingBudget:
    """One request's thinking count (see the module doc): ``forced()`` is the token its next step must take."""

    def __init__(self, budget: int, markers: ThinkingMarkers, prompt_ids: Sequence[int],
                 output_ids: Sequence[int] = ()) -> None:
        self.budget = budget
        self.markers = markers
        self._keep = max(len(markers.start), len(markers.end), len(markers.forced_end))
        start, end = _last(prompt_ids, markers.start), _last(prompt_ids, markers.end)
        self.thinking = start >= 0 and start > end
        self.count = len(prompt_ids) - start - len(markers.start) if self.thinking else 0
        self.forcing = 0  # how many of the forced end's tokens are out
        self._tail = list(prompt_ids[-self._keep:])
        self.observe(output_ids)

    def forced(self) -> int | None:
        """The token the next step must take, or None while the budget lasts (or no block is open)."""
        if self.thinking and (self.forcing or self.count >= self.budget):
            return self.markers.forced_end[self.forcing]
        return None

    def observe(self, token_ids: Sequence[int]) -> None:
        """Account for tokens just appended to the output."""
        for token in token_ids:
            forced = self.forced()
            self._tail = (self._tail + [token])[-self._keep:]
            if forced is not None:  # the step took its forced token
                self.forcing += 1
                if self.forcing == len(self.markers.forced_end):
                    self.thinking, self.count, self.forcing = False, 0, 0
            elif self.thinking:
                if _ends_with(self._tail, self.markers.end):
                    self.thinking, self.count = False, 0
                else:
                    self.count += 1
            elif _ends_with(self._tail, self.markers.start):
                self.thinking, self.count = True, 0
