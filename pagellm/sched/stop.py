"""Token-level stop rules: EOS (unless ``ignore_eos``), ``stop_token_ids`` (after ``min_tokens``), ``max_tokens``
and ``max_model_len``.

``check(request, token, num_tokens)`` is the exact rule for one token. ``token_hits(...)`` is the cheap test that
rules a whole step out at once for the token rules: only a request whose new tokens include one of the stop tokens
of some unfinished request can stop on a token (one set test for the step; a numpy look-up when it hits), and only
a request that reaches its ``length_limit`` can stop on length (the scheduler compares that in numpy). The stop
tokens are counted per unfinished request (``add`` on arrival, ``remove`` when it finishes). No torch here.
"""

from __future__ import annotations

import numpy as np

from pagellm.request import Request, RequestStatus


class StopRules:
    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.tokens: dict[int, int] = {}  # token → unfinished requests it may stop

    def add(self, request: Request) -> None:
        """Set the request's ``stop_ids`` and ``length_limit`` and count its stop tokens."""
        params = request.sampling_params
        stops = frozenset(params.stop_token_ids or ())
        request.stop_ids = stops if params.ignore_eos else stops | frozenset(request.eos_token_ids)
        length_limit = self.max_model_len
        if request.max_tokens is not None:
            length_limit = min(length_limit, request.num_prompt_tokens + request.max_tokens)
        request.length_limit = length_limit
        for token in request.stop_ids:
            self.tokens[token] = self.tokens.get(token, 0) + 1

    def remove(self, request: Request) -> None:
        for token in request.stop_ids:
            left = self.tokens[token] - 1
            if left:
                self.tokens[token] = left
            else:
                del self.tokens[token]

    def token_hits(self, counts: np.ndarray, flat_tokens: list[int]) -> np.ndarray | None:
        """Which requests got a stop token of some unfinished request: request ``i`` got ``counts[i]`` tokens, back to
        back in ``flat_tokens``. None when none did (the usual case, found by one set test)."""
        if self.tokens.keys().isdisjoint(flat_tokens):
            return None
        hits = np.isin(np.array(flat_tokens, dtype=np.int64), np.fromiter(self.tokens, np.int64))
        rows = np.zeros(len(counts), dtype=bool)
        rows[np.repeat(np.arange(len(counts)), counts)[hits]] = True
        return rows

    def check(self, request: Request, token: int, num_tokens: int) -> RequestStatus | None:
        """The status ``request`` ends with once ``token`` is its ``num_tokens``-th token, or None; sets
        ``stop_reason`` for a stop token."""
        params = request.sampling_params
        num_output = num_tokens - request.num_prompt_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None


def suppressed_tokens(request: Request) -> list[int]:
    """Tokens the sampler must not pick while fewer than ``min_tokens`` tokens were generated, ascending."""
    params = request.sampling_params
    if params.min_tokens <= request.num_output_tokens:
        return []
    stops = set(params.stop_token_ids or ())
    return sorted(stops if params.ignore_eos else stops | set(request.eos_token_ids))
