"""The fused bfloat16 element-wise kernels (``pagellm/ops/csrc/fused.cpp``) against their layers' plain-PyTorch
twins (``forward_torch``) and a float32 computation of the same formula; and the load's dequantization of a GGUF's
blocks against gguf's own ``dequantize``."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagellm.model.layers.activation import ClampedSwiGLU, GeluAndMul, SiluAndMul
from pagellm.model.layers.norm import LayerNorm, RMSNorm
from pagellm.model.layers.rotary import RotaryEmbedding, rotate_half
from pagellm.model import gguf_blocks
from pagellm.ops import build, fused

pytestmark = pytest.mark.skipif(fused._lib() is None, reason="needs a C++ compiler")
BF16 = torch.bfloat16


@functools.cache
def _avx2_build() -> ctypes.CDLL:
    """The kernels compiled for x86-64-v3 (AVX2, FMA, no AVX-512): the build an AVX2-only CPU makes."""
    return fused.bind(ctypes.CDLL(str(build.build_avx2_library(fused.SOURCE))))


AVX2_BUILD = (fused, "_lib", _avx2_build)  # the kernel_build fixture's swap (tests/kernels/conftest.py)


def _close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within two bfloat16 roundings of the float32 result (the twin rounds more often than the kernel)."""
    assert actual.dtype == BF16 and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 64), (70, 576), (5, 37)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(rows: int, hidden: int, with_residual: bool, kernel_build: str) -> None:
    gen = torch.Generator().manual_seed(rows + hidden)
    norm = RMSNorm(hidden, 1e-5, BF16)
    norm.weight.data = torch.randn(hidden, generator=gen).to(BF16)
    x = torch.randn(rows, hidden, generator=gen).mul(3).to(BF16)
    residual = torch.randn(rows, hidden, generator=gen).to(BF16) if with_residual else None
    out, res = norm(x, residual)
    twin_out, twin_res = norm.forward_torch(x, residual)
    assert torch.equal(res, twin_res)  # the residual sum is one bf16 rounding in both
    _close_bf16(out, twin_out)
    s = res.float()
    _close_bf16(out, norm.weight.float() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5))


