"""EAGLE drafting: the one-layer head of ``spec/eagle_head.py`` drafts autoregressively from the target's final
hidden states and the sampled tokens, as a chain, a static tree, or an EAGLE-2 dynamic tree.

**The head's context.** The runner hands the proposer, per request, the target's hidden state at every position
its step computed and accepted (``ProposalRequest.hidden``: the prompt rows of a prefill, the root and the
accepted drafts of a verification). Each such state and the token it produced form a *true pair*; the proposer
keeps, per request, the layer's keys and values of the last ``head.window`` true pairs (the training window) (a pair's k/v depend on that
pair alone, so they never need recomputing), checked against the request's tokens each step (pairs whose token
changed, e.g. after a preemption, are dropped) and released with the request. A drafting pass computes only its
new rows, each attending to its request's window plus its own ancestors in the draft (``masked_attention``),
so the cost per depth grows with the number of drafted nodes, not with the window.

**Shapes.** Depth d's nodes are fed the head's predicted hidden state of their parent and their own token:

- chain (``num_speculative_tokens`` = k): greedy requests draft the argmax; sampled requests draw from the
  head's processed distribution (temperature, top-k, top-p, min-p as the target), kept for rejection sampling;
- static tree (``tree``, e.g. ``[3, 2, 1, 1]``): every node at depth d gets the head's top ``tree[d]`` tokens;
- dynamic tree (EAGLE-2; ``eagle_topk``, ``num_draft_tokens``): each node's score is its path's draft log
  probability; at each depth the ``eagle_topk`` best-scoring nodes are expanded with their ``eagle_topk`` best
  children, and after ``k`` depths the ``num_draft_tokens`` best nodes of all drafted are kept
  (``tree.best_subtree``: a child never scores above its parent, so the kept nodes form a tree).

``prompt_lookup_tokens`` merges one more branch into a tree: the prompt-lookup (n-gram) continuation
(``spec/ngram.py``), following existing nodes while they match and appending the rest (EAGLE's head is weak at
copying long spans from the prompt, which n-gram lookup does for free).

Tree nodes are point masses (distinct tokens per parent), so sampled requests stay lossless under the tree
rule; requests that ask for logprobs or are below ``min_tokens`` get chains. With a draft vocabulary
(``EagleHead.draft_vocab``, optionally cut to ``draft_vocab_size``) the LM head scores only those rows and the
draft distribution is zero elsewhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from pagellm.config import SpeculativeConfig
from pagellm.ops import gemm
from pagellm.ops.gemm import linear
from pagellm.sample.sampler import SamplingTensors, mix_seed, random_probs, sample_inverse_cdf
from pagellm.spec.base import Draft, ProposalRequest
from pagellm.spec.eagle_head import DEFAULT_HEAD, EagleHead, masked_attention
from pagellm.spec.ngram import NgramProposer
from pagellm.spec.tree import best_subtree

logger = logging.getLogger(__name__)
WINDOW = 64                  # default training window: true pairs of context (the head file records its own)
_EAGLE_SALT = 0xEA61E5EED    # draft draws must not reuse the verification draws of the same (seed, position)


@dataclass
class _Window:
    """A request's last true pairs: token position, token, and the layer's k/v per pair."""
    positions: list[int]
    tokens: list[int]
    k: torch.Tensor  # [n, kv_heads, D]
    v: torch.Tensor


@dataclass
class _Node:
    token: int
    parent: int                            # node index, -1: the root
    depth: int                             # 1 for the root's children
    score: float = 0.0                     # dynamic trees: log draft probability of the path
    probs: torch.Tensor | None = None      # sampled chains: the distribution the token was drawn from
    keys: list[int] = field(default_factory=list)  # this pass's KV rows of the node's path (once expanded)


@dataclass
class _Plan:
    """One request's draft under construction."""
    request: ProposalRequest
    shape: str                             # "chain", "static" or "dynamic"
    position: int                          # token position of the newest true pair
    window_rows: list[int]
    nodes: list[_Node] = field(default_factory=list)


