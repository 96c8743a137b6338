"""Image tokens that attend to their whole image (Gemma 3's: ``CommonAttentionInputs.visible_ends``): the C++ paged
kernel and its plain-PyTorch twin let such a token see every key before its image's end, besides the causal ones
(a sliding window still bounds them from below), on every path (the walks, the flash tiles, the AVX2 build),
against dense float64 attention; tokens outside images stay causal."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagellm.attention.base import CommonAttentionInputs, window_starts
from pagellm.attention.cpu_paged import CpuPagedBackend
from pagellm.attention.torch_ref import TorchRefBackend
from tests.kernels.test_cpu_paged import AVX2_BUILD, TOLERANCE, _random_step  # noqa: F401 (kernel_build's swap)

SHAPES = [(9, 3, 64, 16), (8, 2, 128, 16), (4, 2, 24, 8), (8, 2, 64, 4)]
# (query tokens, context, the images' spans in positions): a fresh prompt with two images, a chunk after cached
# context whose image starts inside it, a decode, a chunk without images, a chunk that starts inside an image
ROWS = [(30, 30, [(3, 11), (14, 27)]), (20, 50, [(35, 47)]), (1, 40, []), (9, 9, []), (12, 60, [(44, 53)])]


def _image_step(heads, kv_heads, head_dim, block_size, dtype, seed):
    q, k, v, cache, common = _random_step([r[0] for r in ROWS], [r[1] for r in ROWS], heads, kv_heads, head_dim,
                                          block_size, dtype, seed)
    ends = np.zeros(int(common.query_start_loc[-1]), dtype=np.int64)
    for row, (n, ctx, spans) in enumerate(ROWS):
        first = int(common.query_start_loc[row]) - (ctx - n)  # flat index of position 0
        for lo, hi in spans:
            ends[first + max(lo, ctx - n):first + hi] = hi
    return q, k, v, cache, dataclasses.replace(common, visible_ends=ends)


def _dense(q: torch.Tensor, cache: torch.Tensor, common: CommonAttentionInputs, scale: float,
           window: int | None) -> torch.Tensor:
    """Every row in float64 from the written cache: key j visible from position p when j <= p or j is before p's
    image's end (``visible_ends``), and, under a sliding window, j is inside p's window."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, bs = cache.shape[3], common.block_size
    positions = common.token_positions()
    starts = window_starts(positions, window) if window else np.zeros_like(positions)
    ends = np.maximum(positions + 1, common.visible_ends if common.visible_ends is not None else 0)
    out = []
    for row in range(len(common.seq_lens)):
        start, end = int(common.query_start_loc[row]), int(common.query_start_loc[row + 1])
        ctx = int(common.seq_lens[row])
        idx = [int(common.block_table[row, p // bs]) * bs + p % bs for p in range(ctx)]
        keys = cache[0].reshape(-1, kv_heads, head_dim)[idx].double().repeat_interleave(heads // kv_heads, 1)
        vals = cache[1].reshape(-1, kv_heads, head_dim)[idx].double().repeat_interleave(heads // kv_heads, 1)
        key = torch.arange(ctx)[None, :]
        allowed = (key < torch.from_numpy(ends[start:end])[:, None]) & \
            (key >= torch.from_numpy(starts[start:end])[:, None])
        scores = torch.einsum("qhd,thd->hqt", q[start:end].double(), keys) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqt,thd->qhd", probs, vals).reshape(end - start, -1))
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_image_tokens_see_their_whole_image_on_both_backends(window, dtype, heads, kv_heads, head_dim, block_size,
                                                             kernel_build) -> None:
    q, k, v, cache, common = _image_step(heads, kv_heads, head_dim, block_size, dtype, seed=heads + (window or 0))
    scale = head_dim ** -0.5
    outputs = {}
    for backend in (TorchRefBackend(), CpuPagedBackend()):
        written = cache.clone()
        outputs[backend.name] = backend.forward(q, k, v, written, backend.build(common), scale,
                                                sliding_window=window)
    tol = TOLERANCE[dtype]
    expected = _dense(q, written, common, scale, window)
    torch.testing.assert_close(outputs["cpu_paged"].float(), outputs["torch_ref"].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(outputs["cpu_paged"].double(), expected, atol=tol, rtol=tol)
    causal = _dense(q, written, dataclasses.replace(common, visible_ends=None), scale, window)
    assert (causal - expected).abs().max() > 20 * tol  # the images' later keys matter
    images = common.visible_ends > 0
    torch.testing.assert_close(causal[~images], expected[~images])  # and nothing else changes