@pytest.mark.parametrize("rows,hidden", [(1, 4096), (3, 64), (70, 576), (5, 37)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_layer_norm(rows: int, hidden: int, with_residual: bool, kernel_build: str) -> None:
    """Cohere's LayerNorm in one pass against its twin (the residual sum exactly; the output equal, or one bfloat16
    step apart where float32 sums taken in another order round it the other way), on rows whose mean is far from 0;
    within two roundings of the float32 formula."""
    gen = torch.Generator().manual_seed(rows + hidden)
    norm = LayerNorm(hidden, 1e-5, BF16)
    norm.weight.data = torch.randn(hidden, generator=gen).to(BF16)
    x = (torch.randn(rows, hidden, generator=gen) * 3 + 5).to(BF16)
    residual = torch.randn(rows, hidden, generator=gen).to(BF16) if with_residual else None
    out, res = norm(x, residual)
    twin_out, twin_res = norm.forward_torch(x, residual)
    assert torch.equal(res, twin_res)
    steps = (out.view(torch.int16).int() - twin_out.view(torch.int16).int()).abs()
    assert steps.max() <= 1 and (steps == 0).float().mean() > 0.99
    s = res.float()
    centred = s - s.mean(-1, keepdim=True)
    _close_bf16(out, norm.weight.float() * centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5))


@pytest.mark.parametrize("rows,hidden", [(1, 1536), (4, 40), (33, 1536), (2, 7)])
def test_silu_and_mul(rows: int, hidden: int, kernel_build: str) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    gate_up = torch.randn(rows, 2 * hidden, generator=gen).mul(4).to(BF16)
    act = SiluAndMul()
    out = act(gate_up)
    _close_bf16(out, act.forward_torch(gate_up))
    gate, up = gate_up.float().chunk(2, dim=-1)
    _close_bf16(out, F.silu(gate) * up)


@pytest.mark.parametrize("rows,hidden", [(1, 1152), (4, 40), (33, 6912), (2, 7)])
def test_gelu_tanh_and_mul(rows: int, hidden: int, kernel_build: str) -> None:
    """Gemma's GeGLU in one pass against its twin's bfloat16 gelu and product (torch's tanh form): each element
    over 0.01 equal or one bfloat16 step apart (the exponential's last float32 bits rounding gelu the other way),
    the tails' tiny values (which torch's 1 + tanh cancels to 0, the kernel's g / (1 + e^-2y) keeps) within 1e-3;
    within two roundings of the float32 formula; the exact-erf form is the twin's alone."""
    gen = torch.Generator().manual_seed(rows * hidden)
    gate_up = torch.randn(rows, 2 * hidden, generator=gen).mul(4).to(BF16)
    gate_up[0, :3] = torch.tensor([-30.0, 30.0, 0.0])  # the tails (e^x clamped) and zero
    act = GeluAndMul("tanh")
    out, twin = act(gate_up), act.forward_torch(gate_up)
    steps = (out.view(torch.int16).int() - twin.view(torch.int16).int()).abs()[twin.float().abs() > 0.01]
    assert steps.max() <= 1 and (steps == 0).float().mean() > 0.99
    assert (out.float() - twin.float()).abs().max() < 1e-3
    gate, up = gate_up.float().chunk(2, dim=-1)
    _close_bf16(out, F.gelu(gate, approximate="tanh") * up)
    exact = GeluAndMul("none")
    assert torch.equal(exact(gate_up), exact.forward_torch(gate_up))


@pytest.mark.parametrize("rows,hidden", [(1, 2880), (4, 40), (33, 2880), (2, 7)])
def test_clamped_swiglu(rows: int, hidden: int, kernel_build: str) -> None:
    """gpt-oss's gating in one pass: its twin's bfloat16 sequence of torch ops bit for bit (up to the exponential's
    last bits, none in these), and within that sequence's bfloat16 roundings of the float32 formula; the clamp
    bites."""
    gen = torch.Generator().manual_seed(rows * hidden)
    gate_up = torch.randn(rows, 2 * hidden, generator=gen).mul(6).to(BF16)
    act = ClampedSwiGLU(7.0, 1.702)
    out = act(gate_up)
    assert out is not None and torch.equal(out, act.forward_torch(gate_up))
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert (gate > 7).any() and (up.abs() > 7).any()
    gate = gate.clamp(max=7.0)
    want = (up.clamp(-7.0, 7.0) + 1) * gate * torch.sigmoid(1.702 * gate)  # five bfloat16 roundings apart at most
    torch.testing.assert_close(out.float(), want, rtol=5 * 2 ** -8, atol=1e-2)


@pytest.mark.parametrize("rows,heads,kv_heads,head_dim,rotary_dim", [(1, 9, 3, 64, 64), (17, 4, 2, 32, 32),
                                                                    (3, 2, 1, 6, 6), (5, 3, 1, 64, 48),
                                                                    (4, 2, 2, 32, 8)])
def test_rotary_from_fused_qkv_views(rows: int, heads: int, kv_heads: int, head_dim: int, rotary_dim: int,
                                     kernel_build: str) -> None:
    """q and k arrive as strided views into one qkv row, as the attention layer splits them; a partial rotary
    embedding (Phi-4-mini's) turns the first rotary_dim dimensions of each head and copies the rest."""
    gen = torch.Generator().manual_seed(rows + heads)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, BF16, rotary_dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(BF16)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    q_out, k_out = rope(positions, q, k)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    twin_q, twin_k = rope.forward_torch(positions, q, k)
    _close_bf16(q_out, twin_q)
    _close_bf16(k_out, twin_k)
    cos, sin = rope.cos[positions].float().unsqueeze(1), rope.sin[positions].float().unsqueeze(1)
    turned = q[..., :rotary_dim].float()
    _close_bf16(q_out[..., :rotary_dim], turned * cos + rotate_half(turned) * sin)
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])
    assert torch.equal(k_out[..., rotary_dim:], k[..., rotary_dim:])


def test_other_dtypes_and_layouts_take_the_torch_twin() -> None:
    x = torch.randn(2, 8)
    assert fused.add_rms_norm(x, None, torch.ones(8), 1e-6) is None
    assert fused.silu_and_mul(x) is None
    assert fused.silu_and_mul(torch.randn(8, 2).to(BF16).t()) is None  # not contiguous
    q = torch.randn(2, 2, 4)
    assert fused.rotary(torch.zeros(2, dtype=torch.int64), q, q, torch.ones(8, 4), torch.ones(8, 4)) is None


# Where each block type keeps its float16 numbers (d, and dmin or m): bytes [start, end) of the block.
_HALVES = {"Q4_0": (0, 2), "Q4_1": (0, 4), "Q4_K": (0, 4), "Q8_0": (0, 2), "Q5_0": (0, 2), "Q5_1": (0, 4),
           "Q5_K": (0, 4), "Q6_K": (208, 210), "Q2_K": (80, 84), "Q3_K": (108, 110), "IQ4_NL": (0, 2), "IQ4_XS": (0, 2)}


def _gguf_blocks(kind: str, rows: int, inputs: int) -> np.ndarray:
    """A matrix's blocks: gguf's quantizer's for the types it writes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and float16 and
    bfloat16, with a subnormal, an infinity and a zero of either sign among them); random bytes for
    the others (every bit of their packed scales, high bits and values set somewhere) under float16 numbers of a
    weight's size, of either sign."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(rows + inputs)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16"):
        w = rng.standard_normal((rows, inputs)).astype(np.float32) * 0.05
        if kind in ("F16", "BF16"):
            w[0, :4] = [1e-7, -np.inf, 0.0, -0.0]
        return np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType[kind])).view(np.uint8)
    values, size = fused.GGUF_BLOCKS[kind]
    blocks = rng.integers(0, 256, size=(rows, inputs // values, size), dtype=np.uint8)
    start, end = _HALVES[kind]
    halves = rng.uniform(1e-4, 1e-2, size=(rows, inputs // values, (end - start) // 2))
    signs = rng.choice([-1.0, 1.0], size=halves.shape)
    blocks[..., start:end] = (halves * signs).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def test_the_block_types_are_ggufs() -> None:
    """The native entry's table of block types (its numbering, csrc/gguf_blocks.h) is gguf's sizes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for kind, size in fused.GGUF_BLOCKS.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[kind]] == size, kind


