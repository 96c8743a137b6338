"""The tuned CPU backend: decode rows run a C++ paged-attention kernel (``csrc/paged_decode.cpp``) that reads K/V
straight from the paged cache with an online softmax, instead of gathering and padding them; rows with several
query tokens are batched by similar length into one SDPA call per group (``chunk_batch.py``); draft-tree rows
(speculative decoding) take the reference path with their ancestor mask. The kernel is compiled on first use with
the machine's C++ compiler (``pagellm/ops/build.py``: a plain C ABI loaded with ctypes, about a second to build)
and cached; ``torch_ref`` is its test oracle and the fallback.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pagellm.attention.base import CommonAttentionInputs, register_backend
from pagellm.attention.chunk_batch import ChunkGroup, build_group, group_attention, group_rows
from pagellm.attention.torch_ref import TorchRefBackend, TorchRefMetadata, chunk_attention, decode_rows, write_kv
from pagellm.ops.build import load_library

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


class DecodeKernel:
    """The compiled kernel's entry points behind a tensor-level call (checks, dtype dispatch, output allocation)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.bfloat16: lib.pagellm_paged_decode_bf16, torch.float32: lib.pagellm_paged_decode_f32}
        for fn in self._fns.values():
            fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_void_p]
            fn.restype = None

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; block_table: [B, max_blocks];
        seq_lens: [B] (context length including the query token). Returns [B, H, D]."""
        if q.dim() != 3 or k_cache.dim() != 4 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("paged_decode_attention needs q [B, H, D] and contiguous 4-D caches")
        if q.dtype not in self._fns or k_cache.dtype != q.dtype or q.shape[1] % k_cache.shape[2]:
            raise ValueError("paged_decode_attention needs float32 or bfloat16 q and caches of the same dtype, "
                             "and heads a multiple of kv heads")
        q = q.contiguous()
        table = block_table.to(torch.int64).contiguous()
        lens = seq_lens.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        self._fns[q.dtype](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), lens.data_ptr(),
                           q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2], table.shape[1],
                           scale, out.data_ptr())
        return out


@functools.lru_cache(maxsize=1)
def load_kernel() -> DecodeKernel:
    """Compile (once per source version and machine kind, about a second) and load the C++ kernel."""
    return DecodeKernel(load_library(_SOURCE))


@dataclass
class CpuPagedMetadata(TorchRefMetadata):
    groups: list[ChunkGroup] = field(default_factory=list)  # multi-token rows, batched by similar length


class CpuPagedBackend(TorchRefBackend):
    name = "cpu_paged"

    def __init__(self) -> None:
        self.kernel = load_kernel()

    def build(self, common: CommonAttentionInputs) -> CpuPagedMetadata:
        q_lens = np.diff(common.query_start_loc)
        tokens, table, mask = decode_rows(common)
        seq_lens = torch.from_numpy(common.seq_lens[q_lens == 1]) if tokens is not None else None
        multi = q_lens > 1
        trees = common.tree_masks or {}
        if trees:  # draft trees take the reference path with their ancestor mask
            multi = multi.copy()
            multi[list(trees)] = False
        fresh = multi & (common.seq_lens == q_lens)   # no cached context: causal over the step's k/v
        groups = [build_group(common, rows, fresh=True) for rows in _grouped(q_lens, fresh)]
        groups += [build_group(common, rows) for rows in _grouped(q_lens, multi & ~fresh)]
        chunks = [self._chunk(common, row) for row in sorted(trees)]
        return CpuPagedMetadata(common.slot_mapping, int(common.query_start_loc[-1]), tokens, table, mask, chunks,
                                seq_lens, groups)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: CpuPagedMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.slot_mapping)
        num_heads, head_dim = q.shape[1], q.shape[2]
        if not metadata.groups and metadata.decode_tokens is not None and \
                len(metadata.decode_tokens) == metadata.num_tokens:
            return self._decode(q, kv_cache, metadata, scale).view(-1, num_heads * head_dim)  # all decodes
        out = torch.empty(metadata.num_tokens, num_heads * head_dim, dtype=q.dtype)
        if metadata.decode_tokens is not None:
            decoded = self._decode(q[metadata.decode_tokens], kv_cache, metadata, scale)
            out[metadata.decode_tokens] = decoded.view(-1, num_heads * head_dim)
        for group in metadata.groups:
            batched = group_attention(q, k, v, kv_cache, group, scale)
            out[group.token_index[group.valid]] = batched[group.valid]
        for chunk in metadata.chunks:
            out[chunk.start:chunk.end] = chunk_attention(q[chunk.start:chunk.end], kv_cache, chunk, scale)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: TorchRefMetadata, scale: float) -> torch.Tensor:
        return self.kernel.paged_decode_attention(q, kv_cache[0], kv_cache[1], md.decode_block_table,
                                                  md.decode_seq_lens, scale)


def _grouped(q_lens: np.ndarray, selected: np.ndarray) -> list[np.ndarray]:
    rows = np.flatnonzero(selected)
    return group_rows(q_lens, rows) if len(rows) else []


register_backend("cpu_paged")(CpuPagedBackend)
