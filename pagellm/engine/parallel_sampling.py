"""``n`` and ``best_of``: one prompt fans out into sibling requests, and ``best_of`` picks the best ``n`` back.

Contract (shared by ``LLM`` and ``AsyncLLM``):
- A request runs ``best_of`` siblings when ``best_of`` is set, else ``n``. Sibling ``i`` gets ``seed + i`` when a
  seed is set (so the siblings differ but the whole call is reproducible) and ``n = 1``; the siblings share the
  prompt's KV blocks through the prefix cache.
- With ``best_of > n`` the siblings are ranked by ``cumulative_logprob`` (highest first; ties keep the lower
  sibling index) and the top ``n`` are returned, re-numbered ``0..n-1`` in rank order. Ranking needs the
  sampled tokens' logprobs, so the siblings compute them (``logprobs=0``) even when the caller did not ask;
  then the per-token logprobs are dropped from what is returned (``cumulative_logprob`` stays).
"""

from __future__ import annotations

import msgspec

from pagellm.outputs import CompletionOutput
from pagellm.sampling_params import SamplingParams


def needs_ranking(params: SamplingParams) -> bool:
    return params.best_of is not None and params.best_of > params.n


def sibling_params(params: SamplingParams) -> list[SamplingParams]:
    """The per-sibling parameters of one request (a single entry when it runs one sample)."""
    count = params.num_candidates
    logprobs = params.logprobs if params.logprobs is not None or not needs_ranking(params) else 0
    if count == 1:
        return [msgspec.structs.replace(params, n=1, best_of=None, logprobs=logprobs)]
    return [msgspec.structs.replace(params, n=1, best_of=None, logprobs=logprobs,
                                    seed=None if params.seed is None else params.seed + i)
            for i in range(count)]


def select_best(completions: list[CompletionOutput], params: SamplingParams) -> list[CompletionOutput]:
    """The ``n`` completions with the highest cumulative logprob, re-indexed in rank order."""
    ranked = sorted(completions, key=lambda c: (-(c.cumulative_logprob or 0.0), c.index))[:params.n]
    for index, completion in enumerate(ranked):
        completion.index = index
        if params.logprobs is None:
            completion.logprobs = None
    return ranked
