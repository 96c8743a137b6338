"""Token embedding and LM head, split by vocabulary rows across tensor-parallel ranks.

Each rank holds ``ceil(V/tp)`` rows from ``rank * ceil(V/tp)``; the last rank's rows past ``V`` are zero padding,
so any vocabulary splits over any number of ranks (Qwen's 151,936 over 3). The embedding zeroes the ids it does
not own and all-reduces; the LM head computes its slice of the logits, gathers them and drops the padding's.

The LM head's weight is packed for the bfloat16 GEMM after loading (``linear.pack_weights``), or quantized for the
int8 one (``quantized``, the engine's ``quantize_lm_head``). A tied LM head shares the embedding's Parameter, so the
embedding then reads its rows out of the packed matrix (``ops.gemm.weight_rows``: a gather of the looked-up rows
only, dequantized where the head is int8) and the model keeps one copy of the table. An untied embedding stays plain.
Code that needs plain rows of either (draft heads, training) uses ``rows(ids)`` or ``plain_weight()``, never
``.weight`` directly.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model.layers.linear import _copy, _loadable, _param
from pagellm.ops import gemm, gemm_w8a8


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // parallel.tp_size)  # rows per rank
        self.start = parallel.tp_rank * self.shard
        self.owned = max(0, min(self.shard, vocab_size - self.start))  # the rest of this rank's rows: padding
        self.weight = _param((self.shard, hidden), dtype, self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint tensor for the vocabulary has {loaded.shape[0]} rows, expected "
                             f"{self.vocab_size}")
        table = _loadable(param)
        table[self.owned:].zero_()
        _copy(table[:self.owned], loaded.narrow(0, self.start, self.owned), "vocab shard")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Plain rows ``W[ids]`` of this rank's shard (local row ids), whatever the weight's layout."""
        return gemm.weight_rows(self.weight, ids)

    def plain_weight(self) -> torch.Tensor:
        """This rank's ``[V/tp, H]`` table in the plain layout (a new tensor when the weight is packed)."""
        return gemm.plain(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.full_rows(ids)

    def full_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Plain rows of the whole table for vocabulary ids: each rank's own, summed over the ranks (a collective
        every rank must call)."""
        if self.parallel.tp_size == 1:
            return self.rows(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.owned)
        out = self.rows(local.masked_fill(outside, 0))
        return self.parallel.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the selected hidden states; may share its weight with the embedding (tied)."""

    quantized = False  # int8 rows (``quantize_lm_head``), set before the weights load

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def pack_weight(self) -> bool:
        if not self.quantized:
            return gemm.pack_parameter(self.weight)
        if self.weight.dtype != torch.bfloat16:
            raise ValueError(f"quantize_lm_head runs on bfloat16 models; set dtype bfloat16 (this model is "
                             f"{self.weight.dtype})")
        gemm_w8a8.quantize_parameter(self.weight)
        return True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gemm.linear(hidden, self.weight)
        if self.parallel.tp_size == 1:
            return logits
        return self.parallel.all_gather_last_dim(logits)[..., :self.vocab_size]
