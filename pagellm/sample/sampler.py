"""Batched token sampling: logits [B, V] → token ids [B].

Contract:
- Greedy rows (temperature 0) take the argmax of the raw logits.
- Random rows, in this order: divide by temperature; keep the top-k logits; keep the nucleus (smallest prefix of
  the sorted distribution whose mass reaches top-p; the top token always survives); drop tokens whose
  probability is below ``min_p`` × the largest probability; sample.
- Sampling inverts each row's cumulative distribution at one uniform draw ``u ~ U(0, 1)`` per row: the first
  token whose cumulative mass exceeds ``u`` × the row's total. That draws from ``p`` exactly, needs no normalised
  ``p``, and costs one random number per row (noise per vocabulary entry, as in the exponential race, costs
  more than the model's forward pass at large batches on a CPU).
- Ties are broken towards the lower token id everywhere: argmax returns the first maximum (``first_argmax``), and
  the sort used by top-k/top-p is stable.
- A seeded row's draw depends only on ``(seed, output_position)``: it comes from a generator re-seeded for that
  row, so the row samples the same token wherever it sits in whatever batch, and after preemption/recompute.
  Unseeded rows share the batch generator (or torch's default one); every step draws one uniform per batch row.
- Fast paths: an all-greedy batch never touches a generator; no sort happens unless some row uses top-k/top-p.
  When every random row has a top-k of at most 1024 (``top_k_candidates``), one ``topk`` per row picks
  candidates that enclose every token tied at the k-th value, and temperature, top-p, min-p and the draw work on
  those candidates only, kept in id order: the kept sets are the full stable sort's, and the draw walks the same
  tokens in the same order as a walk over the vocabulary would (probabilities equal up to float rounding).
  Rows without a top-k (top-p only, plain temperature) take the full path for the whole batch.
- Rows with temperature only (no top-k, top-p or min-p) take one fused native call (``native.sample_rows``: the
  same inverse-CDF draw in two passes over each row, float rounding aside); the torch sequence is its twin.
- No Python loop over the vocabulary; the only per-row loop is over seeded rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagellm.sample import native
from pagellm.sampling_params import SamplingParams

_MASK_64 = (1 << 64) - 1
# Up to this top_k, top-k/top-p pick candidates with ``topk`` instead of sorting the whole vocabulary.
_SMALL_TOP_K = 1024
# Candidates taken past the largest k, so that tokens tied at the k-th value are usually all among them.
_TIE_MARGIN = 16


@dataclass
class SamplingTensors:
    """Per-step sampling inputs for the B rows being sampled, built by the model runner."""

    temperature: torch.Tensor  # [B] float32; rows with temperature 0 are greedy
    top_k: torch.Tensor | None  # [B] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off; None when no row uses it
    min_p: torch.Tensor | None  # [B] float32, 0.0 = off; None when no row uses it
    seeds: list[tuple[int, int, int]]  # (row, seed, output_position) for random rows with a per-request seed
    all_greedy: bool
    all_random: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams],
                    output_positions: Sequence[int]) -> SamplingTensors:
        """Build the tensors for ``params[i]`` sampling its output token number ``output_positions[i]``.

        Greedy rows get temperature 0 and every filter off, so the random branch can treat them uniformly.
        """
        if len(params) != len(output_positions):
            raise ValueError(f"need one output position per row: got {len(params)} params and "
                             f"{len(output_positions)} positions.")
        greedy = [p.is_greedy for p in params]
        temperature = [0.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [0 if g else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        seeds = [(row, p.seed, pos) for row, (p, g, pos) in enumerate(zip(params, greedy, output_positions))
                 if not g and p.seed is not None]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32),
            top_k=torch.tensor(top_k, dtype=torch.int64) if any(k > 0 for k in top_k) else None,
            top_p=torch.tensor(top_p, dtype=torch.float32) if any(p < 1.0 for p in top_p) else None,
            min_p=torch.tensor(min_p, dtype=torch.float32) if any(p > 0.0 for p in min_p) else None,
            seeds=seeds,
            all_greedy=all(greedy),
            all_random=not any(greedy),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SamplingTensors:
        """The same tensors on ``device`` (a no-op for tensors already there)."""
        def move(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(device, non_blocking=non_blocking)
        return SamplingTensors(self.temperature.to(device, non_blocking=non_blocking), move(self.top_k),
                               move(self.top_p), move(self.min_p), self.seeds, self.all_greedy,
                               self.all_random)


# ---- masks (each returns a bool tensor: True = drop) ------------------------------------------------------------

def top_k_mask_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Drop mask in *sorted* (descending) order keeping the first ``top_k[b]`` entries; 0 keeps all.

    Working on sorted positions keeps exactly k tokens even when logits tie at the boundary.
    """
    vocab = sorted_logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    positions = torch.arange(vocab, device=sorted_logits.device)
    return positions.unsqueeze(0) >= k.unsqueeze(1)


