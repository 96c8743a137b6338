"""Prompt-lookup (n-gram) drafting: find the latest earlier occurrence of the context's last n tokens
(longest n first) and propose the tokens that followed it. No model, no extra weights."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.num_lookahead_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        k = min(self.num_lookahead_tokens, max_tokens)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
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
