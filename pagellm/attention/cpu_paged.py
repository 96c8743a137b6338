"""The tuned CPU backend: one C++ call per layer serves the whole step (``csrc/paged_attention.cpp``), reading K/V
straight from the paged cache with an online softmax in float32, nothing gathered, padded or masked densely.

Each query token is described by the keys it may see: ``ctx_end`` (every key before it; a causal token's own
position + 1) and, in a draft-tree row (speculative decoding), a bitmask over the row's own query tokens (its
ancestors, ``CommonAttentionInputs.tree_masks``) and, in a layer with a sliding window, ``ctx_start`` (the first key
inside the window; the walks then begin at that key's block). So decodes, prompt chunks after a prefix-cache hit,
speculative chains, draft trees and sliding windows are one interface. Inside the kernel, single-token rows and
every float32 row walk the keys token by token (a float32 token's result is then the same whatever row it sits in:
prefix-cache hits reproduce misses bit for bit); bfloat16 rows of at least ``FLASH_MIN_TOKENS`` tokens take flash
tiles where the tokens x grouped heads of one request share each K/V load (AVX-512 BF16 dot products, or AMX tiles
where the CPU has AMX-BF16: ``PAGELLM_ATTENTION_AMX=0`` keeps AVX-512). The library is compiled on first use with
the machine's C++ compiler (``pagellm/ops/build.py``: a plain C ABI loaded with ctypes, about two seconds
to build) and cached; ``torch_ref`` is its test oracle and the fallback.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pagellm import envs
from pagellm.attention.base import CommonAttentionInputs, register_backend, window_starts
from pagellm.attention.torch_ref import write_kv
from pagellm.ops.build import load_library

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
FP8_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_fp8.cpp"  # the float8 caches' entries
# bfloat16 rows with at least this many query tokens take the flash tiles; shorter ones walk token by token.
FLASH_MIN_TOKENS = 2


@dataclass
class CpuPagedMetadata:
    slot_mapping: torch.Tensor     # [T] cache slot of each token
    num_tokens: int
    query_start_loc: torch.Tensor  # [R + 1] int64
    seq_lens: torch.Tensor         # [R] int64
    block_table: torch.Tensor      # [R, max_blocks] int64, contiguous
    ctx_end: torch.Tensor          # [T] int64: token t sees every key before ctx_end[t]
    tree_bits: torch.Tensor | None  # [T, words] int64 bit patterns over the row's own tokens; None: no tree
    common: CommonAttentionInputs | None = None  # what it was built from (the positions, for sliding windows)
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # window → its [T] ctx_start, once per step

    def ctx_start(self, window: int | None) -> torch.Tensor | None:
        """[T] the first key each token sees under a sliding window of ``window`` keys; None: no window."""
        if window is None:
            return None
        if window not in self.windows:
            assert self.common is not None, "metadata built without its step's inputs has no sliding window"
            self.windows[window] = torch.from_numpy(window_starts(self.common.token_positions(), window))
        return self.windows[window]


# (query dtype, cache dtype) → the C entry point serving it; the float8 ones are FP8_SOURCE's library.
ENTRIES = {(torch.bfloat16, torch.bfloat16): "pagellm_paged_attention_bf16",
           (torch.float32, torch.float32): "pagellm_paged_attention_f32",
           (torch.bfloat16, torch.float8_e4m3fn): "pagellm_paged_attention_bf16_fp8e4m3",
           (torch.bfloat16, torch.float8_e5m2): "pagellm_paged_attention_bf16_fp8e5m2",
           (torch.float32, torch.float8_e4m3fn): "pagellm_paged_attention_f32_fp8e4m3",
           (torch.float32, torch.float8_e5m2): "pagellm_paged_attention_f32_fp8e5m2"}


def bind_entry(lib: ctypes.CDLL, name: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                                                                   ctypes.c_float]
    fn.restype = None
    return fn


class PagedKernel:
    """The compiled kernel's entry points behind a tensor-level call (checks, dtype dispatch, output allocation).
    ``lib`` serves the model-dtype caches; ``fp8_lib`` loads the float8 caches' library when one first comes."""

    def __init__(self, lib: ctypes.CDLL, fp8_lib: Callable[[], ctypes.CDLL]) -> None:
        self._fp8_lib = fp8_lib
        self._fns = {key: bind_entry(lib, name) for key, name in ENTRIES.items() if key[0] == key[1]}
        self._use_amx = lib.pagellm_paged_attention_use_amx
        self._use_amx.argtypes = [ctypes.c_int]
        self._use_amx.restype = ctypes.c_int
        self._use_amx(int(envs.attention_amx()))

    def use_amx(self, want: bool | None = None) -> bool:
        """Switch the flash tiles to AMX (where compiled in and granted) or AVX-512 BF16 (``want``), or only ask
        (None); returns whether they run on AMX. For tests and A/B runs: a serving process keeps the path chosen at
        load (``PAGELLM_ATTENTION_AMX``)."""
        return bool(self._use_amx(-1 if want is None else int(want)))

    def entry(self, q_dtype: torch.dtype, cache_dtype: torch.dtype) -> ctypes._CFuncPtr | None:  # type: ignore
        """The C entry point for ``q_dtype`` queries over ``cache_dtype`` caches (a float8 cache's library loaded on
        its first call), or None where none serves the pair."""
        fn = self._fns.get((q_dtype, cache_dtype))
        if fn is None and (q_dtype, cache_dtype) in ENTRIES:
            fn = self._fns[(q_dtype, cache_dtype)] = bind_entry(self._fp8_lib(), ENTRIES[(q_dtype, cache_dtype)])
        return fn

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: CpuPagedMetadata,
                  scale: float, flash_min_tokens: int = FLASH_MIN_TOKENS, sliding_window: int | None = None,
                  sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        """q: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D] of q's dtype or a float8 one; ``sinks``:
        [H] logits joining each head's softmax denominator (gpt-oss's); ``softcap``: each scaled score becomes
        softcap * tanh(score / softcap) (Gemma 2's). Returns [T, H * D] of q's dtype."""
        if softcap is not None and not softcap > 0:
            raise ValueError(f"an attention soft cap must be positive, got {softcap}")
        if q.dim() != 3 or k_cache.dim() != 4 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("paged attention needs q [T, H, D] and contiguous 4-D caches")
        fn = self.entry(q.dtype, k_cache.dtype)
        if fn is None or v_cache.dtype != k_cache.dtype or q.shape[1] % k_cache.shape[2]:
            raise ValueError("paged attention needs float32 or bfloat16 q, caches of its dtype or of float8 "
                             "(e4m3fn, e5m2), and heads a multiple of kv heads")
        q = q.contiguous()
        tokens, heads, head_dim = q.shape
        if sinks is not None:
            sinks = sinks.detach().to(torch.float32).contiguous()
            if sinks.shape != (heads,):
                raise ValueError(f"attention sinks must be one per query head ({heads}), got {tuple(sinks.shape)}")
        out = torch.empty(tokens, heads * head_dim, dtype=q.dtype)
        bits, starts = md.tree_bits, md.ctx_start(sliding_window)
        fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), md.block_table.data_ptr(),
           md.query_start_loc.data_ptr(), md.seq_lens.data_ptr(), md.ctx_end.data_ptr(),
           None if starts is None else starts.data_ptr(), None if bits is None else bits.data_ptr(),
           0 if bits is None else bits.shape[1], md.seq_lens.shape[0], heads, head_dim, k_cache.shape[1],
           k_cache.shape[2], md.block_table.shape[1], flash_min_tokens, scale, out.data_ptr(),
           None if sinks is None else sinks.data_ptr(), softcap or 0.0)
        return out


