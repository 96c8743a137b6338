"""Verification of one step's drafts against the target's logits (the model runner's half of speculation).

Each drafted request owns ``len(drafts) + 1`` consecutive logit rows starting at ``first``: row ``first + i`` is
the target's next-token distribution after draft ``i - 1`` (after the request's last accepted token for
``i = 0``). Greedy requests keep exactly the target's argmax path; sampled requests go through lossless
rejection sampling (``sample/rejection.py``) on the same processed distribution the plain sampler draws from
(temperature, top-k, top-p, min-p). Tree drafts name each node's parent; their accepted path is reported so the
runner can move that path's KV into place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.sample.rejection import (accept_greedy, accept_greedy_tree, rejection_sample_chain,
                                      rejection_sample_tree, uniforms_for)
from pagellm.sample.sampler import SamplingTensors, first_argmax, random_probs
from pagellm.sampling_params import SamplingParams


@dataclass
class DraftedRow:
    first: int                        # first logit row
    drafts: list[int]
    params: SamplingParams
    output_position: int              # output index of the token the first row samples
    probs: torch.Tensor | None = None  # [len(drafts), V] draft distributions; None: point masses
    parents: list[int] | None = None   # tree drafts: parent node per draft (-1 = root); None: a chain


@dataclass
class Verified:
    tokens: list[int]   # accepted drafts + one corrected/bonus token
    path: list[int]     # accepted draft indices (0..n-1 for a chain prefix; tree nodes otherwise)


def verify(logits: torch.Tensor, rows: list[DraftedRow], generator: torch.Generator | None) -> list[Verified]:
    greedy = [r.params.is_greedy for r in rows]
    out: list[Verified | None] = [None] * len(rows)
    if any(greedy):
        argmax = first_argmax(logits).tolist()
        for i, row in enumerate(rows):
            if greedy[i]:
                out[i] = _verify_greedy(row, argmax[row.first:row.first + len(row.drafts) + 1])
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        for i, result in zip(sampled, _verify_sampled(logits, [rows[i] for i in sampled], generator)):
            out[i] = result
    return out  # type: ignore[return-value]


def _verify_greedy(row: DraftedRow, argmax: list[int]) -> Verified:
    if row.parents is None:
        n = accept_greedy(row.drafts, argmax)
        return Verified(row.drafts[:n] + [argmax[n]], list(range(n)))
    path = accept_greedy_tree(row.drafts, row.parents, argmax)
    last = path[-1] + 1 if path else 0
    return Verified([row.drafts[n] for n in path] + [argmax[last]], path)


def _target_probs(logits: torch.Tensor, rows: list[DraftedRow]) -> list[torch.Tensor]:
    """Each row's processed target distributions [len(drafts) + 1, V] (one batched call for all)."""
    index, params, positions = [], [], []
    for row in rows:
        n = len(row.drafts) + 1
        index.extend(range(row.first, row.first + n))
        params.extend([row.params] * n)
        positions.extend(row.output_position + i for i in range(n))
    probs = random_probs(logits[torch.tensor(index)], SamplingTensors.from_params(params, positions))
    return list(probs.split([len(r.drafts) + 1 for r in rows]))


def _verify_sampled(logits: torch.Tensor, rows: list[DraftedRow],
                    generator: torch.Generator | None) -> list[Verified]:
    probs = _target_probs(logits, rows)
    seeded = torch.Generator()
    uniforms = [uniforms_for(len(r.drafts) + 1, r.params.seed, r.output_position, generator, seeded) for r in rows]
    out: list[Verified | None] = [None] * len(rows)
    for i, r in enumerate(rows):
        if r.parents is not None:
            path, final = rejection_sample_tree(probs[i], r.drafts, r.parents, _fit(r.probs, probs[i]), uniforms[i])
            out[i] = Verified([r.drafts[n] for n in path] + [final], path)
    chains = [i for i, r in enumerate(rows) if r.parents is None]
    if chains:
        verified = _verify_chains([rows[i] for i in chains], [probs[i] for i in chains], [uniforms[i] for i in chains])
        for i, result in zip(chains, verified):
            out[i] = result
    return out  # type: ignore[return-value]


def _verify_chains(rows: list[DraftedRow], probs: list[torch.Tensor], uniforms: list[torch.Tensor]) -> list[Verified]:
    """All chains in one batched call: pad to the longest chain (padding drafts are never accepted)."""
    k = max(len(r.drafts) for r in rows)
    vocab = probs[0].shape[-1]
    target = torch.zeros(len(rows), k + 1, vocab)
    drafts = torch.zeros(len(rows), k, dtype=torch.int64)
    u = torch.zeros(len(rows), k + 1, 2)
    q = torch.zeros(len(rows), k, vocab) if any(r.probs is not None for r in rows) else None
    for b, r in enumerate(rows):
        n = len(r.drafts)
        target[b, :n + 1] = probs[b]
        drafts[b, :n] = torch.tensor(r.drafts)
        u[b, :n + 1] = uniforms[b]
        if q is not None:  # in a batch that has distributions, a point-mass row writes its one-hots
            q[b, :n] = _fit(r.probs, probs[b]) if r.probs is not None else \
                torch.zeros(n, vocab).scatter_(1, drafts[b, :n, None], 1.0)
    tokens, accepted = rejection_sample_chain(target, drafts, torch.tensor([len(r.drafts) for r in rows]), q, u)
    return [Verified(tokens[b, :int(a) + 1].tolist(), list(range(int(a)))) for b, a in enumerate(accepted.tolist())]


def _fit(draft_probs: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor | None:
    """Draft distributions cut or zero-padded to the target's vocabulary (padded LM-head rows differ)."""
    if draft_probs is None:
        return None
    n, vocab = draft_probs.shape[0], target.shape[-1]
    if draft_probs.shape[-1] == vocab:
        return draft_probs
    fitted = torch.zeros(n, vocab)
    width = min(vocab, draft_probs.shape[-1])
    fitted[:, :width] = draft_probs[:, :width]
    return fitted
