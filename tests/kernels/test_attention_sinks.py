"""gpt-oss's attention sinks (one learned logit per query head in each softmax's denominator): the C++ paged kernel
and its plain-PyTorch twin agree on every path (the walks, the flash tiles, float8 caches, the AVX2 build, sliding
windows, draft trees), against dense float64 attention with the sinks."""

from __future__ import annotations

import pytest
import torch

from pagellm.attention.base import quantize_kv
from pagellm.attention.cpu_paged import CpuPagedBackend, build_metadata, load_kernel
from pagellm.attention.torch_ref import TorchRefBackend
from tests.kernels.test_cpu_paged import (AVX2_BUILD, TOLERANCE, _dense,  # noqa: F401 (kernel_build's swap)
                                          assert_matches_reference_and_dense)
from tests.kernels.test_sliding_window_attention import SHAPES, _windowed_step


def _run(backend, q, k, v, cache, common, window, scale, sinks):
    return backend.forward(q, k, v, cache, backend.build(common), scale, sliding_window=window, sinks=sinks)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_sinks_match_reference_and_dense(window, dtype, heads, kv_heads, head_dim, block_size, kernel_build) -> None:
    q, k, v, cache, common = _windowed_step(heads, kv_heads, head_dim, block_size, dtype, seed=heads + head_dim)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(heads)) * 2  # some above the scores, some below
    assert_matches_reference_and_dense(q, k, v, cache, common, window, head_dim ** -0.5, TOLERANCE[dtype], sinks=sinks)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_sinks_over_float8_caches(kv_dtype) -> None:
    q, k, v, cache, common = _windowed_step(9, 3, 64, 16, torch.bfloat16, seed=5)
    sinks = torch.linspace(-3, 3, 9)
    ref_cache, fast_cache = quantize_kv(cache, kv_dtype), quantize_kv(cache, kv_dtype)
    expected = _run(TorchRefBackend(), q, k, v, ref_cache, common, None, 0.125, sinks)
    got = _run(CpuPagedBackend(), q, k, v, fast_cache, common, None, 0.125, sinks)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_flash_tiles_and_the_token_walk_agree_with_sinks() -> None:
    q, k, v, cache, common = _windowed_step(8, 2, 128, 16, torch.bfloat16, seed=9)
    kernel, md = load_kernel(), build_metadata(common)
    CpuPagedBackend().forward(q, k, v, cache, md, 0.125)  # writes the step's K/V
    sinks = torch.linspace(-2, 4, 8)
    flash = kernel.attention(q, cache[0], cache[1], md, 0.125, flash_min_tokens=2, sinks=sinks)
    walk = kernel.attention(q, cache[0], cache[1], md, 0.125, flash_min_tokens=1 << 30, sinks=sinks)
    torch.testing.assert_close(flash.float(), walk.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(flash.double(), _dense(q, cache, common, 0.125, None, sinks), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="attention sinks must be one per query head \\(8\\)"):
        kernel.attention(q, cache[0], cache[1], md, 0.125, sinks=sinks[:4])
