"""The quantized GEMMs, W8A8 int8 (``pagellm/ops/csrc/packed_gemm_w8a8.cpp``) and W4A8 4-bit
(``packed_gemm_w4a8.cpp``), against their plain-PyTorch twins ``reference_linear``, bit for bit: every output is
exact int32 sums scaled and summed by the same float32 ops in the same order, so any M, N, K, blocking, thread count
or batch gives the same bits. The quantization itself is held to its error bound against ``F.linear`` on the
unquantized weight, and each packed operand to its plain form (``(Q, s_w)``, ``(q, d, m)``).

int8's error bound (the worst case). With ``x = x̂ + e_x`` (|e_x| ≤ s_x / 2 per element, rounding to the grid of
step s_x) and ``W = Ŵ + e_w`` (|e_w| ≤ s_w / 2), ``x·W − x̂·Ŵ = e_x·Ŵ + x·e_w``, so each output is off by at most
``s_x/2 · Σ|Ŵ| + s_w/2 · Σ|x|``, plus the final rounding to bfloat16 (2^-8 relative) and the float32 epilogue's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.ops import fused, gemm, gemm_w4a8, gemm_w4a16, gemm_w8a8

BF16 = torch.bfloat16
kernel = pytest.mark.skipif(not gemm_w8a8.available(), reason="the int8 kernel needs AVX-512 VNNI and a compiler")
# The kernels take the same calls: quantize(W) -> a tuple that pack(*) and reference_linear(x, *, bias) take.
# W4A16 (gemm_w4a16, bfloat16 activations) needs AVX-512 BF16 too.
KERNELS = pytest.mark.parametrize("fmt", [gemm_w8a8, gemm_w4a8, pytest.param(gemm_w4a16, marks=pytest.mark.skipif(
    not gemm_w4a16.available(), reason="the W4A16 kernel needs AVX-512 BF16 and VNNI"))], ids=["w8a8", "w4a8", "w4a16"])


def _assert_twin(fmt, out: torch.Tensor, x: torch.Tensor, quantized: tuple,  # noqa: ANN001
                 bias: torch.Tensor | None = None) -> None:
    """The kernel's output against its twin's: the integer kernels' bits; W4A16's float32 sums (its twin is
    ``F.linear`` in float32) within their float32 rounding (2^-20 of the row's Σ|x·W|) and one bfloat16 rounding."""
    ref = fmt.reference_linear(x, *quantized, bias)
    if fmt is not gemm_w4a16:
        assert torch.equal(_bits(out), _bits(ref))
        return
    n, k = quantized[0].shape[0], x.shape[-1]
    w = gemm_w4a8.dequantize(gemm_w4a8.pack(*quantized), n, k).float()
    scale = x.float().abs() @ w.abs().t()
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + scale * 2 ** -20).all()


def _case(m: int, n: int, k: int, seed: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(BF16)
    w = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)).to(BF16)  # scales differ by row
    b = torch.randn(n, generator=gen).to(BF16) if bias else None
    return x, w, b


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


# M: one row, the 8-row tile, a 9-row split, more than one 192-row M block; N: part panels, wide groups;
# K: not whole quads (int8) or groups (4-bit), 576 / 1536 (the built-in model's), 2500 (int8: two K blocks with int32
# partial sums between them).
SHAPES = [(1, 40, 12), (2, 300, 7), (3, 33, 17), (8, 130, 64), (9, 576, 576), (37, 1536, 576), (200, 576, 1536),
          (5, 100, 2500), (1, 1, 1), (300, 96, 64), (64, 2200, 2052)]


@kernel
@KERNELS
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_kernel_equals_its_twin_bit_for_bit(fmt, m: int, n: int, k: int, bias: bool) -> None:  # noqa: ANN001
    x, w, b = _case(m, n, k, seed=m * 7 + n + k, bias=bias)
    quantized = fmt.quantize(w)
    out = fmt.packed_linear(x, fmt.pack(*quantized), n, b)
    assert out.dtype == BF16 and out.shape == (m, n)
    _assert_twin(fmt, out, x, quantized, b)


