"""Beam search over the engine, as vLLM runs it: each step asks the engine for one token of every live beam with the
top ``2 · beam_width`` log-probabilities, extends each beam by each of those candidates, and keeps the
``beam_width`` most probable. The engine needs nothing special: a step's requests are the beams' whole token
sequences, whose full KV blocks the prefix cache already holds from the step before, so each costs at most one
block's recomputation.

Contract:
- ``BeamSearchParams(beam_width, max_tokens, ignore_eos, length_penalty, include_stop_str_in_output)``; the beams
  are ranked by the model's raw log-probabilities (no temperature, penalty or filter takes part), so the search is
  deterministic. ``beam_width`` is at most 10 (the engine returns at most 20 alternatives per token).
- A candidate ending in one of the model's end-of-sequence tokens (``Tokenizer.eos_token_ids``) is set aside as
  finished, unless ``ignore_eos``; the others compete for the ``beam_width`` places by cumulative log-probability.
  The search stops after ``max_tokens`` steps (fewer where the context, ``max_model_len``, ends first; at least
  one: a prompt that fills the context is refused by the first step's request) or when no beam is left.
- The result is the ``beam_width`` best of the finished and the live beams, by ``score``: cumulative
  log-probability over ``sequence length ** length_penalty`` (the prompt counted, a final end-of-sequence token
  not), best first, as vLLM ranks them. A beam's ``text`` is its generated tokens' (special tokens kept; the final
  end-of-sequence token's only with ``include_stop_str_in_output``).
- ``BeamSearch`` is the search's state and knows no engine: ``LLM.beam_search`` drives it with batches of requests,
  the server (``server/openai/serving_beam.py``) with concurrent ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from pagellm.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep the end-of-sequence token's text in ``text``

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or \
                not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    def step_params(self) -> SamplingParams:
        """What each beam asks of the engine per step: one token and the top 2 · beam_width log-probabilities."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.beam_width, ignore_eos=True,
                              detokenize=False)


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens and its own (``tokens``), their summed log-probability, and once the search
    is over its text (the generated tokens) and why it ended (``stop``: an end-of-sequence token; ``length``)."""

    tokens: list[int]
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    text: str = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def score(beam: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    length = len(beam.tokens) - (beam.finish_reason == "stop" and beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """One prompt's search: ``live`` beams to extend, ``advance`` with their next-token log-probabilities."""

    def __init__(self, prompt: Sequence[int], params: BeamSearchParams, eos_token_ids: frozenset[int],
                 max_model_len: int | None = None) -> None:
        self.params, self.eos = params, eos_token_ids
        room = params.max_tokens if max_model_len is None else max_model_len - len(prompt)
        self.max_steps = max(1, min(params.max_tokens, room))
        self.live = [BeamSearchSequence(list(prompt), len(prompt))]
        self.finished: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.max_steps

    def advance(self, logprobs: Sequence[Mapping[int, float]]) -> None:
        """Extend each live beam by each of its candidates (token → log-probability, in ``live``'s order)."""
        assert len(logprobs) == len(self.live)
        candidates = []
        for beam, step in zip(self.live, logprobs):
            for token, logprob in step.items():
                new = BeamSearchSequence([*beam.tokens, token], beam.num_prompt_tokens, beam.cum_logprob + logprob)
                if token in self.eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    self.finished.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)  # stable: ties keep the beams' order
        self.live = candidates[:self.params.beam_width]
        self.steps += 1

    def result(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        """The best ``beam_width`` beams, their texts decoded (``decode(token_ids)``)."""
        for beam in self.live:
            beam.finish_reason = "length"
        ranked = sorted([*self.finished, *self.live], key=lambda b: score(b, self.eos, self.params.length_penalty),
                        reverse=True)[:self.params.beam_width]
        for beam in ranked:
            ids = beam.output_token_ids
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                ids = ids[:-1]
            beam.text = decode(ids)
        return BeamSearchOutput(ranked)
