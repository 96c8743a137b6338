"""Gemma 2's attention logit soft cap (each scaled score becomes cap * tanh(score / cap) before the softmax): the C++
paged kernel and its plain-PyTorch twin agree on every path (the walks, the flash tiles, float8 caches, the AVX2
build, sliding windows, draft trees, Gemma 2's head size of 256), against dense float64 attention with the cap."""

from __future__ import annotations

import pytest
import torch

from pagellm.attention.base import quantize_kv
from pagellm.attention.cpu_paged import CpuPagedBackend, build_metadata, load_kernel
from pagellm.attention.torch_ref import TorchRefBackend
from tests.kernels.test_cpu_paged import (AVX2_BUILD, TOLERANCE, _dense,  # noqa: F401 (kernel_build's swap)
                                          assert_matches_reference_and_dense)
from tests.kernels.test_sliding_window_attention import SHAPES, _windowed_step

CAP = 1.5  # low enough that most scores bend


def _run(backend, q, k, v, cache, common, window, scale, softcap):
    return backend.forward(q, k, v, cache, backend.build(common), scale, sliding_window=window, softcap=softcap)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [*SHAPES, (8, 4, 256, 16)])
def test_soft_cap_matches_reference_and_dense(window, dtype, heads, kv_heads, head_dim, block_size,
                                              kernel_build) -> None:
    q, k, v, cache, common = _windowed_step(heads, kv_heads, head_dim, block_size, dtype, seed=heads + head_dim)
    q = q * 3  # scores well past the cap
    assert_matches_reference_and_dense(q, k, v, cache, common, window, head_dim ** -0.5, TOLERANCE[dtype], softcap=CAP)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_soft_cap_over_float8_caches(kv_dtype) -> None:
    q, k, v, cache, common = _windowed_step(9, 3, 64, 16, torch.bfloat16, seed=5)
    ref_cache, fast_cache = quantize_kv(cache, kv_dtype), quantize_kv(cache, kv_dtype)
    expected = _run(TorchRefBackend(), q * 3, k, v, ref_cache, common, None, 0.125, CAP)
    got = _run(CpuPagedBackend(), q * 3, k, v, fast_cache, common, None, 0.125, CAP)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_tiles_and_the_token_walk_agree_with_a_soft_cap(head_dim: int) -> None:
    q, k, v, cache, common = _windowed_step(8, 2, head_dim, 16, torch.bfloat16, seed=9)
    q = q * 3
    kernel, md = load_kernel(), build_metadata(common)
    CpuPagedBackend().forward(q, k, v, cache, md, 0.125)  # writes the step's K/V
    flash = kernel.attention(q, cache[0], cache[1], md, 0.125, flash_min_tokens=2, softcap=CAP)
    walk = kernel.attention(q, cache[0], cache[1], md, 0.125, flash_min_tokens=1 << 30, softcap=CAP)
    torch.testing.assert_close(flash.float(), walk.float(), atol=2e-2, rtol=2e-2)
    dense = _dense(q, cache, common, 0.125, softcap=CAP)
    torch.testing.assert_close(flash.double(), dense, atol=2e-2, rtol=2e-2)
    assert (dense - _dense(q, cache, common, 0.125)).abs().max() > 0.1
    with pytest.raises(ValueError, match="an attention soft cap must be positive, got 0"):
        kernel.attention(q, cache[0], cache[1], md, 0.125, softcap=0)
