"""Prompt-lookup (n-gram) drafting: find the latest earlier occurrence of the context's last n tokens
(longest n first) and propose the tokens that followed it. No model, no extra weights; drafts are point masses.

Long contexts: the search for each n is one vectorised comparison over a sliding-window view (no copy), and
only the trailing ``max_window`` tokens are searched, so a step costs O(window) whatever the context length.

A request with a predicted output (``SamplingParams.prediction_token_ids``, OpenAI's ``prediction``) drafts from it
first: its first tokens before any output exists, then what follows a place where the prediction holds the output's
last n tokens (longest n first, down to one token; of several places, the one nearest where an unedited copy would
be); only where the prediction has nothing to offer does the context's own lookup draft."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagellm.spec.base import Draft, ProposalRequest


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int, max_window: int = 8192) -> None:
        self.num_lookahead_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n
        self.max_window = max_window

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Draft]:
        return [Draft(self._from_prediction(r) or self.propose_one(r.token_ids, r.max_tokens)) for r in requests]

    def _from_prediction(self, request: ProposalRequest) -> list[int]:
        predicted = request.sampling_params.prediction_token_ids
        k = min(self.num_lookahead_tokens, request.max_tokens)
        if not predicted or k <= 0:
            return []
        if request.num_output_tokens == 0:
            return list(predicted[:k])
        output = request.token_ids[len(request.token_ids) - request.num_output_tokens:]
        corpus = np.asarray(list(predicted) + [-1], dtype=np.int64)  # -1: the window may end at the last token
        tail = np.asarray(output[-self.max_n:], dtype=np.int64)
        for n in range(min(self.max_n, len(tail), len(predicted)), 0, -1):
            windows = sliding_window_view(corpus[:-1], n)
            hits = np.flatnonzero((windows == tail[-n:]).all(axis=1))
            if len(hits):  # where several places match, the one nearest where an unedited copy would be
                start = int(hits[np.argmin(np.abs(hits + n - len(output)))]) + n
                return list(predicted[start:start + k])
        return []

    def release(self, req_ids: Sequence[str]) -> None:
        pass

    def propose_one(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        k = min(self.num_lookahead_tokens, max_tokens)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids[-self.max_window:], dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = _last_match(tokens, n)
            if start is not None:
                return tokens[start + n:start + n + k].tolist()
        return []


def _last_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest window, before the trailing one, equal to the last ``n`` tokens."""
    windows = sliding_window_view(tokens[:-1], n)  # excludes the trailing n-gram itself
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(hits[-1]) if len(hits) else None
