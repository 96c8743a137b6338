"""Repetition, presence and frequency penalties, batched over the rows that ask for them.

Contract:
- ``repetition_penalty`` (transformers' ``RepetitionPenaltyLogitsProcessor``): every token that occurs in the
  prompt or the output so far has its logit divided by the penalty when positive and multiplied by it when
  negative (so a penalty > 1 always makes it less likely).
- ``presence_penalty`` / ``frequency_penalty`` (OpenAI): ``logit -= frequency * count + presence * (count > 0)``
  where ``count`` is how often the token occurs in the output so far (the prompt does not count).
- Repetition is applied first, then presence/frequency, all on the logits before temperature.
- ``TokenCounts`` is one request's persistent state: output-token counts and the prompt's token set as dense
  ``[V]`` tensors, updated incrementally with each accepted token (an ``index_add``), so a step only stacks the
  rows that need them; rows without penalties are never touched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TokenCounts:
    """How often each vocabulary entry occurs in one request's output, and which occur in its prompt."""

    def __init__(self, vocab_size: int, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                 need_prompt: bool) -> None:
        self.output = torch.zeros(vocab_size, dtype=torch.float32)
        self.prompt: torch.Tensor | None = None
        if need_prompt:
            self.prompt = torch.zeros(vocab_size, dtype=torch.bool)
            self.prompt[torch.tensor(list(prompt_token_ids), dtype=torch.int64)] = True
        self.add(output_token_ids)

    def add(self, token_ids: Sequence[int]) -> None:
        if token_ids:
            ids = torch.tensor(list(token_ids), dtype=torch.int64)
            self.output.index_add_(0, ids, torch.ones(len(token_ids), dtype=torch.float32))


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor | None,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Penalised float32 copy of ``logits`` [R, V].

    ``output_counts`` [R, V] float32; ``prompt_mask`` [R, V] bool (None: no row has a repetition penalty);
    ``repetition``/``presence``/``frequency`` [R] float32 (1, 0, 0 = off).
    """
    logits = logits.float()
    seen = output_counts > 0
    if prompt_mask is not None:
        occurred = seen | prompt_mask
        rep = repetition.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(occurred, penalised, logits)
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * seen.float()


def apply_penalties_reference(logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int],
                              repetition: float, presence: float, frequency: float) -> torch.Tensor:
    """The obvious one-row twin of ``apply_penalties`` (test oracle): a loop over the distinct tokens."""
    out = logits.float().clone()
    for token in set(prompt_ids) | set(output_ids):
        if repetition != 1.0:
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output_ids):
        out[token] -= frequency * output_ids.count(token) + presence
    return out
