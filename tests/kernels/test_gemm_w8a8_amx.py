"""The W8A8 int8 GEMM's two paths, VNNI tiles and AMX-INT8 tiles (``pagellm/ops/csrc/packed_gemm_w8a8_amx.h``): both
sum the same integers exactly, so both give the bits of the plain-PyTorch twin ``gemm_w8a8.reference_linear`` for
every shape, including what only the AMX tiles have: a short last K step (zero-padded weights), row tiles past M
(rows read and dropped), a lone last panel, several row ranges, and a block's outputs written during the next
block's products. The AMX cases run where the CPU has AMX-INT8 and the OS grants it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagellm.ops import fused, gemm_w8a8

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(not gemm_w8a8.available(), reason="the int8 kernel needs AVX-512 VNNI")


@pytest.fixture(params=["vnni", "amx"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test on one of the int8 GEMM's paths; AMX only where this CPU has AMX-INT8."""
    default = gemm_w8a8.amx()
    want = request.param == "amx"
    if gemm_w8a8.use_amx(want) != want:
        gemm_w8a8.use_amx(default)
        pytest.skip("this CPU has no AMX-INT8")
    yield request.param
    gemm_w8a8.use_amx(default)


def _case(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(BF16)
    w = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)).to(BF16)
    return x, w, torch.randn(n, generator=gen).to(BF16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


# M: under the AMX tiles' 16 rows (8: the VNNI tiles either way), one tile (16), a second part tile (20, 37), blocks
# of 32 over a 512-row range and two ranges (600, 1100); K: one short step (7), a whole step and a short one (100),
# the built-in model's (576: 9 steps, 1536), the VNNI tiles' two K blocks (2500); N: a lone last panel (40: three
# panels), part panels (130); outputs of 256 KiB and more, written around the caches, in aligned rows (300 x 576) and
# in rows of 600 bytes, some not (520 x 300).
SHAPES = [(8, 40, 7), (20, 130, 100), (37, 576, 576), (300, 40, 1536), (600, 96, 100), (1100, 48, 576),
          (64, 130, 2500), (16, 576, 64), (300, 576, 100), (520, 300, 64)]


@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_both_paths_give_the_twins_bits(m: int, n: int, k: int, path: str) -> None:
    x, w, b = _case(m, n, k, seed=m + n + k)
    q, scale = gemm_w8a8.quantize(w)
    packed = gemm_w8a8.pack(q, scale)
    for bias in (None, b):
        out = gemm_w8a8.packed_linear(x, packed, n, bias)
        assert torch.equal(_bits(out), _bits(gemm_w8a8.reference_linear(x, q, scale, bias)))


GATE_UP = [(8, 64, 576), (33, 1536, 576), (600, 96, 100), (20, 16, 1536)]


@pytest.mark.parametrize("m,i,k", GATE_UP, ids=[f"{m}x{i}x{k}" for m, i, k in GATE_UP])
def test_gate_up_in_one_pass_gives_the_two_calls_bits(m: int, i: int, k: int, path: str) -> None:
    """Each gate panel with its up panel in one pair of tiles: the bits of the GEMM followed by SiLU·mul."""
    x, w, _ = _case(m, 2 * i, k, seed=m * i + k)
    packed = gemm_w8a8.pack(*gemm_w8a8.quantize(w))
    one = gemm_w8a8.packed_linear_silu_mul(x, packed, 2 * i)
    assert one is not None and one.shape == (m, i)
    assert torch.equal(_bits(one), _bits(fused.silu_and_mul(gemm_w8a8.packed_linear(x, packed, 2 * i))))


def test_rows_are_the_same_on_either_path_and_at_any_batch() -> None:
    """A row's output does not depend on the path or on the rows beside it: a batch that takes the AMX tiles and
    its slices that take the VNNI tiles (under 8 rows) agree bit for bit."""
    x, w, b = _case(300, 200, 576, seed=3)
    packed = gemm_w8a8.pack(*gemm_w8a8.quantize(w))
    default = gemm_w8a8.amx()
    try:
        outs = {}
        for want in (False, True):
            gemm_w8a8.use_amx(want)
            outs[want] = gemm_w8a8.packed_linear(x, packed, 200, b)
            for lo, hi in [(0, 1), (5, 12), (40, 77), (290, 300)]:
                assert torch.equal(_bits(gemm_w8a8.packed_linear(x[lo:hi], packed, 200, b)), _bits(outs[want][lo:hi]))
        assert torch.equal(_bits(outs[False]), _bits(outs[True]))
    finally:
        gemm_w8a8.use_amx(default)