@dataclass
class _Pass:
    """The head's outputs for one batch of rows (one per request root or expanded node)."""
    predicted: torch.Tensor  # [F, H] predicted hidden states (the children's input)
    logits: torch.Tensor     # [F, draft vocab]


class EagleProposer:
    def __init__(self, head: EagleHead, target: nn.Module, num_speculative_tokens: int,
                 branching: Sequence[int] | None = None, seed: int = 0, topk: int | None = None,
                 num_draft_tokens: int | None = None, draft_vocab_size: int | None = None,
                 lookup: NgramProposer | None = None) -> None:
        self.head = head
        self.embed = target.model.embed_tokens
        self.norm = target.model.norm
        self.k = num_speculative_tokens
        # a tree of single children is a chain, which keeps the draft distributions of sampled requests
        self.branching = list(branching) if branching and any(b > 1 for b in branching) else None
        self.topk, self.budget = topk, num_draft_tokens
        if self.topk:
            self.num_lookahead_tokens = int(num_draft_tokens)
        elif self.branching:
            self.num_lookahead_tokens = sum(_prod(self.branching[:d + 1]) for d in range(len(self.branching)))
        else:
            self.num_lookahead_tokens = num_speculative_tokens
        self.lookup = lookup if self.topk or self.branching else None
        if self.lookup is not None:
            self.num_lookahead_tokens += self.lookup.num_lookahead_tokens
        self.lm_head = target.lm_head
        self.vocab_rows, self.lm_weight = _draft_lm_head(head, target.lm_head, draft_vocab_size)
        self.vocab = target.cfg.vocab_size
        self.windows: dict[str, _Window] = {}
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: nn.Module, dtype: torch.dtype,
                    seed: int = 0, **_: Any) -> EagleProposer:
        head = EagleHead.load(config.model or DEFAULT_HEAD, target.cfg, dtype)
        lookup = NgramProposer(config.prompt_lookup_tokens, config.prompt_lookup_min, config.prompt_lookup_max) \
            if config.prompt_lookup_tokens else None
        return cls(head, target, config.num_speculative_tokens, config.tree, seed, config.eagle_topk,
                   config.num_draft_tokens, config.draft_vocab_size, lookup)

    @property
    def history(self) -> dict[str, list[tuple[int, int]]]:
        """(position, token) of each request's window pairs (for tests and debugging)."""
        return {r: list(zip(w.positions, w.tokens)) for r, w in self.windows.items()}

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalRequest]) -> list[Draft]:
        usable = [r for r in requests if r.hidden is not None and r.max_tokens > 0 and len(r.token_ids) > 1]
        drafts = {r.req_id: Draft([]) for r in requests}
        if usable:
            rows_k, rows_v, roots = self._update_windows(usable)
            plans, store = self._plans(usable, rows_k, rows_v)
            self._draft(plans, store, roots)
            drafts.update({p.request.req_id: self._finish(p) for p in plans})
        return [drafts[r.req_id] for r in requests]

    def release(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self.windows.pop(req_id, None)

    # -- the window of true pairs -------------------------------------------------------------------------

    def _update_windows(self, requests: list[ProposalRequest]) -> tuple[list, list, tuple]:
        """Project every request's new true pairs in one call, append their k/v to its window (trimmed to
        the head's window); returns the windows' k/v and (residual, q) of each request's newest pair."""
        embeds, hiddens, positions, counts = [], [], [], []
        for r in requests:
            n = min(len(r.hidden), self.head.window, len(r.token_ids) - 1)
            first = len(r.token_ids) - n  # token positions first .. len - 1 pair with the last n hidden rows
            tokens = torch.as_tensor(list(r.token_ids[first:]), dtype=torch.int64)
            embeds.append(self.embed(tokens))
            hiddens.append(r.hidden[len(r.hidden) - n:])
            positions.append(torch.arange(first, len(r.token_ids)))
            counts.append(n)
        embeds_all = torch.cat(embeds)
        residual, q, k, v = self.head.project(embeds_all, torch.cat(hiddens).to(embeds_all.dtype),
                                              torch.cat(positions))
        last = torch.tensor(counts).cumsum(0) - 1
        ks, vs = k.split(counts), v.split(counts)
        out_k, out_v = [], []
        for r, n, kr, vr in zip(requests, counts, ks, vs):
            window = self._kept(r, len(r.token_ids) - n)
            tokens = list(r.token_ids[len(r.token_ids) - n:])
            merged = _Window(window.positions + list(range(len(r.token_ids) - n, len(r.token_ids))),
                             window.tokens + tokens, torch.cat([window.k, kr]), torch.cat([window.v, vr]))
            cut = max(len(merged.tokens) - self.head.window, 0)
            self.windows[r.req_id] = _Window(merged.positions[cut:], merged.tokens[cut:], merged.k[cut:].clone(),
                                             merged.v[cut:].clone())
            out_k.append(self.windows[r.req_id].k)
            out_v.append(self.windows[r.req_id].v)
        return out_k, out_v, (residual[last], q[last])

    def _kept(self, request: ProposalRequest, first_new: int) -> _Window:
        """The request's stored pairs before ``first_new`` that still match its tokens, up to the first one
        that does not (every later pair was computed in a context that no longer holds). A gap (steps whose
        rows the proposer never saw) is kept: the pairs on either side are still this context's."""
        old = self.windows.get(request.req_id)
        kv = self.head.num_kv_heads, self.head.head_dim
        empty = _Window([], [], self.lm_weight.new_zeros(0, *kv), self.lm_weight.new_zeros(0, *kv))
        if old is None:
            return empty
        keep = 0
        tokens = request.token_ids
        for pos, tok in zip(old.positions, old.tokens):
            if pos >= first_new or tokens[pos] != tok:
                break
            keep += 1
        return _Window(old.positions[:keep], old.tokens[:keep], old.k[:keep], old.v[:keep])

    def _plans(self, requests: list[ProposalRequest], ks: list, vs: list) -> tuple[list[_Plan], _KVStore]:
        store = _KVStore()
        plans = []
        for r, k, v in zip(requests, ks, vs):
            rows = store.add(k, v)
            plans.append(_Plan(r, self._shape(r), len(r.token_ids) - 1, rows))
        return plans, store

    def _shape(self, request: ProposalRequest) -> str:
        """Trees only where their rows can be processed: no logprobs (whose rows a tree would scatter) and past
        min_tokens (whose bans apply per chain position); the others get chains."""
        params = request.sampling_params
        if (self.topk is None and self.branching is None) or params.logprobs is not None \
                or request.num_output_tokens + self.k < params.min_tokens:
            return "chain"
        return "dynamic" if self.topk else "static"

    # -- drafting -----------------------------------------------------------------------------------------

    def _draft(self, plans: list[_Plan], store: _KVStore, roots: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Depth by depth: the head's pass over the frontier, then each plan's children and next frontier."""
        residual, q = roots
        keys = [p.window_rows for p in plans]
        out = self._attend_and_finish(residual, q, store, keys)
        frontier = [(b, -1) for b in range(len(plans))]           # (plan, node): rows of ``out``
        for depth in range(1, self.k + 1):
            new = self._children(plans, frontier, out, depth)
            if depth == self.k:
                return
            expand = [(b, n) for b, nodes in new for n in self._expanded(plans[b], nodes)]
            if not expand:
                return
            out = self._expand(plans, expand, frontier, out, store)
            frontier = expand

    def _expand(self, plans: list[_Plan], expand: list[tuple[int, int]], frontier: list[tuple[int, int]],
                out: _Pass, store: _KVStore) -> _Pass:
        """The head's pass over the nodes to expand: each is the pair (its parent's predicted hidden state, its
        token) at position root + depth, attending to its window, its ancestors and itself."""
        where = {entry: i for i, entry in enumerate(frontier)}
        nodes = [plans[b].nodes[n] for b, n in expand]
        parents = torch.tensor([where[(b, plans[b].nodes[n].parent)] for b, n in expand])
        tokens = torch.tensor([node.token for node in nodes])
        positions = torch.tensor([plans[b].position + node.depth for (b, _), node in zip(expand, nodes)])
        residual, q, k, v = self.head.project(self.embed(tokens), out.predicted[parents], positions)
        rows = store.add(k, v)
        keys = []
        for (b, n), node, row in zip(expand, nodes, rows):
            parent = plans[b].nodes[node.parent].keys if node.parent >= 0 else []
            node.keys = parent + [row]
            keys.append(plans[b].window_rows + node.keys)
        return self._attend_and_finish(residual, q, store, keys)

    def _attend_and_finish(self, residual: torch.Tensor, q: torch.Tensor, store: _KVStore,
                           keys: list[list[int]]) -> _Pass:
        rows = [i for i, row in enumerate(keys) for _ in row]
        cols = [j for row in keys for j in row]
        mask = torch.zeros(len(keys), store.rows, dtype=torch.bool)
        mask[torch.tensor(rows), torch.tensor(cols)] = True  # one write: each query's window and ancestors
        k, v = store.tensors()
        attended = masked_attention(q, k, v, mask, self.head.head_dim ** -0.5)
        predicted = self.norm(self.head.finish(residual, attended))[0]
        split = self.vocab_rows is None and self.lm_head.parallel.tp_size > 1  # a whole vocabulary over ranks
        logits = self.lm_head.logits(predicted) if split else linear(predicted, self.lm_weight)
        return _Pass(predicted, logits)

    def _children(self, plans: list[_Plan], frontier: list[tuple[int, int]], out: _Pass,
                  depth: int) -> list[tuple[int, list[int]]]:
        """Append each frontier entry's children to its plan; returns (plan, new node indices) per plan."""
        logp = torch.log_softmax(out.logits.float(), dim=-1)
        width = max(self.topk or 1, max(self.branching or [1]))
        top_vals, top_idx = logp.topk(min(width, logp.shape[-1]), dim=-1)
        top_vals, top_idx = top_vals.tolist(), self._token_ids(top_idx).tolist()
        sampled = self._sample_chains(plans, frontier, out.logits, depth)
        added: dict[int, list[int]] = {}
        for i, (b, parent) in enumerate(frontier):
            plan = plans[b]
            base = plan.nodes[parent].score if parent >= 0 else 0.0
            count = 1 if plan.shape == "chain" else self.topk if plan.shape == "dynamic" \
                else self.branching[depth - 1]
            for rank in range(count):
                token, probs = sampled[i] if i in sampled else (top_idx[i][rank], None)
                score = min(base + top_vals[i][rank], base)
                added.setdefault(b, []).append(len(plan.nodes))
                plan.nodes.append(_Node(token, parent, depth, score, probs))
        return sorted(added.items())

    def _expanded(self, plan: _Plan, new: list[int]) -> list[int]:
        """Which of a plan's new nodes get children: all of them, or a dynamic tree's ``topk`` best."""
        if plan.shape != "dynamic":
            return new
        return sorted(new, key=lambda n: (-plan.nodes[n].score, n))[:self.topk]

    def _sample_chains(self, plans: list[_Plan], frontier: list[tuple[int, int]], logits: torch.Tensor,
                       depth: int) -> dict[int, tuple[int, torch.Tensor]]:
        """Frontier rows of sampled chain requests → (token drawn, its distribution over the target vocab)."""
        rows = [i for i, (b, _) in enumerate(frontier)
                if plans[b].shape == "chain" and not plans[b].request.sampling_params.is_greedy]
        if not rows:
            return {}
        requests = [plans[frontier[i][0]].request for i in rows]
        t = SamplingTensors.from_params([r.sampling_params for r in requests],
                                        [r.num_output_tokens + depth - 1 for r in requests])
        probs = random_probs(logits[torch.tensor(rows)].float(), t)
        uniforms = torch.rand(len(rows), generator=self.generator)
        for row, seed, position in t.seeds:
            gen = torch.Generator().manual_seed(mix_seed(seed ^ _EAGLE_SALT, position))
            uniforms[row] = torch.rand((), generator=gen)
        drawn = self._token_ids(sample_inverse_cdf(probs, uniforms)).tolist()
        full = probs.new_zeros(len(rows), self.vocab)
        full[:, self.vocab_rows if self.vocab_rows is not None else slice(None)] = probs
        return {i: (tok, full[j]) for j, (i, tok) in enumerate(zip(rows, drawn))}

    def _token_ids(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.vocab_rows is None else self.vocab_rows[index]

    def _finish(self, plan: _Plan) -> Draft:
        limit = plan.request.max_tokens
        nodes = plan.nodes
        if plan.shape == "chain":
            nodes = nodes[:limit]
            probs = [n.probs for n in nodes if n.probs is not None]
            return Draft([n.token for n in nodes], torch.stack(probs) if probs else None)
        if plan.shape == "dynamic":
            order = best_subtree([n.parent for n in nodes], [n.score for n in nodes], min(self.budget, limit))
        else:
            order = list(range(min(len(nodes), limit)))
        renumber = {old: new for new, old in enumerate(order)}
        parents = [renumber[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in order]
        tokens = [nodes[i].token for i in order]
        if self.lookup is not None:
            _merge_branch(tokens, parents, self.lookup.propose_one(plan.request.token_ids, limit - len(tokens)))
        return Draft(tokens, None, parents)


def _merge_branch(tokens: list[int], parents: list[int], branch: list[int]) -> None:
    """Merge a chain of tokens below the root into a tree (in place): follow existing nodes while they match,
    then append the rest as new nodes, each numbered after its parent (so every prefix is still a tree)."""
    current = -1
    for token in branch:
        child = next((i for i, p in enumerate(parents) if p == current and tokens[i] == token), None)
        if child is None:
            tokens.append(token)
            parents.append(current)
            child = len(tokens) - 1
        current = child


class _KVStore:
    """The k/v rows one propose call attends over: every plan's window, then each pass's new nodes."""

    def __init__(self) -> None:
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows = 0
        self._cat: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, k: torch.Tensor, v: torch.Tensor) -> list[int]:
        self.k.append(k)
        self.v.append(v)
        self._cat = None
        self.rows += k.shape[0]
        return list(range(self.rows - k.shape[0], self.rows))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cat is None:
            self._cat = (torch.cat(self.k), torch.cat(self.v))
        return self._cat


def _draft_lm_head(head: EagleHead, lm_head: nn.Module,
                   size: int | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The token ids the draft scores (None: every row) and the LM-head weight for them: the target's own
    (plain or packed) for the full vocabulary, else its rows for the subset, packed like the target's (gathered
    from every tensor-parallel rank's shard, so each rank holds the same rows)."""
    rows = head.draft_vocab
    if rows is None or size == 0:
        return None, lm_head.weight
    if size is not None:
        if size > len(rows):
            raise ValueError(f"draft_vocab_size={size} exceeds the head's draft vocabulary of {len(rows)} tokens; "
                             "use at most that, or 0 for the full vocabulary")
        rows = rows[:size]
    weight = nn.Parameter(lm_head.full_rows(rows).contiguous(), requires_grad=False)
    gemm.pack_parameter(weight)  # bfloat16 where the native kernel runs; plain otherwise
    return rows, weight


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out
