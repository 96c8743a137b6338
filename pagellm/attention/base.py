"""The attention-backend interface, the per-step metadata every backend starts from, and the scoped
forward context through which attention layers read that metadata.

A step's batch is one flat run of tokens from many requests: request ``r`` owns tokens
``query_start_loc[r]:query_start_loc[r+1]``, which sit at the end of its ``seq_lens[r]``-token context and
attend causally (or, for a draft-tree row, as its ``tree_masks`` entry says; an image token of a model whose images
attend both ways, up to its ``visible_ends`` entry as well); a layer with a sliding window of W
sees, of those keys, only the ones less than W positions before its token (``window_starts``).
Backends turn this common description into whatever their kernels need, once per step (``build``), and every
layer then calls ``forward`` with that same metadata.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import mmap
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch

from pagellm import envs

logger = logging.getLogger(__name__)



# CacheConfig.kv_cache_dtype's 8-bit formats (vLLM's names; "fp8" is e4m3). "auto" keeps the model's dtype.
FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of the KV cache for ``kv_cache_dtype`` (validated by ``CacheConfig``; auto: the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else FP8_KV_DTYPES[kv_cache_dtype]


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K/V rows as ``dtype`` (a float8 cache's): rounded to nearest even and saturated at the format's largest finite
    value (scale 1.0), the bits the native stack's write stores too (``ops/csrc/fp8.h``)."""
    if x.dtype == dtype:
        return x
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """One layer's zeroed ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` K/V cache on fresh anonymous
    pages, which the OS hands out zero-filled when first touched: a multi-GiB cache costs nothing at start-up and
    memory only as its blocks are used (``torch.zeros`` writes every byte first: ~3 s for 4 GiB here).

    The pages are private: Python's default shared mapping is backed by shmem, where every 4 KiB of a new block
    took a slower fault. They stay 4 KiB pages unless ``PAGELLM_KV_HUGE_PAGES=1`` advises transparent huge pages:
    on a VM whose host takes back the guest's free 2 MiB blocks (free page reporting), the first touch of a huge
    page read 0.2 GB/s against 4.5 for 4 KiB pages, and the decode walk's TLB gain from them was small."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    count = math.prod(shape)
    pages = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if envs.kv_huge_pages():
        with contextlib.suppress(AttributeError, OSError):  # no THP (another OS, or a kernel without it)
            pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # the tensor keeps the mapping alive


@dataclass
class CommonAttentionInputs:
    """What the model runner knows about a step, as host arrays."""

    query_start_loc: np.ndarray  # [R + 1] int64
    seq_lens: np.ndarray         # [R] int64: context length after this step (computed + scheduled)
    block_table: np.ndarray      # [R, max_blocks] int64 (rows padded with 0)
    slot_mapping: torch.Tensor   # [T] int64: cache slot of each scheduled token
    block_size: int
    # Rows holding a draft tree (speculative decoding): row → [q_len, q_len] bool mask among the row's own query
    # tokens (True = may attend). Such a row sees its whole cached context plus what this mask allows, instead of
    # the causal rule. Backends without a native tree kernel serve these rows with the reference path.
    tree_masks: dict[int, torch.Tensor] | None = None
    # [T] int64 position of each token (a draft-tree token's is its depth's); None: each row's tokens sit at the
    # end of its context, in order.
    positions: np.ndarray | None = None
    # [T] int64: each token also sees every key before this one (Gemma 3's image tokens: their image's end, inside
    # the step; others 0); None: the causal rule alone. A sliding window still bounds the keys from below.
    visible_ends: np.ndarray | None = None

    def token_positions(self) -> np.ndarray:
        if self.positions is not None:
            return self.positions
        q_lens = np.diff(self.query_start_loc)
        first = np.repeat(self.seq_lens - q_lens - self.query_start_loc[:-1], q_lens)
        return first + np.arange(int(self.query_start_loc[-1]), dtype=np.int64)


def window_starts(positions: np.ndarray, window: int) -> np.ndarray:
    """[T] the first key each token sees under a sliding window of ``window`` keys (itself and the ``window - 1``
    before it, as transformers' sliding-window mask: key j is visible from position p when p - window < j <= p)."""
    return np.maximum(positions - (window - 1), 0)


class AttentionBackend(Protocol):
    name: str

    def build(self, common: CommonAttentionInputs) -> Any:
        """Per-step metadata for this backend (built once, shared by every layer)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """Write k/v into ``kv_cache`` at the step's slots, then attend (inside ``sliding_window`` keys where the
        layer has one). q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, num_blocks, block_size, KVH, D]; returns
        [T, H * D]."""


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[Callable[[], AttentionBackend]], Callable[[], AttentionBackend]]:
    def wrap(factory: Callable[[], AttentionBackend]) -> Callable[[], AttentionBackend]:
        _BACKENDS[name] = factory
        return factory
    return wrap


def get_backend(name: str) -> AttentionBackend:
    """A backend by name; ``auto`` takes the C++ CPU kernel when it builds here and the reference otherwise."""
    import pagellm.attention.cpu_paged  # noqa: F401  (registers both backends)

    if name == "auto":
        try:
            return _BACKENDS["cpu_paged"]()
        except Exception as exc:  # no compiler, or a build error: the reference path still serves correctly
            logger.warning("cpu_paged attention unavailable (%s); using torch_ref", exc)
            return _BACKENDS["torch_ref"]()
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; supported: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]()


@dataclass
class ForwardContext:
    backend: AttentionBackend
    metadata: Any
    lora: Any = None  # the step's ``lora.LoRABatch`` when requests with adapters run in it


_context: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("pagellm_forward", default=None)


@contextlib.contextmanager
def forward_context(backend: AttentionBackend, metadata: Any, lora: Any = None) -> Iterator[None]:
    """Make ``metadata`` (and the step's LoRA adapters) visible to every layer for the duration of one forward."""
    token = _context.set(ForwardContext(backend, metadata, lora))
    try:
        yield
    finally:
        _context.reset(token)


def current_lora() -> Any:
    """The running forward pass's LoRA adapters (a ``lora.LoRABatch``), or None (also outside a forward pass)."""
    ctx = _context.get()
    return None if ctx is None else ctx.lora


def current_forward_context() -> ForwardContext:
    ctx = _context.get()
    if ctx is None:
        raise RuntimeError("attention ran outside forward_context(); the model runner sets it for each step")
    return ctx