def top_p_mask_sorted(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drop mask in *sorted* order: keep position i while the mass strictly before it is below ``top_p[b]``.

    That is the smallest prefix whose mass reaches top_p, and position 0 (mass before it = 0) always survives.
    Rows with top_p >= 1 keep everything, so float rounding in the cumulative sum can never drop their tail.
    """
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    return drop & (top_p < 1.0).unsqueeze(1)


def min_p_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop mask in vocabulary order: tokens whose probability is below ``min_p[b]`` × the row's max."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs < threshold


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Logits with tokens outside the top-k and then outside the top-p nucleus set to -inf (one sort)."""
    if top_k is None and top_p is None:
        return logits
    if top_k is not None:
        fast = _small_top_k(logits, top_k, top_p)
        if fast is not None:
            return fast
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        sorted_logits = sorted_logits.masked_fill(top_k_mask_sorted(sorted_logits, top_k), float("-inf"))
    if top_p is not None:
        sorted_logits = sorted_logits.masked_fill(top_p_mask_sorted(sorted_logits, top_p), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _small_top_k(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor | None:
    """``apply_top_k_top_p`` without sorting the vocabulary, when every filtered row has 0 < top_k <= 1024.

    ``_enclosing_topk`` picks candidates that hold every token tied with the k-th value; they are re-sorted by
    (logit descending, id ascending), the order the stable full sort gives, so ties keep the lowest ids.
    """
    filtered = top_k > 0 if top_p is None else (top_k > 0) | (top_p < 1.0)
    vocab = logits.shape[-1]
    if not bool(((top_k > 0) & (top_k <= _SMALL_TOP_K) | ~filtered).all()):
        return None
    rows = filtered.nonzero().squeeze(1)
    k = top_k[rows]
    values, ids = _enclosing_topk(logits[rows], k, None)
    values, ids = _filter_candidates(values, ids, k, None if top_p is None else top_p[rows])
    kept = torch.full((len(rows), vocab), float("-inf"), dtype=values.dtype, device=values.device)
    kept.scatter_(1, ids, values)
    if len(rows) == logits.shape[0]:
        return kept
    return logits.index_copy(0, rows, kept)


def _enclosing_topk(logits: torch.Tensor, k: torch.Tensor,
                    temperature: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk`` candidates per row (values divided by ``temperature`` [R, 1] in float32, as the reference path
    divides) that include every token whose value ties with the row's k-th largest one.

    Candidates come in descending order and the rest of the row is <= the last one, so a row is enclosed when
    its last candidate is strictly below its k-th value; a margin past max(k) makes that the usual case (bfloat16
    logits tie a lot), and the take doubles until it holds. No pass over the vocabulary besides ``topk``.
    """
    vocab = logits.shape[-1]
    take = min(int(k.max()) + 1 + _TIE_MARGIN, vocab)
    while True:
        values, ids = logits.topk(take, dim=-1)
        values = values.float() if temperature is None else values.float() / temperature
        if take == vocab:
            return values, ids
        kth = values.gather(1, (k - 1).clamp(max=take - 1).unsqueeze(1)).squeeze(1)
        # a -inf k-th value: the row has fewer than k finite tokens, and which -inf ones fill it does not matter
        if bool(((values[:, -1] < kth) | (kth == float("-inf"))).all()):
            return values, ids
        take = min(2 * take, vocab)


def _filter_candidates(values: torch.Tensor, ids: torch.Tensor, k: torch.Tensor,
                       top_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates in (value descending, id ascending) order with those outside the top-k, then outside the
    top-p nucleus, set to -inf: what the stable full sort and its masks give for these tokens."""
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, by_value)
    values = values.masked_fill(top_k_mask_sorted(values, k), float("-inf"))
    if top_p is not None:
        values = values.masked_fill(top_p_mask_sorted(values, top_p), float("-inf"))
    return values, ids


@dataclass
class Candidates:
    """The sampling distribution of some rows restricted to their top-k candidates (everything else is 0)."""

    rows: torch.Tensor   # [R] batch rows
    ids: torch.Tensor    # [R, C] token ids, ascending in each row (the order the inverse CDF walks)
    probs: torch.Tensor  # [R, C] float32 after temperature, top-k, top-p and min-p; dropped candidates are 0


def top_k_candidates(logits: torch.Tensor, t: SamplingTensors) -> Candidates | None:
    """The random rows' distributions over top-k candidates only, when every random row has 0 < top_k <= 1024
    (None otherwise, and when no row is random).

    Same kept sets as the full path (``apply_top_k_top_p`` on the whole vocabulary, ties included) and, in id
    order, the same probabilities up to float rounding, at the cost of one ``topk`` plus work on [R, ~k]: no
    float32 copy, temperature, softmax or cumulative sum over the vocabulary.
    """
    if t.top_k is None:
        return None
    random = t.temperature > 0
    if not bool((~random | (t.top_k > 0) & (t.top_k <= _SMALL_TOP_K)).all()):
        return None
    rows = random.nonzero().squeeze(1)
    if rows.numel() == 0:
        return None
    k = t.top_k[rows]
    sub = logits if len(rows) == logits.shape[0] else logits[rows]
    values, ids = _enclosing_topk(sub, k, t.temperature[rows].unsqueeze(1))
    values, ids = _filter_candidates(values, ids, k, None if t.top_p is None else t.top_p[rows])
    ids, by_id = ids.sort(dim=-1)
    probs = values.gather(1, by_id).softmax(dim=-1)
    if t.min_p is not None:
        probs = probs.masked_fill(min_p_mask(probs, t.min_p[rows]), 0.0)
    return Candidates(rows, ids, probs)


def random_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Each row's sampling distribution after temperature, top-k, top-p and min-p; dropped tokens are exactly 0.

    After min-p a row sums to less than 1; inverse-CDF sampling does not need it renormalised.

    Greedy rows are computed at temperature 1 (their result is discarded); dividing by their 0 would make NaNs.
    """
    candidates = top_k_candidates(logits, t)
    if candidates is not None:
        return _dense(logits, candidates)
    temperature = torch.where(t.temperature > 0, t.temperature, 1.0)
    if t.top_k is None and t.top_p is None and bool((temperature == 1.0).all()):
        probs = logits.softmax(dim=-1, dtype=torch.float32)  # one pass, even from bfloat16 logits
    else:
        scaled = apply_top_k_top_p(logits.float() / temperature.unsqueeze(1), t.top_k, t.top_p)
        probs = scaled.softmax(dim=-1)
    if t.min_p is not None:
        probs = probs.masked_fill(min_p_mask(probs, t.min_p), 0.0)
    return probs


def _dense(logits: torch.Tensor, candidates: Candidates) -> torch.Tensor:
    """[B, V] probabilities from the candidates' rows; other (greedy) rows: softmax at temperature 1, as the
    full path computes them (greedy rows have every filter off)."""
    rows, vocab = candidates.rows, logits.shape[-1]
    kept = torch.zeros(len(rows), vocab, dtype=torch.float32, device=logits.device)
    kept.scatter_(1, candidates.ids, candidates.probs)
    if len(rows) == logits.shape[0]:
        return kept
    return logits.softmax(dim=-1, dtype=torch.float32).index_copy_(0, rows, kept)


def processed_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Each row's normalised sampling distribution [B, V] after temperature, top-k, top-p and min-p; greedy rows
    get the one-hot of their argmax.

    This is the entry point for anything that needs the distribution the sampler draws from (rejection sampling
    of draft tokens, processed logprobs); ``logits`` should already carry the per-request processing of
    ``logits_processors.apply_processing`` (penalties, bias, bans, grammar masks).
    """
    t = t.to(logits.device)
    probs = random_probs(logits, t)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if t.all_random:
        return probs
    one_hot = torch.zeros_like(probs).scatter_(1, first_argmax(logits).unsqueeze(1), 1.0)
    return torch.where((t.temperature > 0).unsqueeze(1), probs, one_hot)


def processed_logprobs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """``log`` of the sampling distribution (dropped tokens are -inf). Greedy rows: ``log_softmax`` of the
    processed logits (temperature 1, no filters), which keeps alternatives meaningful where one-hot would not."""
    greedy_as_t1 = SamplingTensors(torch.where(t.temperature > 0, t.temperature, 1.0), t.top_k, t.top_p, t.min_p,
                                   [], False, True)
    probs = random_probs(logits, greedy_as_t1.to(logits.device))
    return torch.log(probs / probs.sum(dim=-1, keepdim=True))


def processed_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The logits the sampling distribution is the softmax of: divided by the temperature, the tokens top-k, top-p
    and min-p drop at -inf (greedy rows: the processed logits at temperature 1, no filters)."""
    temperature = torch.where(t.temperature > 0, t.temperature, 1.0)
    scaled = logits / temperature.unsqueeze(1)
    if t.top_k is None and t.top_p is None and t.min_p is None:  # no filter: every token keeps its logit
        return scaled
    greedy_as_t1 = SamplingTensors(temperature, t.top_k, t.top_p, t.min_p, [], False, True)
    probs = random_probs(logits, greedy_as_t1.to(logits.device))
    return scaled.masked_fill_(probs == 0, float("-inf"))


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first maximum on ties: the native kernel where it applies (``native.
    first_argmax_rows``), else ``max(dim).indices`` (documented to return the first maximal index; a fraction of
    ``argmax``'s cost on CPU, about 6x less for bfloat16 [64, 49152]), the kernel's twin."""
    fast = native.first_argmax_rows(logits)
    return fast if fast is not None else logits.max(dim=-1).indices


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """For each row, the first token whose cumulative mass exceeds ``uniforms[b]`` × the row's total mass.

    Tokens with zero probability add nothing to the cumulative sum, so they can never be picked.
    """
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


# ---- noise -------------------------------------------------------------------------------------------------------

def mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, output position) via the splitmix64 finaliser.

    Mixing (rather than seed + position) keeps nearby seeds at nearby positions from sharing noise streams.
    """
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """Turns logits into token ids (see the module docstring for the semantics)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # batch-wide noise for unseeded rows; None = torch's default generator
        self._seeded: dict[torch.device, torch.Generator] = {}  # reused and re-seeded per seeded row

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """logits [B, V] (any float dtype; probabilities are always computed in float32) → token ids [B] int64."""
        if logits.dim() != 2 or logits.shape[0] != t.temperature.shape[0]:
            raise ValueError(f"logits must be [B, V] with B = {t.temperature.shape[0]} rows, "
                             f"got shape {tuple(logits.shape)}.")
        if t.all_greedy:
            return first_argmax(logits)
        if t.temperature.device != logits.device:
            t = t.to(logits.device, non_blocking=True)
        uniforms = self._uniforms(logits, t.seeds)
        candidates = top_k_candidates(logits, t)
        if candidates is not None:  # the draw walks the candidates in id order, as the full path walks the vocab
            index = sample_inverse_cdf(candidates.probs, uniforms[candidates.rows])
            picked = candidates.ids.gather(1, index.unsqueeze(1)).squeeze(1)
            if len(candidates.rows) == logits.shape[0]:
                return picked
            return first_argmax(logits).index_copy_(0, candidates.rows, picked)
        if t.top_k is None and t.top_p is None and t.min_p is None:
            fused = native.sample_rows(logits, t.temperature, uniforms)  # greedy rows: their argmax
            if fused is not None:
                return fused
        sampled = sample_inverse_cdf(random_probs(logits, t), uniforms)
        if t.all_random:
            return sampled
        return torch.where(t.temperature > 0, sampled, first_argmax(logits))

    def _uniforms(self, like: torch.Tensor, seeds: list[tuple[int, int, int]]) -> torch.Tensor:
        """One U(0, 1) draw per row of ``like``; seeded rows are overwritten with their own reproducible draws."""
        uniforms = torch.rand(like.shape[0], generator=self.generator, device=like.device)
        if seeds:
            generator = self._seeded_generator(like.device)
            for row, seed, position in seeds:
                generator.manual_seed(mix_seed(seed, position))
                uniforms[row] = torch.rand((), generator=generator, device=like.device)
        return uniforms

    def _seeded_generator(self, device: torch.device) -> torch.Generator:
        generator = self._seeded.get(device)
        if generator is None:
            generator = self._seeded[device] = torch.Generator(device=device)
        return generator
