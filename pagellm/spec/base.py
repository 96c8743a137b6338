"""The proposer interface for speculative decoding, and the null proposer.

After each step the model runner hands the proposer every request that just sampled and is allowed to speculate
(``ProposalRequest``, with the target's hidden state at every position the step accepted); the proposer drafts up to ``num_lookahead_tokens`` next tokens for each (``Draft``). The
scheduler reserves that many extra KV slots per request and schedules the drafts as ordinary tokens; the model
runner verifies them in the next forward pass (``sample/rejection.py``) and keeps the accepted prefix.

A draft carries the distribution each token was drawn from (``probs``; None means point masses, as for n-gram
lookup), which lossless rejection sampling needs for non-greedy requests. Proposers that keep per-request state
(a draft model's KV cache) drop it in ``release``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from pagellm.config import SpeculativeConfig
from pagellm.sampling_params import SamplingParams


@dataclass
class ProposalRequest:
    req_id: str
    token_ids: Sequence[int]          # prompt + every accepted output token
    sampling_params: SamplingParams
    num_output_tokens: int
    max_tokens: int                   # draft at most this many
    # The target's final hidden states [n, H] at the n newest positions before the newest token that this step
    # computed and accepted (a prefill's prompt rows; a verification's root and accepted drafts): row i is the
    # state whose logits predicted token_ids[len(token_ids) - n + i], so row -1 predicted the newest token.
    # A view of the step's hidden states: copy what is kept. None for proposers that need none.
    hidden: torch.Tensor | None = None


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None              # [len(tokens), V] distributions drawn from; None: point masses
    parents: list[int] | None = field(default=None)  # tree drafts: parent node per token (-1: the root); None: chain


class Proposer(Protocol):
    num_lookahead_tokens: int

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Draft]:
        """One draft per request (possibly empty)."""

    def release(self, req_ids: Sequence[str]) -> None:
        """Forget any state kept for these requests (finished or preempted)."""


class NoProposer:
    num_lookahead_tokens = 0

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Draft]:
        return [Draft([]) for _ in requests]

    def release(self, req_ids: Sequence[str]) -> None:
        pass


def make_proposer(config: SpeculativeConfig, target: torch.nn.Module | None = None, **runtime) -> Proposer:
    """The proposer ``config.method`` names; model-based ones share weights with ``target`` where they can."""
    if config.method is None:
        return NoProposer()
    if config.method == "ngram":
        from pagellm.spec.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        from pagellm.spec.draft import DraftModelProposer

        return DraftModelProposer.from_config(config, target, **runtime)
    if config.method == "medusa":
        from pagellm.spec.medusa import MedusaProposer

        return MedusaProposer.from_config(config, target, **runtime)
    if config.method == "eagle":
        from pagellm.spec.eagle import EagleProposer

        return EagleProposer.from_config(config, target, **runtime)
    raise ValueError(f"unknown speculative method {config.method!r}; supported: ngram, draft_model, medusa, eagle")
