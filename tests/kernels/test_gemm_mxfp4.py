"""MXFP4 weights kept in 4 bits (gpt-oss's experts): the W4A16 kernel looking its nibbles up as E2M1 values, against
its float32 twin over the checkpoint's values (as transformers dequantizes them), at every row count, with a bias
and on a partial panel; its gate/up entry the GEMM then SiLU·mul bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pagellm.model import mxfp4
from pagellm.model.weight_only import GroupsDoNotFit
from pagellm.ops import fused, gemm, gemm_mxfp4

pytestmark = pytest.mark.skipif(not gemm_mxfp4.available(),
                                reason="the MXFP4 GEMM needs AVX-512 BF16 and VNNI and a C++ compiler")


def _matrix(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 matrix's blocks [n, k / 32, 16] and exponents [n, k / 32], as a checkpoint stores them."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8),
            torch.randint(118, 129, (n, k // 32), generator=gen, dtype=torch.uint8))


def test_the_packed_operand_holds_the_checkpoints_values() -> None:
    blocks, exponents = _matrix(40, 96, seed=0)
    codes = mxfp4.codes(blocks).flatten(-2)
    packed = gemm_mxfp4.pack(codes, exponents)
    theirs = convert_moe_packed_tensors(blocks[None], exponents[None], dtype=torch.float32)[0].t()  # [out, in]
    assert torch.equal(gemm_mxfp4.dequantize(packed, 40, 96).float(), theirs)
    q, d, m = gemm_mxfp4.unpack(packed, 40, 96)
    assert torch.equal(q, codes) and torch.equal(d.float(), torch.ldexp(torch.ones(40, 3), exponents.int() - 127))
    assert not m.any()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_the_gemm_is_its_float32_twin(rows: int, bias: bool) -> None:
    blocks, exponents = _matrix(88, 128, seed=rows)  # 88 outputs: a partial last panel
    codes = mxfp4.codes(blocks).flatten(-2)
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
    b = torch.randn(88, generator=gen).to(torch.bfloat16) if bias else None
    got = gemm_mxfp4.packed_linear(x, gemm_mxfp4.pack(codes, exponents), 88, b)
    want = gemm_mxfp4.reference_linear(x, codes, exponents, b)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=1e-2)


def test_the_gate_up_entry_is_the_gemm_then_silu_mul() -> None:
    blocks, exponents = _matrix(64, 96, seed=7)
    packed = gemm_mxfp4.pack(mxfp4.codes(blocks).flatten(-2), exponents)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    together = gemm_mxfp4.packed_linear_silu_mul(x, packed, 64)
    assert together is not None
    assert torch.equal(together, fused.silu_and_mul(gemm_mxfp4.packed_linear(x, packed, 64)))


def test_a_layer_packs_its_codes_and_a_bfloat16_one_stays_bfloat16() -> None:
    blocks, exponents = _matrix(32, 64, seed=9)
    codes, groups = mxfp4.kept(blocks, exponents)
    expert = torch.nn.Parameter(codes.to(torch.bfloat16), requires_grad=False)
    gemm_mxfp4.quantize_parameter(expert, (groups[..., 0].half(), groups[..., 1].half()))
    assert gemm.weight_format(expert) == gemm_mxfp4.FORMAT
    assert torch.equal(gemm.plain(expert).float(), mxfp4.dequantize(blocks, exponents, torch.float32))
    attention = torch.nn.Parameter(torch.randn(32, 64).to(torch.bfloat16), requires_grad=False)
    gemm_mxfp4.quantize_parameter(attention)
    assert gemm.weight_format(attention) == ("bf16" if gemm.available() else None)


def test_a_scale_beyond_float16_is_refused() -> None:
    blocks, exponents = _matrix(16, 32, seed=1)
    exponents[3, 0] = 100  # 2^-27
    with pytest.raises(ValueError, match="not exact in float16"):
        gemm_mxfp4.pack(mxfp4.codes(blocks).flatten(-2), exponents)
    with pytest.raises(GroupsDoNotFit, match="not exact in float16"):
        mxfp4.kept(blocks, exponents)
