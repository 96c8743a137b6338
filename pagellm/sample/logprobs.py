"""Per-token logprobs for the requests that ask for them, batched over the step.

Contract:
- Values are ``log_softmax`` (float32) of the model's *raw* logits: taken before temperature, top-k/top-p/min-p
  or min_tokens bans touch them, so they describe the model, not the sampler (vLLM / OpenAI semantics), unless a
  request's ``logprobs_mode`` asks for the raw logits, or for the log or the logits of the distribution it samples
  from (``apply_logprobs_modes``).
- One call handles every (logit row, sampled token) pair of the step: one ``topk`` for the largest k asked, one
  gather, one comparison count for the ranks, and one move to Python lists per result.
- ``rank`` = 1 + the number of vocabulary entries with a strictly greater logprob (1 = the most likely token).
- A request with ``logprob_token_ids`` (vLLM's) gets those tokens' values and ranks in place of its top-k
  (``gather_listed``: one sort per row finds every listed token's rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagellm.sample.sampler import SamplingTensors, processed_logits, processed_logprobs
from pagellm.sampling_params import SamplingParams
from pagellm.sched.output import TokenLogprobs


def raw_logprobs(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``log_softmax`` in float32 of ``logits[rows]`` ([len(rows), V]); a new tensor, safe from later in-place
    edits of ``logits``."""
    selected = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, dtype=torch.int64)]
    return torch.log_softmax(selected.float(), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int],
                    max_k: int) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    """For each pair ``(logprobs[rows[i]], token_ids[i])``: the token's logprob and rank, and the row's top
    ``max_k`` ids and logprobs (most likely first)."""
    index = torch.tensor(rows, dtype=torch.int64, device=logprobs.device)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device).unsqueeze(1)
    selected = logprobs.index_select(0, index)
    sampled = selected.gather(1, ids)
    ranks = (selected > sampled).sum(dim=1) + 1
    if max_k > 0:
        top_values, top_ids = selected.topk(max_k, dim=1)
        top_lists, top_id_lists = top_values.tolist(), top_ids.tolist()
    else:
        top_lists, top_id_lists = [[] for _ in rows], [[] for _ in rows]
    return sampled.squeeze(1).tolist(), ranks.tolist(), top_id_lists, top_lists


def gather_listed(logprobs: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int],
                  listed: Sequence[Sequence[int]]) -> TokenLogprobs:
    """For each pair ``(logprobs[rows[i]], token_ids[i])``: the token's logprob and rank, and those of the tokens
    ``listed[i]``, in their order (one request's rows: its sampled tokens, all with the same list)."""
    selected = logprobs.index_select(0, torch.tensor(rows, dtype=torch.int64, device=logprobs.device))
    width = max(len(ids) for ids in listed)
    asked = torch.tensor([[tok, *ids, *[0] * (width - len(ids))] for tok, ids in zip(token_ids, listed)],
                         dtype=torch.int64, device=logprobs.device)
    values = selected.gather(1, asked)
    ascending = selected.sort(dim=1).values
    ranks = selected.shape[1] - torch.searchsorted(ascending, values, right=True) + 1
    value_lists, rank_lists = values.tolist(), ranks.tolist()
    sizes = [len(ids) for ids in listed]
    return TokenLogprobs([v[0] for v in value_lists], [r[0] for r in rank_lists],
                         [list(ids) for ids in listed], [v[1:1 + n] for v, n in zip(value_lists, sizes)],
                         top_ranks=[r[1:1 + n] for r, n in zip(rank_lists, sizes)])


def split_logprobs(values: tuple[list[float], list[int], list[list[int]], list[list[float]]],
                   counts: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """Cut ``gather_logprobs``' flat results into consecutive runs of ``counts[j]`` tokens, keeping ``ks[j]``
    alternatives per token for run j."""
    sampled, ranks, top_ids, top_values = values
    out: list[TokenLogprobs] = []
    start = 0
    for count, k in zip(counts, ks):
        end = start + count
        out.append(TokenLogprobs(sampled[start:end], ranks[start:end], [ids[:k] for ids in top_ids[start:end]],
                                 [v[:k] for v in top_values[start:end]]))
        start = end
    return out


def copy_raw_logits(logits: torch.Tensor, candidate_rows: Sequence[int],
                    requests: Sequence[tuple[SamplingParams, int]]) -> torch.Tensor | None:
    """The candidate rows' logits in float32 (a copy: processing may edit ``logits`` in place), when one of the
    ``requests`` ((its params, its rows) for each request that wants logprobs) has ``logprobs_mode`` raw_logits."""
    if not any(params.logprobs_mode == "raw_logits" for params, _ in requests):
        return None
    return logits[torch.tensor(candidate_rows, dtype=torch.int64)].float()


def apply_logprobs_modes(raw: torch.Tensor, raw_logits: torch.Tensor | None, processed: torch.Tensor,
                         candidate_rows: Sequence[int], requests: Sequence[tuple[SamplingParams, int]]) -> None:
    """Overwrite, in ``raw`` (the raw logprobs of the candidate rows, the ``requests``' rows one after another), the
    rows of requests whose ``logprobs_mode`` asks for something else: the raw logits (``copy_raw_logits``'), the log
    of the distribution they sample from (after processing, temperature and filters), or that distribution's logits
    (dropped tokens -inf), from ``processed`` (the processed logits)."""
    base, by_mode = 0, {}
    for params, width in requests:
        if params.values_mode != "raw_logprobs":
            targets, sources, row_params = by_mode.setdefault(params.values_mode, ([], [], []))
            targets.extend(range(base, base + width))
            sources.extend(candidate_rows[base:base + width])
            row_params.extend([params] * width)
        base += width
    for mode, (targets, sources, row_params) in by_mode.items():
        into = torch.tensor(targets)
        if mode == "raw_logits":
            assert raw_logits is not None  # copy_raw_logits took them
            raw[into] = raw_logits[into]
            continue
        tensors = SamplingTensors.from_params(row_params, [0] * len(row_params))
        method = processed_logprobs if mode == "processed_logprobs" else processed_logits
        raw[into] = method(processed[torch.tensor(sources)].float(), tensors)
