"""The tuned CPU backend: decode rows run a C++ paged-attention kernel (``csrc/paged_decode.cpp``) that reads K/V
straight from the paged cache with an online softmax, instead of gathering and padding them; rows with several
query tokens are batched by similar length into one SDPA call per group (``chunk_batch.py``); draft-tree rows
(speculative decoding) take the reference path with their ancestor mask. The kernel is compiled on first use with the machine's C++ compiler
(``torch.utils.cpp_extension``) and cached; ``torch_ref`` is its test oracle and the fallback.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from pagellm import envs
from pagellm.attention.base import CommonAttentionInputs, register_backend
from pagellm.attention.chunk_batch import ChunkGroup, build_group, group_attention, group_rows
from pagellm.attention.torch_ref import TorchRefBackend, TorchRefMetadata, chunk_attention, decode_rows, write_kv

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@functools.lru_cache(maxsize=1)
def load_kernel() -> ModuleType:
    """Compile (once per source version and machine) and import the C++ kernel."""
    from torch.utils.cpp_extension import load

    build_dir = envs.cache_dir() / "kernels" / _machine_tag()  # -march=native code is only valid on this CPU kind
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", "2")
    return load(name="pagellm_paged_decode", sources=[str(_SOURCE)], build_directory=str(build_dir),
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"],
                extra_ldflags=["-fopenmp"], verbose=False)


def _machine_tag() -> str:
    """A short digest of the CPU's feature flags, torch's version and the kernel source, to key builds by."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.machine()
    source = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()  # checkouts with different sources never share a build
    return hashlib.sha256(f"{flags}|{torch.__version__}|{source}".encode()).hexdigest()[:12]


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
        trees = common.tree_masks or {}
        multi = np.array([r for r in np.flatnonzero(q_lens > 1) if int(r) not in trees], dtype=np.int64)
        groups = [build_group(common, rows) for rows in group_rows(q_lens, multi)] if len(multi) else []
        chunks = [self._chunk(common, row) for row in sorted(trees)]  # draft trees: the reference path with a mask
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
            batched = group_attention(q, kv_cache, group, scale)
            out[group.token_index[group.valid]] = batched[group.valid]
        for chunk in metadata.chunks:
            out[chunk.start:chunk.end] = chunk_attention(q[chunk.start:chunk.end], kv_cache, chunk, scale)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: TorchRefMetadata, scale: float) -> torch.Tensor:
        return self.kernel.paged_decode_attention(q, kv_cache[0], kv_cache[1], md.decode_block_table,
                                                  md.decode_seq_lens, scale)


register_backend("cpu_paged")(CpuPagedBackend)
