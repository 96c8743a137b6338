"""Lossless verification of draft tokens: speculative (rejection) sampling for chains and trees.

Contract (the output distribution equals the target model's, whatever the drafts were):
- Chain. Drafts ``d_1..d_n`` were proposed from draft distributions ``q_1..q_n``; the target gives ``p_1..p_{n+1}``
  (``p_i`` is the next-token distribution after ``d_{i-1}``). Draft ``d_i`` is accepted with probability
  ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the emitted token is drawn from the residual
  ``norm(max(p_i - q_i, 0))`` and verification stops; if every draft is accepted one bonus token is drawn from
  ``p_{n+1}``. Each step therefore emits between 1 and n + 1 tokens.
- Drafts without a distribution (n-gram lookup, top-k tree branches) are point masses: ``q = onehot(d)``, so the
  draft is accepted with probability ``p(d)`` and the residual is ``p`` with ``d`` removed.
- Tree. A node's children are verified in order against a running residual ``r`` (initially the node's ``p``):
  child ``c`` is accepted with probability ``min(1, r(c) / q_c(c))``; on rejection ``r ← norm(max(r - q_c, 0))``
  and the next sibling is tried; when every child is rejected the emitted token is drawn from ``r``. With
  point-mass children (distinct tokens) or children drawn i.i.d. from one ``q`` this is lossless (SpecInfer's
  multi-step speculative sampling).
- Randomness comes in as explicit uniforms, so callers decide the seeding (``uniforms_for``: a seeded request's
  draws depend only on ``(seed, output position)``, as in ``sample/sampler.py``).
- Probabilities are float32; rows need not be normalised (tokens filtered by min-p leave a row summing below 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagellm.sample.sampler import mix_seed, sample_inverse_cdf


def uniforms_for(num_rows: int, seed: int | None, output_position: int,
                 generator: torch.Generator | None, seeded: torch.Generator | None = None) -> torch.Tensor:
    """[num_rows, 2] uniforms (acceptance draw, resample draw) for one request's verification step.

    A seeded request re-seeds ``seeded`` from ``(seed, output_position)`` so its draws do not depend on the batch;
    others draw from the shared ``generator``.
    """
    if seed is None:
        return torch.rand(num_rows, 2, generator=generator)
    seeded = seeded or torch.Generator()
    seeded.manual_seed(mix_seed(seed, output_position))
    return torch.rand(num_rows, 2, generator=seeded)


def _normalise(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum(dim=-1, keepdim=True).clamp_min(1e-30)


def _draft_mass(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """[..., V] draft distributions: the given ones, or point masses on the draft tokens."""
    if draft_probs is not None:
        return _normalise(draft_probs.float())
    onehot = torch.zeros(*draft_tokens.shape, vocab, dtype=torch.float32)
    return onehot.scatter_(-1, draft_tokens.clamp_min(0).unsqueeze(-1), 1.0)


def rejection_sample_chain(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                           draft_probs: torch.Tensor | None, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify B chains at once.

    target_probs [B, K + 1, V]; draft_tokens [B, K] (rows shorter than K padded with any id); num_drafts [B];
    draft_probs [B, K, V] or None (point masses); uniforms [B, K + 1, 2].
    Returns (tokens [B, K + 1] with -1 after each row's last emitted token, num_accepted [B]); row b emits its
    first ``num_accepted[b]`` drafts followed by one corrected or bonus token.
    """
    batch, k = draft_tokens.shape
    p = _normalise(target_probs.float())
    q = _draft_mass(draft_tokens, draft_probs, p.shape[-1])
    p_draft = p[:, :k].gather(-1, draft_tokens.clamp_min(0).unsqueeze(-1)).squeeze(-1)      # [B, K]
    q_draft = q.gather(-1, draft_tokens.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    is_draft = torch.arange(k).unsqueeze(0) < num_drafts.unsqueeze(1)
    accept = (uniforms[:, :k, 0] * q_draft < p_draft) & is_draft
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)                                   # leading accepts
    rows = torch.arange(batch)
    at = num_accepted.clamp(max=k - 1) if k else num_accepted
    residual = (p[rows, at] - q[rows, at]).clamp_min(0.0) if k else p[:, 0]
    rejected = num_accepted < num_drafts
    # p == q exactly leaves no residual mass, but then rejection has probability 0; fall back to p for safety.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, at])
    final_dist = torch.where(rejected.unsqueeze(1), residual, p[rows, num_accepted])
    final = sample_inverse_cdf(final_dist, uniforms[rows, num_accepted, 1])
    tokens = torch.full((batch, k + 1), -1, dtype=torch.int64)
    keep = torch.arange(k).unsqueeze(0) < num_accepted.unsqueeze(1)
    tokens[:, :k] = torch.where(keep, draft_tokens, -1)
    tokens[rows, num_accepted] = final
    return tokens, num_accepted


def rejection_sample_tree(target_probs: torch.Tensor, node_tokens: Sequence[int], parents: Sequence[int],
                          draft_probs: torch.Tensor | None, uniforms: torch.Tensor) -> tuple[list[int], int]:
    """Verify one request's draft tree.

    Node ``i`` (0-based, parents listed before children) holds token ``node_tokens[i]``; ``parents[i]`` is -1 for
    the root's children, else the parent node. target_probs [N + 1, V]: row 0 is the distribution after the
    root (the last accepted token), row ``i + 1`` the distribution after node ``i``. draft_probs [N, V] or None;
    uniforms [N + 1, 2] (column 0 per node: its acceptance draw; column 1 per row: the final draw).
    Returns (accepted node indices from the root down, the corrected or bonus token).
    """
    p = _normalise(target_probs.float())
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    path: list[int] = []
    current = -1
    while True:
        residual = p[current + 1]
        accepted = None
        for child in children.get(current, []):
            token = node_tokens[child]
            q = _normalise(draft_probs[child].float()) if draft_probs is not None else _onehot(token, p.shape[-1])
            if float(uniforms[child, 0]) * float(q[token]) < float(residual[token]):
                accepted = child
                break
            updated = (residual - q).clamp_min(0.0)
            residual = _normalise(updated) if float(updated.sum()) > 0 else residual
        if accepted is None:
            final = sample_inverse_cdf(residual.unsqueeze(0), uniforms[current + 1, 1].view(1))
            return path, int(final)
        path.append(accepted)
        current = accepted


def _onehot(token: int, vocab: int) -> torch.Tensor:
    mass = torch.zeros(vocab, dtype=torch.float32)
    mass[token] = 1.0
    return mass


def accept_greedy(drafts: Sequence[int], target: Sequence[int]) -> int:
    """How many leading drafts equal the target model's argmax at their positions."""
    accepted = 0
    for draft, best in zip(drafts, target):
        if draft != best:
            break
        accepted += 1
    return accepted


def accept_greedy_tree(node_tokens: Sequence[int], parents: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The tree path a greedy target takes: at each node, the child whose token is the target's argmax there.

    ``argmax[0]`` is the target's choice after the root and ``argmax[i + 1]`` its choice after node ``i``."""
    path: list[int] = []
    current = -1
    while True:
        best = argmax[current + 1]
        nxt = next((n for n, par in enumerate(parents) if par == current and node_tokens[n] == best), None)
        if nxt is None:
            return path
        path.append(nxt)
        current = nxt
