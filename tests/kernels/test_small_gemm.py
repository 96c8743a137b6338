"""The small-M bfloat16 GEMM kernel (``pagellm/ops/csrc/small_gemm.cpp``) against its twin, ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.ops import gemm

pytestmark = pytest.mark.skipif(not gemm.available(), reason="needs AVX-512 BF16 and a C++ compiler")


# K values cover whole 32-element steps (576), a masked tail (200, 37) and a K shorter than one step (5); N values
# cover whole 4-row tiles and partial ones; M covers 1..4-row register tiles and several passes over them.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("k,n", [(576, 960), (200, 7), (37, 130), (5, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_gemm_matches_float_reference(m: int, k: int, n: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    out = gemm.small_m_linear(x, w, b)
    # The kernel accumulates in float32 and rounds once: exactly the float32 result of the bf16 inputs, rounded.
    expected = F.linear(x.float(), w.float(), b.float() if b is not None else None)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


def test_linear_dispatch_keeps_f_linear_semantics() -> None:
    """``linear`` serves small bf16 batches natively and everything else through F.linear, same results."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
    for m in (1, gemm.SMALL_M, gemm.SMALL_M + 1, 40):
        x = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
        torch.testing.assert_close(gemm.linear(x, w).float(), F.linear(x, w).float(), rtol=2e-2, atol=5e-2)
    x32 = torch.randn(2, 96, generator=gen)
    assert torch.equal(gemm.linear(x32, w.float()), F.linear(x32, w.float()))  # float32 never leaves F.linear
    strided = torch.randn(96, 2, generator=gen).to(torch.bfloat16).t()  # non-contiguous: F.linear
    torch.testing.assert_close(gemm.linear(strided, w).float(), F.linear(strided, w).float())
