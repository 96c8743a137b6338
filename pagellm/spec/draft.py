"""Draft-model speculation: a smaller model with the target's tokenizer drafts ``k`` tokens per step, running its
own paged KV cache inside the same worker.

The draft model is either a separate checkpoint or the target itself truncated to its first ``draft_layers``
layers (then the final norm and LM head; self-speculation, no extra weights, the layers are the target's own
modules). Either way the draft's attention layers read and write the draft cache: it is bound to them only for
the duration of a draft forward pass, so the target's cache is never touched.

Per request the proposer remembers which tokens sit in its cache (``fed``). Each step it feeds only the tokens
after the longest common prefix of ``fed`` and the request's accepted tokens (drafts accepted last step are
already there), then decodes ``k - 1`` more tokens one at a time, batched over requests. Greedy requests draft
the argmax; sampled requests draw from the draft's processed distribution (the same temperature/top-k/top-p/min-p
as the target), which is kept for rejection sampling. Blocks come from the proposer's own pool; a request whose
blocks do not fit gets no draft this step; ``release`` returns a finished or preempted request's blocks.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from pagellm.attention.base import AttentionBackend, CommonAttentionInputs, forward_context, new_kv_cache
from pagellm.config import SpeculativeConfig
from pagellm.sample.sampler import SamplingTensors, first_argmax, mix_seed, random_probs, sample_inverse_cdf
from pagellm.spec.base import Draft, ProposalRequest

logger = logging.getLogger(__name__)
_DRAFT_SALT = 0x5EEDD4AF7  # draft draws must not reuse the verification draws of the same (seed, position)


class DraftBlockPool:
    """A plain free list of the draft cache's block ids (the draft cache is private to the proposer)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)


