"""Attention within runs of tokens, every token of a run seeing all of it and nothing else: an encoder-only model's
prompts (``model/bert.py``), a vision tower's tiles (``model/vit.py``).

``Runs(query_start_loc, native)`` describes the runs of a flat [T] token batch; ``attend(q, k, v)`` takes their
[T, heads, head size] projections and gives [T, heads · head size]. Natively (the ``cpu_paged`` backend's C++ kernel)
the tokens' own K/V are read in place as one-token blocks, each token's keys ending at its run's end: no copy, no
padding, the kernel's flash tiles (1.8x SDPA's flash path for a step of 28 prompts of 32-256 tokens, 12 heads of
64, bfloat16). Otherwise, its plain twin: one SDPA call a run, or one call for all of them where every run has the
same length (a tower's tiles). ``native_attention(model, backend)`` tells a model's vision tower which one to take
(it runs outside the step's forward context, where an encoder reads the backend), and ``kernel_pays(dtype, head
size)`` whether the kernel is the faster one: only its flash tiles are (bfloat16, heads of 64 or 128); elsewhere it
walks the keys one by one, 10-25x SDPA's time on a tower's runs of 256-1024 patches (Qwen2-VL's heads of 80,
SigLIP-So400m's of 72, any float32 run), so SDPA runs them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


FLASH_HEAD_SIZES = (64, 128)  # the kernel's flash tiles' (csrc/paged_kernels.h, ``flash_item``)


def kernel_pays(dtype: torch.dtype, head_size: int) -> bool:
    """Whether runs of ``dtype`` q/k/v with heads of ``head_size`` are faster through the kernel than SDPA."""
    return dtype == torch.bfloat16 and head_size in FLASH_HEAD_SIZES


class Runs:
    def __init__(self, query_start_loc: np.ndarray, native: bool) -> None:
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        self.bounds = list(zip(qsl[:-1].tolist(), qsl[1:].tolist()))
        self.starts, self.lens = qsl[:-1], np.diff(qsl)
        lens = self.lens
        self.same = int(lens[0]) if len(lens) and bool((lens == lens[0]).all()) else 0  # every run this long
        self.positions = np.arange(int(qsl[-1]), dtype=np.int64) - np.repeat(qsl[:-1], lens)  # within its run
        self.metadata, self._windowed = None, {}
        if native:
            from pagellm.attention.cpu_paged import CpuPagedMetadata, load_kernel

            offsets = np.arange(int(lens.max()), dtype=np.int64)
            table = np.where(offsets < lens[:, None], qsl[:-1, None] + offsets, 0)  # each token its own block
            self.kernel = load_kernel()
            total = int(qsl[-1])
            self.metadata = CpuPagedMetadata(torch.zeros(total, dtype=torch.int64), total, torch.from_numpy(qsl),
                                             torch.from_numpy(lens), torch.from_numpy(table),
                                             torch.from_numpy(np.repeat(lens, lens)), None)

    def _window_metadata(self, window: int) -> Any:
        """The native metadata of a symmetric ``window``: each token's keys from ``window`` before it to ``window``
        after it, inside its run (its first key as the kernel's sliding-window start, cached under ``window``)."""
        if window not in self._windowed:
            md = self.metadata
            ends = np.minimum(self.positions + window + 1, np.repeat(self.lens, self.lens))
            windowed = dataclasses.replace(md, ctx_end=torch.from_numpy(ends), windows={})
            windowed.windows[window] = torch.from_numpy(np.maximum(self.positions - window, 0))
            self._windowed[window] = windowed
        return self._windowed[window]

    @classmethod
    @functools.lru_cache(maxsize=8)
    def equal(cls, count: int, length: int, native: bool) -> Runs:
        """``count`` runs of ``length`` tokens each (made once for a tower's every layer and tile batch)."""
        return cls(np.arange(count + 1, dtype=np.int64) * length, native)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               window: int | None = None) -> torch.Tensor:
        """[T, heads · head size] of the runs' q, k, v [T, heads, head size] (``scale``: 1 / sqrt(head size));
        ``window``: each token sees only the keys at most this far from it, either way (ModernBERT's local layers)."""
        tokens, heads, size = q.shape
        scale = size ** -0.5 if scale is None else scale
        if self.metadata is not None:
            md = self.metadata if window is None else self._window_metadata(window)
            return self.kernel.attention(q, k.reshape(tokens, 1, heads, size), v.reshape(tokens, 1, heads, size),
                                         md, scale, sliding_window=window)
        if self.same and window is None:
            runs = [t.reshape(-1, self.same, heads, size).transpose(1, 2) for t in (q, k, v)]
            return F.scaled_dot_product_attention(*runs, scale=scale).transpose(1, 2).reshape(tokens, -1)
        out = torch.empty(tokens, heads * size, dtype=q.dtype)
        for start, end in self.bounds:
            mask = None
            if window is not None:
                offsets = torch.arange(end - start)
                mask = (offsets[:, None] - offsets[None, :]).abs() <= window
            one = F.scaled_dot_product_attention(*(t[None, start:end].transpose(1, 2) for t in (q, k, v)),
                                                 attn_mask=mask, scale=scale)
            out[start:end] = one[0].transpose(0, 1).reshape(end - start, -1)
        return out


def native_attention(model: torch.nn.Module, backend_name: str) -> None:
    """Point every module of ``model`` that attends within runs outside a forward pass (``native_attention``
    attributes: the vision towers' attention) at the C++ kernel when the backend is ``cpu_paged``."""
    for module in model.modules():
        if hasattr(module, "native_attention"):
            module.native_attention = backend_name == "cpu_paged"
