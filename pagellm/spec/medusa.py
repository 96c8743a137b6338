"""Medusa-style drafting: K small residual heads on the target's last hidden state, head k predicting the token
k + 1 places after the one the target just sampled, all sharing the target's LM head.

Head k maps the final-norm hidden state ``h`` (the one whose LM-head logits sampled the newest token) to
``h + silu(W_k h + b_k)`` and scores it with the target's LM head. With ``W_k = 0`` a head repeats the LM head's
own prediction, which is how untrained heads start (``pagellm train-draft`` trains them by self-distillation).

Drafts are a tree (``spec/tree.py``): the children of a node at depth d are head d's top-``branching[d]``
tokens, best first (Medusa's heads do not see the path, so every node at one depth offers the same candidates).
``branching`` of all ones is a plain chain of each head's argmax. Candidates are point masses, so sampled
requests are verified losslessly by the point-mass rejection rule. Requests that ask for logprobs (whose
per-token rows a tree would scatter) or are still below ``min_tokens`` (whose bans are per chain position) get
chain drafts or none; see ``propose``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from pagellm.config import SpeculativeConfig
from pagellm.spec.base import Draft, ProposalRequest
from pagellm.spec.tree import child_rank, depths, static_tree

logger = logging.getLogger(__name__)


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size, dtype=dtype) for _ in range(num_heads))
        for block in self.blocks:  # start as copies of the LM head's own prediction
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] → [B, K, H]: each head's residual update of the hidden state."""
        return torch.stack([hidden + F.silu(block(hidden)) for block in self.blocks], dim=1)

    def save(self, path: str | Path, extra: dict[str, str] | None = None) -> None:
        meta = {"method": "medusa", "hidden_size": str(self.hidden_size), "num_heads": str(self.num_heads)}
        tensors = {name: t.detach().contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, str(path), metadata={**meta, **(extra or {})})

    @classmethod
    def load(cls, path: str | Path, hidden_size: int, dtype: torch.dtype) -> MedusaHeads:
        if not Path(path).is_file():
            raise ValueError(f"Medusa heads file {str(path)!r} does not exist; train one with "
                             "`pagellm train-draft --method medusa --out FILE` (or `make draft-heads`)")
        tensors = load_file(str(path))
        num_heads = len({name.split(".")[1] for name in tensors if name.startswith("blocks.")})
        width = tensors["blocks.0.weight"].shape[1] if num_heads else 0
        if not num_heads or width != hidden_size:
            raise ValueError(f"{path} holds no Medusa heads for hidden size {hidden_size} (found {num_heads} heads "
                             f"of width {width}); train them with `pagellm train-draft --method medusa`")
        heads = cls(hidden_size, num_heads, dtype)
        heads.load_state_dict({name: t.to(dtype) for name, t in tensors.items()})
        return heads.eval()


class MedusaProposer:
    def __init__(self, heads: MedusaHeads, lm_head: nn.Module, branching: Sequence[int]) -> None:
        if len(branching) > heads.num_heads:
            raise ValueError(f"the tree is {len(branching)} deep but the Medusa file has {heads.num_heads} heads; "
                             f"use a tree (or num_speculative_tokens) of at most {heads.num_heads}")
        self.heads = heads
        self.lm_head = lm_head
        self.branching = list(branching)
        self.parents = static_tree(self.branching)
        self.is_chain = all(b == 1 for b in self.branching)
        self.depths = depths(self.parents)
        self.ranks = child_rank(self.parents)
        self.num_lookahead_tokens = len(self.parents)

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: nn.Module, dtype: torch.dtype, **_: object) -> MedusaProposer:
        heads = MedusaHeads.load(config.model, target.cfg.hidden_size, dtype)
        return cls(heads, target.lm_head, config.tree or [1] * config.num_speculative_tokens)

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalRequest]) -> list[Draft]:
        usable = [i for i, r in enumerate(requests) if r.hidden is not None and r.max_tokens > 0]
        drafts = [Draft([]) for _ in requests]
        if not usable:
            return drafts
        hidden = torch.stack([requests[i].hidden[-1] for i in usable])  # the state that sampled the newest token
        logits = self.lm_head.logits(self.heads(hidden)[:, :len(self.branching)])       # [B, depth, V]
        top = logits.topk(max(self.branching), dim=-1).indices.tolist()                 # best first
        for b, i in enumerate(usable):
            drafts[i] = self._draft(requests[i], top[b])
        return drafts

    def _draft(self, request: ProposalRequest, top: list[list[int]]) -> Draft:
        params = request.sampling_params
        chain = [top[d][0] for d in range(len(self.branching))][:request.max_tokens]
        if self.is_chain or params.logprobs is not None:
            return Draft(chain)  # a chain of argmaxes keeps logprob rows in order
        if request.num_output_tokens + len(self.branching) < params.min_tokens:
            return Draft([])  # min_tokens bans are applied per chain position, not per tree depth
        tokens = [top[d - 1][r] for d, r in zip(self.depths, self.ranks)]
        n = min(len(tokens), request.max_tokens)
        return Draft(tokens[:n], None, self.parents[:n])

    def release(self, req_ids: Sequence[str]) -> None:
        pass


def describe(path: str | Path) -> dict[str, str]:
    """The metadata saved with a heads file (method, sizes, training command)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})