@kernel
@KERNELS
def test_rows_are_batch_and_thread_invariant(fmt) -> None:  # noqa: ANN001
    x, w, b = _case(70, 700, 900, seed=5, bias=True)
    packed = fmt.pack(*fmt.quantize(w))
    whole = fmt.packed_linear(x, packed, 700, b)
    for lo, hi in [(0, 1), (3, 5), (10, 19), (20, 70)]:
        assert torch.equal(_bits(fmt.packed_linear(x[lo:hi], packed, 700, b)), _bits(whole[lo:hi]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_bits(fmt.packed_linear(x, packed, 700, b)), _bits(whole))
    finally:
        torch.set_num_threads(threads)


# (M, I, K) of a gate/up weight [2I, K]: wide 1- and 2-row tiles (4 pairs), 3-6 rows (2 pairs), 7-8 rows (1 pair),
# a 9-row split, a part group of pairs; two K blocks (int32 partial sums of both halves); the built-in model's.
GATE_UP = [(1, 64, 12), (2, 48, 7), (3, 16, 17), (7, 32, 64), (8, 80, 576), (9, 64, 33), (200, 96, 1536),
           (5, 32, 2500), (33, 1536, 576)]


@kernel
@KERNELS
@pytest.mark.parametrize("m,i,k", GATE_UP, ids=[f"{m}x{i}x{k}" for m, i, k in GATE_UP])
def test_gate_up_with_silu_mul_equals_the_two_calls_bit_for_bit(fmt, m: int, i: int, k: int) -> None:  # noqa: ANN001
    """The one-pass gate/up entry rounds gate and up to bfloat16 as the GEMM's output would be, then runs the SiLU·mul
    kernel's code: the bits of the GEMM followed by ``fused.silu_and_mul``, and of the twins'."""
    x, w, _ = _case(m, 2 * i, k, seed=m + i + k, bias=False)
    quantized = fmt.quantize(w)
    one = fmt.packed_linear_silu_mul(x, fmt.pack(*quantized), 2 * i)
    assert one is not None and one.shape == (m, i) and one.dtype == BF16
    two = fused.silu_and_mul(fmt.packed_linear(x, fmt.pack(*quantized), 2 * i))
    assert torch.equal(_bits(one), _bits(two))
    if fmt is gemm_w4a16:  # its twin differs by float32 rounding: held to it before the SiLU·mul
        _assert_twin(fmt, fmt.packed_linear(x, fmt.pack(*quantized), 2 * i), x, quantized)
        return
    gate, up = fmt.reference_linear(x, *quantized).chunk(2, dim=-1)
    assert torch.allclose(one.float(), (F.silu(gate.float()) * up.float()).to(BF16).float(), rtol=2 ** -7, atol=1e-6)


@kernel
@KERNELS
def test_gate_up_with_silu_mul_needs_whole_panels(fmt) -> None:  # noqa: ANN001
    """A gate width that is not whole panels of 16 is left to the two calls (``None``)."""
    x, w, _ = _case(3, 80, 32, seed=6, bias=False)
    assert fmt.packed_linear_silu_mul(x, fmt.pack(*fmt.quantize(w)), 80) is None  # I = 40


@kernel
@KERNELS
def test_strided_and_3d_inputs(fmt) -> None:  # noqa: ANN001
    x, w, _ = _case(12, 50, 40, seed=9, bias=False)
    quantized = fmt.quantize(w)
    packed = fmt.pack(*quantized)
    wide = torch.cat([x, x], dim=1)[:, :40]  # rows with stride 80
    out = fmt.packed_linear(x, packed, 50)
    _assert_twin(fmt, out, x, quantized)
    assert torch.equal(_bits(fmt.packed_linear(wide, packed, 50)), _bits(out))
    out3 = fmt.packed_linear(x.view(3, 4, 40), packed, 50)
    assert out3.shape == (3, 4, 50)
    assert torch.equal(_bits(out3.reshape(12, 50)), _bits(out))


@pytest.mark.parametrize("m,n,k", [(16, 64, 96), (40, 200, 1536)])
def test_quantization_error_stays_within_its_bound(m: int, n: int, k: int) -> None:
    """Runs on the twin everywhere and on the kernel where it runs (module docstring's bound, elementwise)."""
    x, w, b = _case(m, n, k, seed=11, bias=True)
    q, scale = gemm_w8a8.quantize(w)
    _, sx = gemm_w8a8.quantize_rows(x)
    exact = F.linear(x.double(), w.double(), b.double())
    bound = (sx.double()[:, None] / 2) * (q.double().abs() * scale.double()[:, None]).sum(1)[None, :] + \
        (scale.double()[None, :] / 2) * x.double().abs().sum(1)[:, None]
    bound = bound + exact.abs() * 2.0 ** -7 + 1e-6
    outs = [gemm_w8a8.reference_linear(x, q, scale, b)]
    if gemm_w8a8.available():
        outs.append(gemm_w8a8.packed_linear(x, gemm_w8a8.pack(q, scale), n, b))
    for out in outs:
        assert ((out.double() - exact).abs() <= bound).all()
        # the worst case adds every element's error; they are independent, so the typical error is far smaller
        rms = ((out.double() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt()
        assert rms < 0.015


def test_rows_quantize_to_nearest_even_with_zero_and_tiny_rows() -> None:
    x = torch.tensor([[127.0, 63.5, -0.5, 1.5, 2.5, 0.0], [0.0] * 6, [1e-38, -1e-38, 0, 0, 0, 0]]).to(BF16)
    q, sx = gemm_w8a8.quantize_rows(x)
    assert q[0].tolist() == [127, 64, -0, 2, 2, 0]  # 63.5 -> 64, -0.5 -> 0, 1.5 -> 2, 2.5 -> 2: to even
    assert sx[0].item() == 1.0
    assert q[1].abs().sum() == 0 and sx[1] == 0  # an all-zero row: scale 0, no NaN
    assert torch.isfinite(q[2]).all()  # 127 / max overflows: the row quantizes to zeros


@kernel
@KERNELS
def test_zero_rows_and_zero_weights_give_the_bias(fmt) -> None:  # noqa: ANN001
    x, w, b = _case(4, 20, 24, seed=2, bias=True)
    x[1] = 0
    w[3] = 0
    out = fmt.packed_linear(x, fmt.pack(*fmt.quantize(w)), 20, b)
    assert torch.equal(out[1], b) and torch.equal(out[:, 3], b[3].expand(4))


def test_the_packed_operand_holds_q_and_the_scales() -> None:
    _, w, _ = _case(1, 37, 21, seed=3, bias=False)
    q, scale = gemm_w8a8.quantize(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and (q.abs().amax(1) == 127).all()
    assert torch.equal(scale, w.float().abs().amax(1) / 127)
    packed = gemm_w8a8.pack(q, scale)
    assert packed.dtype == torch.int8 and packed.numel() == 3 * 6 * 64 + 48 * 8  # 3 panels x 6 quads, then 48 x 2
    q2, scale2 = gemm_w8a8.unpack(packed, 37, 21)
    assert torch.equal(q2, q) and torch.equal(scale2, scale)
    deq = gemm_w8a8.dequantize(packed, 37, 21)
    assert ((deq.float() - w.float()).abs() <= scale[:, None] * 0.51 + w.float().abs() * 2.0 ** -8).all()


@KERNELS
def test_rows_are_the_dequantized_matrixs_rows(fmt) -> None:  # noqa: ANN001
    """``rows`` (a tied quantized LM head's embedding lookup) gathers ``dequantize``'s rows, any id shape."""
    _, w, _ = _case(1, 37, 40, seed=15, bias=False)
    packed = fmt.pack(*fmt.quantize(w))
    ids = torch.tensor([[36, 0, 17], [16, 15, 36]])
    assert torch.equal(fmt.rows(packed, ids, 37, 40), fmt.dequantize(packed, 37, 40)[ids])
    with pytest.raises(IndexError, match=r"row ids must lie in \[0, 37\)"):
        fmt.rows(packed, torch.tensor([37]), 37, 40)


@kernel
@KERNELS
def test_a_quantized_parameter_runs_through_gemm_linear(fmt) -> None:  # noqa: ANN001
    x, w, b = _case(6, 48, 32, seed=4, bias=True)
    param = torch.nn.Parameter(w.clone(), requires_grad=False)
    fmt.quantize_parameter(param)
    assert gemm.packed_shape(param) == (48, 32) and gemm.weight_format(param) == fmt.FORMAT
    _assert_twin(fmt, gemm.linear(x, param, b), x, fmt.quantize(w), b)
    assert torch.equal(gemm.plain(param), fmt.dequantize(param.data, 48, 32))
    assert torch.equal(gemm.weight_rows(param, torch.tensor([47, 2])), gemm.plain(param)[[47, 2]])
    # float32 rows take the dequantized weight (F.linear)
    assert torch.allclose(gemm.linear(x.float(), param), F.linear(x.float(), gemm.plain(param).float()))
    with pytest.raises(ValueError, match=f"{fmt.FORMAT} quantizes 2-D bfloat16 weights"):
        fmt.quantize_parameter(torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False))


# ---------------------------------------------------------------------------------------------- 4-bit specifics
# A 4-bit weight is off by at most half its group's step d (plus float16's rounding of d and m, 2^-11 relative, and
# bfloat16's of the dequantized value); a product then by s_x/2 · Σ|Ŵ| (the activations' rounding) from
# ``F.linear`` over the dequantized weight Ŵ, plus the float32 epilogue's and bfloat16's roundings.


def test_4bit_weights_stay_within_half_a_step() -> None:
    _, w, _ = _case(1, 37, 100, seed=12, bias=False)  # K = 100: the last group padded with zeros
    q, d, m = gemm_w4a8.quantize(w)
    assert q.shape == (37, 128) and d.shape == m.shape == (37, 4) and d.dtype == m.dtype == torch.float16
    assert int(q.max()) == 15 and int(q.min()) == 0
    deq = gemm_w4a8.dequantize(gemm_w4a8.pack(q, d, m), 37, 100).float()
    step = d.float().repeat_interleave(32, dim=1)[:, :100]
    lows = m.float().repeat_interleave(32, dim=1)[:, :100]
    slack = (lows.abs() + 15 * step) * 2.0 ** -10 + w.float().abs() * 2.0 ** -8
    assert ((deq - w.float()).abs() <= step / 2 + slack).all()
    # a constant group is exact (d = 0, q = 0, m = the value)
    flat = torch.full((1, 64), 0.375).to(BF16)
    q, d, m = gemm_w4a8.quantize(flat)
    assert not d.any() and not q.any() and (m == 0.375).all()
    assert torch.equal(gemm_w4a8.dequantize(gemm_w4a8.pack(q, d, m), 1, 64), flat)


@pytest.mark.parametrize("m,n,k", [(16, 64, 96), (40, 200, 1536)])
def test_4bit_products_stay_within_their_bound(m: int, n: int, k: int) -> None:
    """Runs on the twin everywhere and on the kernel where it runs (the bound above, elementwise)."""
    x, w, b = _case(m, n, k, seed=13, bias=True)
    quantized = gemm_w4a8.quantize(w)
    w_hat = gemm_w4a8.dequantize(gemm_w4a8.pack(*quantized), n, k).double()
    _, sx = gemm_w8a8.quantize_rows(x)
    exact = F.linear(x.double(), w_hat, b.double())
    bound = (sx.double()[:, None] / 2) * w_hat.abs().sum(1)[None, :] + exact.abs() * 2.0 ** -7 + 1e-5
    outs = [gemm_w4a8.reference_linear(x, *quantized, b)]
    if gemm_w4a8.available():
        outs.append(gemm_w4a8.packed_linear(x, gemm_w4a8.pack(*quantized), n, b))
    for out in outs:
        assert ((out.double() - exact).abs() <= bound).all()
    # against the unquantized weight: 4 bits a weight cost a few percent of each output's size
    full = F.linear(x.double(), w.double(), b.double())
    assert ((outs[0].double() - full).pow(2).mean() / full.pow(2).mean()).sqrt() < 0.1


@kernel
@KERNELS
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_the_native_quantizer_packs_the_twins_bytes(fmt, m: int, n: int, k: int) -> None:  # noqa: ANN001
    """``quantize_pack`` (what a model's load runs) lays out ``pack(*quantize(W))`` byte for byte: part panels, part
    quads or groups, constant groups and rows included."""
    _, w, _ = _case(1, n, k, seed=n + k, bias=False)
    w[0, :min(k, 5)] = 0.25
    w[n // 2] = -0.5
    assert torch.equal(fmt.quantize_pack(w), fmt.pack(*fmt.quantize(w)))


@kernel
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_a_checkpoints_integers_pack_natively_as_the_twin_packs_them(m: int, n: int, k: int) -> None:
    """``pack_groups`` (a 4-bit checkpoint's load: its integers held as a bfloat16 weight, its groups' d and m) lays
    out ``pack(q, d, m)`` byte for byte, part panels and part groups (zeros beyond K) included; a value that is not a
    4-bit integer is refused."""
    _, w, _ = _case(1, n, k, seed=n + k + 1, bias=False)
    q, d, m = gemm_w4a8.quantize(w)
    values = q[:, :k].to(torch.bfloat16)
    padded = torch.nn.functional.pad(q[:, :k], (0, q.shape[1] - k))  # a checkpoint's last group: zeros beyond K
    assert torch.equal(gemm_w4a8.pack_groups(values, d, m), gemm_w4a8.pack(padded, d, m))
    for bad in (16.0, -1.0, 2.5):
        wrong = values.clone()
        wrong[n - 1, k - 1] = bad
        with pytest.raises(ValueError, match="not a whole number in \\[0, 15\\]"):
            gemm_w4a8.pack_groups(wrong, d, m)


@kernel
@pytest.mark.parametrize(("fmt", "bad"), [(gemm_w8a8, float("nan")), (gemm_w8a8, float("inf")),
                                          (gemm_w4a8, float("nan")), (gemm_w4a8, float("inf")), (gemm_w4a8, 3e38)],
                         ids=["w8a8-nan", "w8a8-inf", "w4a8-nan", "w4a8-inf", "w4a8-range"])
def test_the_native_quantizer_refuses_what_the_format_cannot_hold(fmt, bad: float) -> None:  # noqa: ANN001
    _, w, _ = _case(1, 20, 64, seed=16, bias=False)
    w[3, 40], w[3, 41] = bad, -bad if bad == 3e38 else 0.0
    with pytest.raises(ValueError, match=f"a weight is not finite.*this weight cannot take {fmt.FORMAT}"):
        fmt.quantize_pack(w)


def test_the_4bit_packed_operand_holds_the_nibbles_and_their_scales() -> None:
    _, w, _ = _case(1, 37, 40, seed=14, bias=False)
    q, d, m = gemm_w4a8.quantize(w)
    packed = gemm_w4a8.pack(q, d, m)
    assert packed.dtype == torch.int8 and packed.numel() == 3 * 2 * 5 * 64  # 3 panels x 2 groups x 5 lines
    body = packed.view(torch.uint8).view(3, 2, 5, 64)
    # line 1 of group 0, byte 4c + i: input 8 + i of column c low, 12 + i high
    assert body[0, 0, 1, 4 * 5 + 2] == q[5, 10] | (q[5, 14] << 4)
    assert body[2, 1, 4, :32].contiguous().view(torch.float16)[4] == d[36, 1]  # column 36: panel 2's fifth
    assert body[2, 1, 4, 32:].contiguous().view(torch.float16)[4] == m[36, 1]
    assert not body[2, :, :4, 4 * 5:].any()  # padded columns 37..47 hold zeros
    assert all(torch.equal(a, b) for a, b in zip(gemm_w4a8.unpack(packed, 37, 40), (q, d, m)))
