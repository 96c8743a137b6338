"""Token embedding and LM head, split by vocabulary rows across tensor-parallel ranks.

Each rank holds rows ``[rank * V/tp, (rank + 1) * V/tp)``. The embedding zeroes the ids it does not own and
all-reduces; the LM head computes its slice of the logits and gathers them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model.layers.linear import _copy, _param
from pagellm.ops.gemm import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.shard = parallel.shard(vocab_size, "vocab size")
        self.start = parallel.tp_rank * self.shard
        self.weight = _param((self.shard, hidden), dtype, self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        _copy(param.data, loaded.narrow(0, self.start, self.shard).to(param.dtype), "vocab shard")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the selected hidden states; may share its weight with the embedding (tied)."""

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_gather_last_dim(linear(hidden, self.weight))