@functools.lru_cache(maxsize=1)
def load_kernel() -> PagedKernel:
    """Compile (once per source version and machine kind, about ten seconds) and load the C++ kernel; its float8
    entries' library is built on first use (``--kv-cache-dtype fp8*``)."""
    return PagedKernel(load_library(SOURCE), functools.partial(load_library, FP8_SOURCE))


def build_metadata(common: CommonAttentionInputs) -> CpuPagedMetadata:
    """Per-token visibility for the step: causal ``ctx_end`` (or an image's end, ``visible_ends``); tree rows see
    their cached context plus their mask."""
    qsl, seq_lens = common.query_start_loc, common.seq_lens
    q_lens = np.diff(qsl)
    total = int(qsl[-1])
    row_start = seq_lens - q_lens                       # position of each row's first query token
    ctx_end = np.repeat(row_start - qsl[:-1], q_lens) + np.arange(total, dtype=np.int64) + 1
    if common.visible_ends is not None:  # image tokens that see their whole image (never in a draft tree)
        np.maximum(ctx_end, common.visible_ends, out=ctx_end)
    bits = None
    if common.tree_masks:
        words = max(-(-int(m.shape[0]) // 64) for m in common.tree_masks.values())
        dense = np.zeros((total, words * 64), dtype=bool)
        for row, mask in common.tree_masks.items():
            start, end = int(qsl[row]), int(qsl[row + 1])
            ctx_end[start:end] = row_start[row]
            dense[start:end, :end - start] = mask.numpy()
        bits = torch.from_numpy(np.packbits(dense, axis=1, bitorder="little").view(np.int64))
    return CpuPagedMetadata(common.slot_mapping, total, torch.from_numpy(np.ascontiguousarray(qsl, dtype=np.int64)),
                            torch.from_numpy(np.ascontiguousarray(seq_lens, dtype=np.int64)),
                            torch.from_numpy(np.ascontiguousarray(common.block_table, dtype=np.int64)),
                            torch.from_numpy(ctx_end), bits, common)


class CpuPagedBackend:
    name = "cpu_paged"

    def __init__(self) -> None:
        self.kernel = load_kernel()

    def build(self, common: CommonAttentionInputs) -> CpuPagedMetadata:
        return build_metadata(common)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: CpuPagedMetadata, scale: float, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.slot_mapping)
        return self.kernel.attention(q, kv_cache[0], kv_cache[1], metadata, scale, sliding_window=sliding_window,
                                     sinks=sinks, softcap=softcap)


register_backend("cpu_paged")(CpuPagedBackend)