@pytest.mark.parametrize("rows,inputs", [(3, 512), (70, 1024)])  # one thread; the rows split across threads
@pytest.mark.parametrize("kind", list(fused.GGUF_BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_dequantize_gguf_gives_ggufs_values(kind: str, rows: int, inputs: int, dtype: torch.dtype,
                                          kernel_build: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: gguf's ``dequantize`` bit for bit (a zero's sign too); bfloat16: those values as torch rounds them.
    The load's fallback where the library is not built gives the same: the Q4 types' and Q8_0's twins in torch, gguf's
    own ``dequantize`` for the others."""
    from gguf import GGMLQuantizationType, quants

    raw = _gguf_blocks(kind, rows, inputs)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, inputs)).to(dtype)
    raw = torch.from_numpy(raw)
    out = fused.dequantize_gguf(raw, kind, dtype)
    assert out is not None and out.dtype == dtype
    assert torch.equal(out.view(torch.int16 if dtype == BF16 else torch.int32),
                       want.view(torch.int16 if dtype == BF16 else torch.int32))
    monkeypatch.setattr(build, "library_built", lambda source: False)
    assert torch.equal(gguf_blocks.values(raw, kind, dtype), out)


@pytest.mark.parametrize("shape", [(3, 7), (70, 1024), (5, 4, 96)])  # odd rows; split across threads; 3-d
def test_copy_float16_rounds_as_torch(shape: tuple[int, ...], kernel_build: str) -> None:
    """A float16 matrix into bfloat16 in place, natively, as torch's ``copy_`` rounds it (subnormals, infinities and
    zeros of either sign too); anything else is left to the caller."""
    src = (torch.randn(shape) * 0.05).half()
    src.view(-1)[:4] = torch.tensor([1e-7, -float("inf"), 0.0, -0.0], dtype=torch.float16)
    dst = torch.empty(shape, dtype=BF16)
    assert fused.copy_float16(dst, src)
    assert torch.equal(dst.view(torch.int16), src.to(BF16).view(torch.int16))
    assert not fused.copy_float16(torch.empty(shape), src)  # into float32: torch's copy
    assert not fused.copy_float16(torch.empty(shape[::-1], dtype=BF16).transpose(0, -1), src)  # not contiguous


def test_dequantize_gguf_refuses_what_is_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="whole 18-byte Q4_0 blocks"):
        fused.dequantize_gguf(torch.zeros(2, 30, dtype=torch.uint8), "Q4_0")
    with pytest.raises(ValueError, match="into float32 or bfloat16"):
        fused.dequantize_gguf(torch.zeros(2, 36, dtype=torch.uint8), "Q4_0", torch.float16)


def test_a_load_does_not_wait_for_the_librarys_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a cold start the library may still be compiling when the weights load: the load takes the twin then, with
    the same values, rather than wait."""
    from gguf import GGMLQuantizationType, quants

    raw = _gguf_blocks("Q4_K", 4, 512)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(4, 512))
    monkeypatch.setattr(build, "library_built", lambda source: False)
    assert fused.dequantize_gguf(torch.from_numpy(raw), "Q4_K") is None
    assert torch.equal(gguf_blocks.values(torch.from_numpy(raw), "Q4_K", BF16), want.to(BF16))


def test_the_kernels_exponentials_hold_float32_accuracy(kernel_build: str) -> None:
    """``exp16`` (e^x: SiLU, the decode walk) and ``exp2_16`` (2^x: the flash tiles' softmax) within 1e-6 of the
    exact values over their ranges; 2^x clamps at 2^-126 below (no denormals). An AVX2-only build has neither and
    says so."""
    e_args = torch.cat([torch.linspace(-87.0, 88.0, 40001), torch.linspace(-1.0, 1.0, 4001)])
    two_args = torch.cat([torch.linspace(-126.0, 2.0, 40001), torch.linspace(-1.0, 1.0, 4001)])
    e, two = fused.simd_exp(e_args), fused.simd_exp(two_args, base2=True)
    native_avx512 = kernel_build == "native" and "avx512f" in build.cpu_flags().split()
    assert (e is not None, two is not None) == (native_avx512, native_avx512)
    if not native_avx512:
        return
    for got, exact in ((e, torch.exp(e_args.double())), (two, torch.exp2(two_args.double()))):
        assert ((got.double() - exact) / exact).abs().max().item() < 1e-6
    below = fused.simd_exp(torch.tensor([-126.5, -150.0, -1000.0, float("-inf")]), base2=True)
    assert torch.equal(below, torch.full((4,), 2.0 ** -126))
