"""EAGLE drafting: a one-layer head that drafts from the target's last hidden states and the sampled tokens'
embeddings, reusing the target's embedding, final norm and LM head.

The math, for the pair (hidden state ``h_t`` at position t, token ``x_{t+1}`` it sampled)::

    f_t      = fc([embed(x_{t+1}); h_t])                 # 2H → H
    y_t      = DecoderLayer(f_{≤t})                      # one Llama layer, causal over the pairs fed so far
    h'_{t+1} = final_norm(y_t)                           # the target's own final RMSNorm
    q_{t+2}  = softmax(lm_head(h'_{t+1}))                # the target's own LM head

``h`` here is the target's *final-norm* hidden state (what the model runner hands proposers and what the LM head
scores), so the head's prediction ``h'`` lives in the same space and is fed back as the next pair's hidden state:
drafting is autoregressive, ``k`` steps per request (a chain).

The layer's context. The runner gives a proposer one true target hidden state per request per step (the row that
sampled the newest token), not one per position. The head therefore keeps, per request, the last ``window``
true pairs it has seen (position, sampled token, hidden state; all of accepted tokens, so they never need rolling
back beyond a check against the request's tokens after preemption) and each drafting step recomputes the layer
over ``window + drafted`` rows with a causal mask and the pairs' own positions under RoPE. Recomputing a window
this short (16 + k rows, one layer) costs less than bookkeeping a private KV cache, and it is exact: the head
sees the same rows whether or not it drafted for that request last step. Positions that were accepted drafts
have no true hidden state and are simply absent from the window (EAGLE's training sees every position; this only
lowers acceptance, never correctness: verification is lossless for any draft).

Greedy requests draft the argmax (point masses); sampled requests draw from the head's processed distribution
(temperature, top-k, top-p, min-p as the target), kept for rejection sampling. The head's layer uses the plain
PyTorch twins of pagellm's layers (``forward_torch``) so the same code trains (autograd) and drafts.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from pagellm.config import SpeculativeConfig
from pagellm.model.arch import ArchConfig
from pagellm.model.layers.activation import SiluAndMul
from pagellm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, pack_weights
from pagellm.model.layers.norm import RMSNorm
from pagellm.model.layers.rotary import RotaryEmbedding
from pagellm.sample.sampler import SamplingTensors, mix_seed, random_probs, sample_inverse_cdf
from pagellm.spec.base import Draft, ProposalRequest
from pagellm.spec.tree import static_tree

logger = logging.getLogger(__name__)
WINDOW = 16                  # true (hidden, token) pairs kept per request as the layer's context
_EAGLE_SALT = 0xEA61E5EED    # draft draws must not reuse the verification draws of the same (seed, position)


class EagleHead(nn.Module):
    """fc(concat(embed, hidden)) → one Llama decoder layer; shapes from the target's ``ArchConfig``."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        hidden, self.num_heads, self.num_kv_heads, self.head_dim = (cfg.hidden_size, cfg.num_heads,
                                                                    cfg.num_kv_heads, cfg.head_dim)
        self.fc = nn.Linear(2 * hidden, hidden, bias=True, dtype=dtype)
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.qkv_proj = QKVParallelLinear(hidden, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.attention_bias, dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, hidden, False, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.gate_up_proj = ColumnParallelLinear(hidden, [cfg.intermediate_size] * 2, False, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, hidden, False, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      dtype)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            p.requires_grad_(True)  # pagellm's layers create frozen (loaded) parameters; the head is trainable
            if name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                segments: Sequence[int]) -> torch.Tensor:
        """Rows [N, H] of (token embedding, hidden state) at ``positions`` [N], laid out as consecutive
        ``segments`` (one per request or tree path), each attending causally within itself only. Returns the
        layer's output (the residual stream, before the final norm)."""
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        h, residual = self.input_layernorm.forward_torch(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(h).split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.rotary.forward_torch(positions, q.reshape(-1, self.num_heads, self.head_dim),
                                         k.reshape(-1, self.num_kv_heads, self.head_dim))
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim).repeat_interleave(groups, dim=1)
        h = self.o_proj(segment_attention(q, k, v, segments, self.head_dim ** -0.5).reshape(-1, q_size))
        h, residual = self.post_attention_layernorm.forward_torch(h, residual)
        return self.down_proj(SiluAndMul.forward_torch(self.gate_up_proj(h))) + residual

    def save(self, path: str | Path, extra: dict[str, str] | None = None) -> None:
        meta = {"method": "eagle", "hidden_size": str(self.cfg.hidden_size), "num_heads": str(self.num_heads),
                "num_kv_heads": str(self.num_kv_heads), "intermediate_size": str(self.cfg.intermediate_size)}
        tensors = {name: t.detach().contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, str(path), metadata={**meta, **(extra or {})})

    @classmethod
    def load(cls, path: str | Path | None, cfg: ArchConfig, dtype: torch.dtype) -> EagleHead:
        fix = "train one for this target with `pagellm train-draft --method eagle --model TARGET --out FILE`"
        if path is None or not Path(path).is_file():
            raise ValueError(f"EAGLE head file {str(path)!r} does not exist; {fix}")
        tensors = load_file(str(path))
        head = cls(cfg, dtype)
        expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
        found = {name: tuple(t.shape) for name, t in tensors.items()}
        if found != expected:
            wrong = sorted(n for n in expected.keys() | found.keys() if expected.get(n) != found.get(n))
            raise ValueError(f"{path} is not an EAGLE head for this target (hidden {cfg.hidden_size}, "
                             f"{cfg.num_heads}/{cfg.num_kv_heads} heads); mismatched tensors {wrong[:4]}; {fix}")
        head.load_state_dict({name: t.to(dtype) for name, t in tensors.items()})
        pack_weights(head)  # bfloat16: its layers take the packed GEMM like the target's
        return head.eval()


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[int],
                      scale: float) -> torch.Tensor:
    """Causal attention within each segment of consecutive rows ([N, heads, D] each): the segments are padded
    to one length and batched, so memory grows with segments x length², not with N²."""
    lengths = torch.tensor(list(segments))
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    offset = torch.arange(len(seg)) - (lengths.cumsum(0) - lengths)[seg]
    width = int(lengths.max())

    def padded(t: torch.Tensor) -> torch.Tensor:  # [S, heads, width, D]
        out = t.new_zeros(len(lengths), width, *t.shape[1:])
        out[seg, offset] = t
        return out.transpose(1, 2)

    idx = torch.arange(width)
    allowed = (idx[:, None] >= idx[None, :]) & (idx[None, None, :] < lengths[:, None, None])  # [S, width, width]
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=allowed[:, None], scale=scale)
    return out.transpose(1, 2)[seg, offset]


