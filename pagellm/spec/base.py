"""The proposer interface for speculative decoding, and the null proposer.

A proposer looks at a request's tokens after each step and drafts up to ``num_lookahead_tokens`` next tokens.
The scheduler reserves that many extra KV slots per request and schedules the drafts as ordinary tokens; the
model runner verifies them in the next forward pass and keeps the accepted prefix.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from pagellm.config import SpeculativeConfig


class Proposer(Protocol):
    num_lookahead_tokens: int

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Draft at most ``max_tokens`` tokens to follow ``token_ids`` (may return none)."""


class NoProposer:
    num_lookahead_tokens = 0

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        return []


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method is None:
        return NoProposer()
    if config.method == "ngram":
        from pagellm.spec.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"unknown speculative method {config.method!r}; supported: ngram")
