"""Repetition, presence and frequency penalties, batched and sparse over the tokens each request has seen.

Contract:
- ``repetition_penalty`` (transformers' ``RepetitionPenaltyLogitsProcessor``): every token that occurs in the
  prompt or the output so far has its logit divided by the penalty when positive and multiplied by it when
  negative (so a penalty > 1 always makes it less likely).
- ``presence_penalty`` / ``frequency_penalty`` (OpenAI): ``logit -= frequency * count + presence * (count > 0)``
  where ``count`` is how often the token occurs in the output so far (the prompt does not count).
- Repetition is applied first, then presence/frequency, all on the logits before temperature.
- ``TokenCounts`` is one request's persistent state: the distinct tokens it has seen (prompt tokens only when it
  has a repetition penalty), their output counts and whether they occur in the prompt, as growing numpy arrays
  updated with each accepted token. A step touches only those (row, token) entries: one gather, the arithmetic,
  one scatter, whatever the vocabulary size. Rows without penalties are never touched.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class TokenCounts:
    """The tokens one request has seen: ids, output counts, and whether each occurs in the prompt."""

    def __init__(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], need_prompt: bool) -> None:
        self._slot: dict[int, int] = {}
        capacity = 64 + len(output_token_ids) + (len(prompt_token_ids) if need_prompt else 0)
        self._ids = np.empty(capacity, dtype=np.int64)
        self._counts = np.zeros(capacity, dtype=np.float32)
        self._in_prompt = np.zeros(capacity, dtype=np.bool_)
        self._size = 0
        if need_prompt:
            for token in prompt_token_ids:
                slot = self._slot_of(token)  # first: it may grow (replace) the arrays
                self._in_prompt[slot] = True
        self.add(output_token_ids)

    def _slot_of(self, token: int) -> int:
        slot = self._slot.get(token)
        if slot is None:
            if self._size == len(self._ids):
                self._grow()
            slot = self._slot[token] = self._size
            self._ids[slot] = token
            self._size += 1
        return slot

    def _grow(self) -> None:
        size = 2 * len(self._ids)
        self._ids = np.resize(self._ids, size)
        self._counts = np.concatenate([self._counts, np.zeros(size - len(self._counts), dtype=np.float32)])
        self._in_prompt = np.concatenate([self._in_prompt, np.zeros(size - len(self._in_prompt), dtype=np.bool_)])

    def add(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            slot = self._slot_of(token)  # first: it may grow (replace) the arrays
            self._counts[slot] += 1.0

    def view(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, output counts, in prompt) of the distinct tokens seen, in first-seen order."""
        n = self._size
        return self._ids[:n], self._counts[:n], self._in_prompt[:n]


def gather_counts(counts: Sequence[TokenCounts]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat (row, token id, output count, in prompt) over every request's seen tokens; row i = ``counts[i]``."""
    views = [c.view() for c in counts]
    lengths = [len(ids) for ids, _, _ in views]
    rows = np.repeat(np.arange(len(views), dtype=np.int64), lengths)
    return (torch.from_numpy(rows), torch.from_numpy(np.concatenate([v[0] for v in views])),
            torch.from_numpy(np.concatenate([v[1] for v in views])),
            torch.from_numpy(np.concatenate([v[2] for v in views])))


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
                    in_prompt: torch.Tensor, repetition: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor) -> None:
    """Penalise float32 ``logits`` [R, V] in place at the entries ``(rows[i], ids[i])`` (each pair once).

    ``counts`` / ``in_prompt`` describe each entry; ``repetition`` / ``presence`` / ``frequency`` are per row
    [R] (1, 0, 0 = off).
    """
    values = logits[rows, ids]
    seen = counts > 0
    rep = repetition[rows]
    penalised = torch.where(values > 0, values / rep, values * rep)
    values = torch.where(seen | in_prompt, penalised, values)
    values = values - frequency[rows] * counts - presence[rows] * seen.float()
    logits[rows, ids] = values


def apply_penalties_reference(logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int],
                              repetition: float, presence: float, frequency: float) -> torch.Tensor:
    """The obvious one-row twin of ``apply_penalties`` (test oracle): a loop over the distinct tokens."""
    out = logits.float().clone()
    for token in set(prompt_ids) | set(output_ids):
        if repetition != 1.0:
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output_ids):
        out[token] -= frequency * list(output_ids).count(token) + presence
    return out