class EagleProposer:
    def __init__(self, head: EagleHead, target: nn.Module, num_speculative_tokens: int,
                 branching: Sequence[int] | None = None, seed: int = 0) -> None:
        self.head = head
        self.embed = target.model.embed_tokens
        self.norm = target.model.norm
        self.lm_head = target.lm_head
        self.k = num_speculative_tokens
        # a tree of single children is a chain, which keeps the draft distributions of sampled requests
        self.branching = list(branching) if branching and any(b > 1 for b in branching) else None
        self.parents = static_tree(self.branching) if self.branching else None
        self.num_lookahead_tokens = len(self.parents) if self.parents else num_speculative_tokens
        self.history: dict[str, list[tuple[int, int, torch.Tensor]]] = {}  # (position of token, token, hidden)
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: nn.Module, dtype: torch.dtype,
                    **_: Any) -> EagleProposer:
        head = EagleHead.load(config.model, target.cfg, dtype)
        return cls(head, target, config.num_speculative_tokens, config.tree)

    def _remember(self, request: ProposalRequest) -> list[tuple[int, int, torch.Tensor]]:
        """The request's window after adding its newest pair; pairs no longer in its tokens are dropped."""
        tokens = request.token_ids
        newest = len(tokens) - 1
        kept = [p for p in self.history.get(request.req_id, []) if p[0] < newest and tokens[p[0]] == p[1]]
        # a copy: the runner's row is a view of the whole step's hidden states, which it must not keep alive
        kept.append((newest, int(tokens[newest]), request.hidden.clone()))
        self.history[request.req_id] = kept[-WINDOW:]
        return self.history[request.req_id]

    def _wants_tree(self, request: ProposalRequest) -> bool:
        """Trees only where their rows can be processed: no logprobs (whose rows a tree would scatter) and past
        min_tokens (whose bans apply per chain position); the others get chains."""
        params = request.sampling_params
        return (self.branching is not None and params.logprobs is None
                and request.num_output_tokens + len(self.branching) >= params.min_tokens)

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalRequest]) -> list[Draft]:
        usable = [r for r in requests if r.hidden is not None and r.max_tokens > 0 and len(r.token_ids) > 1]
        windows = {r.req_id: self._remember(r) for r in usable}
        trees = [r for r in usable if self._wants_tree(r)]
        chains = [r for r in usable if not self._wants_tree(r)]
        drafts = {r.req_id: Draft([]) for r in requests}
        drafts.update(self._chains(chains, windows))
        drafts.update(self._trees(trees, windows))
        return [drafts[r.req_id] for r in requests]

    def _chains(self, requests: list[ProposalRequest], windows: dict[str, list]) -> dict[str, Draft]:
        """k autoregressive steps, each feeding the head's predicted hidden state with the token drawn from it."""
        if not requests:
            return {}
        rows = [list(windows[r.req_id]) for r in requests]
        steps = min(len(self.branching) if self.branching else self.k, max(r.max_tokens for r in requests))
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for depth in range(steps):
            predicted, logits = self._step(rows)
            sampled, dists = self._sample(logits, requests, depth)
            for b, (tok, dist) in enumerate(zip(sampled, dists)):
                tokens[b].append(tok)
                if dist is not None:
                    probs[b].append(dist)
                rows[b].append((rows[b][-1][0] + 1, tok, predicted[b]))
        out = {}
        for b, r in enumerate(requests):
            n = min(r.max_tokens, steps)
            out[r.req_id] = Draft(tokens[b][:n], torch.stack(probs[b][:n]) if probs[b] else None)
        return out

    def _trees(self, requests: list[ProposalRequest], windows: dict[str, list]) -> dict[str, Draft]:
        """The static tree, breadth-first as ``static_tree`` numbers it: a node's children are the head's top
        candidates after the node's own path (window + ancestors), best first; point masses."""
        if not requests:
            return {}
        tokens: list[list[int]] = [[] for _ in requests]
        frontier = [(b, list(windows[r.req_id])) for b, r in enumerate(requests)]  # (request, path rows)
        for width in self.branching:
            predicted, logits = self._step([rows for _, rows in frontier])
            top = logits.topk(width, dim=-1).indices.tolist()
            children = []
            for s, (b, rows) in enumerate(frontier):
                for tok in top[s]:
                    tokens[b].append(tok)
                    children.append((b, rows + [(rows[-1][0] + 1, tok, predicted[s])]))
            frontier = children
        out = {}
        for b, r in enumerate(requests):
            n = min(len(tokens[b]), r.max_tokens)
            out[r.req_id] = Draft(tokens[b][:n], None, self.parents[:n])
        return out

    def _step(self, rows: list[list[tuple[int, int, torch.Tensor]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer pass over every request's rows; the predicted hidden state and logits at each last row."""
        flat = [p for seq in rows for p in seq]
        positions = torch.tensor([p[0] for p in flat])
        embeds = self.embed(torch.tensor([p[1] for p in flat]))
        hidden = torch.stack([p[2] for p in flat]).to(embeds.dtype)
        out = self.head(embeds, hidden, positions, [len(seq) for seq in rows])
        last = torch.tensor([len(seq) for seq in rows]).cumsum(0) - 1
        predicted = self.norm.forward_torch(out[last])[0]
        return predicted, self.lm_head.logits(predicted)

    def _sample(self, logits: torch.Tensor, requests: list[ProposalRequest],
                depth: int) -> tuple[list[int], list[torch.Tensor | None]]:
        """Greedy requests take the argmax (no distribution kept); sampled ones draw from their processed
        distribution, returned for rejection sampling."""
        params = [r.sampling_params for r in requests]
        argmax = logits.argmax(dim=-1)
        t = SamplingTensors.from_params(params, [r.num_output_tokens + depth for r in requests])
        if t.all_greedy:
            return argmax.tolist(), [None] * len(requests)
        probs = random_probs(logits, t)
        uniforms = torch.rand(len(requests), generator=self.generator)
        for row, seed, position in t.seeds:
            gen = torch.Generator().manual_seed(mix_seed(seed ^ _EAGLE_SALT, position))
            uniforms[row] = torch.rand((), generator=gen)
        sampled = torch.where(t.temperature > 0, sample_inverse_cdf(probs, uniforms), argmax)
        return sampled.tolist(), [None if p.is_greedy else probs[i] for i, p in enumerate(params)]

    def release(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self.history.pop(req_id, None)