@dataclass
class _Pass:
    """One draft forward pass: which requests, which tokens, where their KV goes."""

    rows: list[int]            # indices into the requests being proposed for
    tokens: list[list[int]]    # per row, the tokens fed
    starts: list[int]          # per row, the position of its first fed token


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, num_layers: int | None, num_speculative_tokens: int,
                 backend: AttentionBackend, block_size: int, num_blocks: int, dtype: torch.dtype, seed: int = 0) -> None:
        self.model = model
        self.num_layers = num_layers
        self.num_lookahead_tokens = num_speculative_tokens
        self.backend = backend
        self.block_size = block_size
        self.attn = model.attention_layers()[:num_layers]
        self.caches = [new_kv_cache(num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype) for a in self.attn]
        self.pool = DraftBlockPool(num_blocks)
        self.req_blocks: dict[str, list[int]] = {}
        self.fed: dict[str, list[int]] = {}
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: torch.nn.Module, **runtime: Any) -> DraftModelProposer:
        if config.model is None:
            layers = len(target.model.layers)
            if config.draft_layers > layers:
                raise ValueError(f"draft_layers={config.draft_layers} exceeds the target's {layers} layers")
            return cls(target, config.draft_layers, config.num_speculative_tokens, **runtime)
        draft = load_draft_model(config.model, runtime["dtype"], target.cfg.vocab_size)
        return cls(draft, None, config.num_speculative_tokens, **runtime)

    # --------------------------------------------------------------------------------------------- proposing
    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalRequest]) -> list[Draft]:
        step, budgets = self._plan(requests)
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        depth = 0
        while step.rows:  # depth 0 catches each request up; then one token per request per pass
            logits = self._forward(step, [requests[i].req_id for i in step.rows])
            picked, dists = self._sample(logits, [requests[i] for i in step.rows], depth)
            nxt = _Pass([], [], [])
            for pos, (i, token, dist) in enumerate(zip(step.rows, picked, dists)):
                tokens[i].append(token)
                if dist is not None:
                    probs[i].append(dist)
                if len(tokens[i]) < budgets[i]:
                    nxt.rows.append(i)
                    nxt.tokens.append([token])
                    nxt.starts.append(step.starts[pos] + len(step.tokens[pos]))
            step, depth = nxt, depth + 1
        for i, r in enumerate(requests):
            if tokens[i]:
                self.fed[r.req_id] = list(r.token_ids) + tokens[i][:-1]  # the last draft is never fed
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _plan(self, requests: Sequence[ProposalRequest]) -> tuple[_Pass, list[int]]:
        """The catch-up pass (tokens after what the draft cache already holds) and each request's draft budget."""
        first = _Pass([], [], [])
        budgets = [0] * len(requests)
        for i, r in enumerate(requests):
            k = min(self.num_lookahead_tokens, r.max_tokens)
            computed = min(_common_prefix(self.fed.get(r.req_id, ()), r.token_ids), len(r.token_ids) - 1)
            if k > 0 and self._reserve(r.req_id, len(r.token_ids) + k - 1):
                budgets[i] = k
                first.rows.append(i)
                first.tokens.append(list(r.token_ids[computed:]))
                first.starts.append(computed)
        return first, budgets

    def _reserve(self, req_id: str, num_tokens: int) -> bool:
        """Hold enough draft-cache blocks for ``num_tokens`` positions; False (holding what it had) if short."""
        held = self.req_blocks.setdefault(req_id, [])
        missing = -(-num_tokens // self.block_size) - len(held)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return False
        held.extend(blocks)
        return True

    def _forward(self, step: _Pass, req_ids: list[str]) -> torch.Tensor:
        """Run the draft over one pass; the logits of each row's last fed token [rows, V]."""
        counts = np.array([len(t) for t in step.tokens], dtype=np.int64)
        starts = np.array(step.starts, dtype=np.int64)
        query_start_loc = np.concatenate([[0], np.cumsum(counts)])
        seq_lens = starts + counts
        width = int(-(-seq_lens.max() // self.block_size))
        table = np.zeros((len(req_ids), width), dtype=np.int64)
        for row, req_id in enumerate(req_ids):
            blocks = self.req_blocks[req_id][:width]
            table[row, :len(blocks)] = blocks
        positions = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts)])
        rows = np.repeat(np.arange(len(req_ids)), counts)
        slots = table[rows, positions // self.block_size] * self.block_size + positions % self.block_size
        common = CommonAttentionInputs(query_start_loc, seq_lens, table, torch.from_numpy(slots), self.block_size)
        input_ids = torch.tensor([t for chunk in step.tokens for t in chunk], dtype=torch.int64)
        with self._bound(), forward_context(self.backend, self.backend.build(common)):
            hidden = self.model(input_ids, torch.from_numpy(positions), self.num_layers)
        return self.model.compute_logits(hidden[torch.from_numpy(query_start_loc[1:] - 1)])

    @contextlib.contextmanager
    def _bound(self) -> Iterator[None]:
        """Point the draft's attention layers at the draft cache for one forward pass (then restore them)."""
        saved = [a.kv_cache for a in self.attn]
        for a, cache in zip(self.attn, self.caches):
            a.kv_cache = cache
        try:
            yield
        finally:
            for a, cache in zip(self.attn, saved):
                a.kv_cache = cache

    def _sample(self, logits: torch.Tensor, requests: list[ProposalRequest],
                depth: int) -> tuple[list[int], list[torch.Tensor | None]]:
        """Greedy requests take the argmax (no distribution kept); sampled ones draw from their processed
        distribution, which is returned for rejection sampling."""
        params = [r.sampling_params for r in requests]
        positions = [r.num_output_tokens + depth for r in requests]
        argmax = first_argmax(logits)
        t = SamplingTensors.from_params(params, positions)
        if t.all_greedy:
            return argmax.tolist(), [None] * len(requests)
        probs = random_probs(logits, t)
        uniforms = torch.rand(len(requests), generator=self.generator)
        for row, seed, position in t.seeds:
            uniforms[row] = torch.rand((), generator=torch.Generator().manual_seed(mix_seed(seed ^ _DRAFT_SALT,
                                                                                             position)))
        sampled = torch.where(t.temperature > 0, sample_inverse_cdf(probs, uniforms), argmax)
        return sampled.tolist(), [None if p.is_greedy else probs[i] for i, p in enumerate(params)]

    def release(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self.pool.free(self.req_blocks.pop(req_id, []))
            self.fed.pop(req_id, None)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(mismatch[0]) if len(mismatch) else n


def load_draft_model(path: str, dtype: torch.dtype, target_vocab: int) -> torch.nn.Module:
    """Load a separate draft checkpoint; its vocabulary must be the target's (same tokenizer)."""
    from pagellm.model.arch import ArchConfig
    from pagellm.model.loader import iter_weights, load_hf_config, resolve_model_dir
    from pagellm.model.registry import build_model
    from pagellm.distributed.groups import SINGLE

    model_dir = resolve_model_dir(path)
    arch = ArchConfig.from_hf(load_hf_config(model_dir))
    if arch.vocab_size != target_vocab:
        raise ValueError(f"draft model {path!r} has a vocabulary of {arch.vocab_size} tokens but the target has "
                         f"{target_vocab}; use a draft model with the target's tokenizer")
    model = build_model(arch, dtype, SINGLE)
    model.load_weights(iter_weights(model_dir, dtype=dtype, transient=True))
    logger.info("draft model %s: %d layers", model_dir, arch.num_layers)
    return model.eval()
