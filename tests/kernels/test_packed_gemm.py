"""The packed bfloat16 GEMM (``pagellm/ops/csrc/packed_gemm.cpp``) against its twin ``F.linear``, the packed layout
against the plain one, and the model's layers (fused q/k/v and gate/up, biases, a tied LM head and its embedding)
once their weights are packed after loading. The kernel's paths, its vector one (AVX-512 BF16, or AVX2 + FMA on
CPUs without it) and AMX tiles (where the CPU has AMX), are each held to the twin and to batch and thread invariance
(the ``isa`` fixture); on CPUs whose own build is AVX-512, an AVX2-only build of the same source (``-march=x86-64-v3``)
is held to them too, so the AVX2 tiles are tested whatever CPU runs the suite.

Tolerance. The kernel sums exact bf16 x bf16 products in float32 and rounds once to bfloat16; the oracle is the
float32 ``F.linear`` of the same bf16 inputs. The two float32 sums differ only by summation order, at most about
``2 K u32 sum|x w|`` (u32 = 2^-24, each order's error bound once), and rounding to bfloat16 adds at most half a bf16
ulp, 2^-8 relative. ``_assert_gemm_close`` checks exactly that bound (times 2 for slack), elementwise.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from pagellm.model.arch import ArchConfig
from pagellm.model.layers.linear import pack_weights
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.loader import iter_weights, load_hf_config
from pagellm.ops import build, gemm

pytestmark = pytest.mark.skipif(not gemm.available(), reason="needs AVX-512 BF16 or AVX2 + FMA, and a C++ compiler")
BF16 = torch.bfloat16


def _assert_gemm_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """``out`` is F.linear(x, w, b) up to float32 summation order and one bfloat16 rounding (module docstring)."""
    x32, w32 = x.float(), w.float()
    ref = F.linear(x32, w32, b.float() if b is not None else None)
    order = 2 * x.shape[-1] * 2.0 ** -24 * F.linear(x32.abs(), w32.abs())
    bound = 2 * (ref.abs() * 2.0 ** -8 + order) + 1e-30
    assert out.dtype == BF16 and out.shape == ref.shape
    excess = ((out.float() - ref).abs() - bound).max().item()
    assert excess <= 0, f"kernel differs from F.linear beyond bf16 rounding by {excess}"


@functools.cache
def _avx2_build() -> ctypes.CDLL:
    """The packed GEMM compiled for x86-64-v3 (AVX2, FMA, no AVX-512): the build an AVX2-only CPU makes."""
    return gemm.bind(ctypes.CDLL(str(build.build_avx2_library(gemm.SOURCE))))


@pytest.fixture(params=["vector", "amx", "avx2"])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """This module's paths: conftest's two (``vector``, ``amx``), and ``avx2``, the AVX2-only build swapped in for
    this machine's where its own is AVX-512 (where it is AVX2 already, ``vector`` is that build)."""
    if request.param != "avx2":
        yield from _on_path(request.param)
        return
    flags = set(gemm.cpu_flags().split())
    if gemm.path() == "AVX2" or not {"avx2", "fma"} <= flags:
        pytest.skip("this machine's own build is the AVX2 one (the vector path), or the CPU has no AVX2 + FMA")
    monkeypatch.setattr(gemm, "_lib", _avx2_build)
    assert gemm.path() == "AVX2"
    yield "avx2"


def _on_path(name: str) -> Iterator[str]:
    default = gemm.amx()
    if gemm.use_amx(name == "amx") != (name == "amx"):
        gemm.use_amx(default)
        pytest.skip("this CPU has no AMX-BF16")
    yield name
    gemm.use_amx(default)


def _threads(n: int) -> Callable[[], None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    return lambda: torch.set_num_threads(old)


# AVX-512 path. M: one register tile (1..8 rows), 6-row groups with 7/8/9-row remainders, more than one 192-row M
# block. K: one K block of whole pairs (576), an odd K (37, 5, 1), two K blocks (1100: 550 pairs) and two K blocks
# ending in a half pair (2049). N: whole 16-column panels, partial last panels (7, 130, 49), fewer columns than a
# panel. At one or two rows panels go in groups of 8: groups ending in 5, 6 or 7 panels (200, 96, 230 outputs).
# AMX path. M: tiles of M rows read in place (1..15), whole 32-row blocks (64) and a last whole 16-row tile (16,
# 48) in place, a rest of other sizes copied (17, 20, 24, 33, 200), more than one 256-row range of a work item
# (300: the second range 32 rows in place and 12 copied; 385; 700 at K = 1536; 1000). K: whole 16-pair
# steps (576, 1536, 96), a short last step (1100: 550 pairs, 37, 130) and an odd K (2049, 5, 1). N: an odd panel
# count (a last single panel: 49, 130, 200), partial panels; a y of 4 MiB and more is written non-temporally (64 x
# 32800, with and without bias).
CASES = [(m, 576, 960) for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 14, 15, 16, 17, 24, 48, 64, 300, 1000)] + [
    (1, 37, 130), (3, 5, 3), (8, 1, 16), (11, 1100, 49), (2, 2049, 33), (20, 2049, 7), (200, 130, 200),
    (385, 96, 70), (33, 1536, 576), (700, 1536, 40), (1, 1100, 200), (1, 576, 96), (2, 1100, 230), (64, 576, 32800)]


@pytest.mark.parametrize("m,k,n", CASES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_gemm_matches_f_linear(m: int, k: int, n: int, bias: bool, threads: int, isa: str) -> None:
    gen = torch.Generator().manual_seed(m * 10007 + k * 101 + n)
    x = torch.randn(m, k, generator=gen).to(BF16)
    w = torch.randn(n, k, generator=gen).to(BF16)
    b = torch.randn(n, generator=gen).to(BF16) if bias else None
    restore = _threads(threads)
    try:
        out = gemm.packed_linear(x, gemm.pack(w), n, b)
    finally:
        restore()
    _assert_gemm_close(out, x, w, b)


@pytest.mark.parametrize("k", [1100, 576])
def test_packed_gemm_rows_do_not_depend_on_the_batch(k: int, isa: str) -> None:
    """Each output's summation order depends only on K, not on M, the row's place in the batch or the threads:
    a row comes out bit for bit the same alone or in any batch (bfloat16 decode is batch-invariant here). On the
    AMX path rows are read in place or copied, in tiles of M rows or of 16, by the batch's size: none of it shows."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(200, k, generator=gen).to(BF16)
    x = torch.randn(1000, k, generator=gen).to(BF16)  # AMX: more than one work item's range of rows
    packed = gemm.pack(w)
    restore = _threads(2)
    try:
        together = gemm.packed_linear(x, packed, 200)
    finally:
        restore()
    for i in (0, 7, 49, 999):
        assert torch.equal(gemm.packed_linear(x[i:i + 1], packed, 200), together[i:i + 1])
    for lo, hi in ((3, 5), (5, 25), (0, 50), (900, 1000)):
        assert torch.equal(gemm.packed_linear(x[lo:hi], packed, 200), together[lo:hi])


@pytest.mark.parametrize("m", [1, 32])
@pytest.mark.parametrize("n", [576, 960, 49])
def test_packed_gemm_threads_do_not_change_a_bit(n: int, m: int, isa: str) -> None:
    """Narrow layers (576 outputs: 9 chunks of 4 panels, or 5 of 8 at one row; 960: 15, or 8; 49: one chunk) cut
    their last chunk into one piece per thread; every output is still summed in the same order, so one thread and
    two give the same bits."""
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, 1536, generator=gen).to(BF16)
    x = torch.randn(m, 1536, generator=gen).to(BF16)
    packed = gemm.pack(w)
    outs = []
    for threads in (1, 2):
        restore = _threads(threads)
        try:
            outs.append(gemm.packed_linear(x, packed, n))
        finally:
            restore()
    assert torch.equal(outs[0], outs[1])
    _assert_gemm_close(outs[1], x, w, None)


def test_packed_gemm_lm_head_shape(isa: str) -> None:
    """A vocabulary-sized matrix split over both threads (the LM head), at decode and at prefill row counts."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(49152 // 8 + 5, 576, generator=gen).to(BF16)
    packed = gemm.pack(w)
    restore = _threads(2)
    try:
        for m in (1, 32, 250):
            x = torch.randn(m, 576, generator=gen).to(BF16)
            _assert_gemm_close(gemm.packed_linear(x, packed, w.shape[0]), x, w, None)
    finally:
        restore()


def test_packed_gemm_takes_strided_rows_and_leading_dims(isa: str) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(40, 96, generator=gen).to(BF16)
    packed = gemm.pack(w)
    wide = torch.randn(5, 128, generator=gen).to(BF16)
    _assert_gemm_close(gemm.packed_linear(wide[:, :96], packed, 40), wide[:, :96], w, None)  # row stride 128
    x3 = torch.randn(2, 3, 96, generator=gen).to(BF16)
    out = gemm.packed_linear(x3, packed, 40)
    assert out.shape == (2, 3, 40)
    _assert_gemm_close(out.reshape(6, 40), x3.reshape(6, 96), w, None)
    columns = torch.randn(96, 4, generator=gen).to(BF16).t()  # last-dim stride 4: copied first
    _assert_gemm_close(gemm.packed_linear(columns, packed, 40), columns, w, None)


def test_pack_layout_round_trips() -> None:
    """Padding to whole panels and pairs is invisible: unpack and row lookups give the plain matrix back exactly."""
    gen = torch.Generator().manual_seed(3)
    for n, k in ((100, 37), (16, 2), (1, 1), (49, 576), (3, 1537)):
        w = torch.randn(n, k, generator=gen).to(BF16)
        packed = gemm.pack(w)
        assert packed.shape == (-(-n // 16), (k + 1) // 2, 16, 2)
        assert torch.equal(packed, gemm.pack_torch(w))  # the native pass lays out the permute's bytes, padding too
        assert torch.equal(gemm.unpack(packed, n, k), w)
        ids = torch.randint(0, n, (3, 5), generator=gen)
        assert torch.equal(gemm.rows(packed, ids, n, k), F.embedding(ids, w))
        many = torch.randint(0, n, (300,), generator=gen)  # the threaded gather
        assert torch.equal(gemm.rows(packed, many, n, k), F.embedding(many, w))
    with pytest.raises(IndexError, match=r"\[0, 49\)"):
        gemm.rows(packed, torch.tensor([0, 49]), 49, 576)
    with pytest.raises(ValueError, match="2-D bfloat16"):
        gemm.pack(torch.zeros(4, 4))


def test_linear_dispatch_keeps_f_linear_semantics() -> None:
    """Plain weights (float32, or wherever nothing was packed) go to F.linear exactly; a packed one serves any M."""
    gen = torch.Generator().manual_seed(0)
    w32 = torch.randn(64, 96, generator=gen)
    x32 = torch.randn(3, 96, generator=gen)
    assert torch.equal(gemm.linear(x32, w32), F.linear(x32, w32))
    param = torch.nn.Parameter(w32.clone(), requires_grad=False)
    assert not gemm.pack_parameter(param) and gemm.packed_shape(param) is None  # float32 stays plain
    param = torch.nn.Parameter(w32.to(BF16), requires_grad=False)
    assert gemm.pack_parameter(param) and gemm.packed_shape(param) == (64, 96)
    assert gemm.pack_parameter(param)  # packing twice (a tied weight) is a no-op
    assert torch.equal(gemm.plain(param), w32.to(BF16))
    for m in (1, 8, 40, 300):
        x = torch.randn(m, 96, generator=gen).to(BF16)
        _assert_gemm_close(gemm.linear(x, param), x, w32.to(BF16), None)
    # float32 inputs against a packed weight still get F.linear's float32 result on the plain weight
    assert torch.equal(gemm.linear(x32, param), F.linear(x32, w32.to(BF16).float()))


@pytest.fixture(scope="module")
def tied_qwen2(tiny_model_factory: Callable[..., Path]) -> Path:
    """q/k/v biases, a tied LM head, and widths that are not whole panels (gate/up 2 x 100, vocab 333)."""
    return tiny_model_factory("qwen2", tie_word_embeddings=True, hidden_size=72, intermediate_size=100,
                              vocab_size=333)


def _load(model_dir: Path, dtype: torch.dtype) -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    model = LlamaForCausalLM(ArchConfig.from_hf(load_hf_config(model_dir)), dtype)
    model.load_weights(iter_weights(model_dir))
    return model, {name: t.to(dtype) for name, t in iter_weights(model_dir)}


def test_loaded_bf16_model_packs_every_gemm_weight_once(tied_qwen2: Path) -> None:
    model, ckpt = _load(tied_qwen2, BF16)
    layer = model.model.layers[0]
    embed, head = model.model.embed_tokens, model.lm_head
    assert head.weight is embed.weight and gemm.packed_shape(head.weight) == (333, 72)  # one shared table
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert gemm.packed_shape(linear.weight) is not None
    prefix = "model.layers.0."
    qkv = torch.cat([ckpt[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(gemm.plain(layer.self_attn.qkv_proj.weight), qkv)  # fused order survives packing
    gate_up = torch.cat([ckpt[prefix + "mlp.gate_proj.weight"], ckpt[prefix + "mlp.up_proj.weight"]])
    assert torch.equal(gemm.plain(layer.mlp.gate_up_proj.weight), gate_up)
    table = ckpt["model.embed_tokens.weight"]
    assert torch.equal(head.plain_weight(), table) and torch.equal(embed.plain_weight(), table)
    ids = torch.tensor([0, 5, 332, 17, 16, 15])
    assert torch.equal(embed(ids), F.embedding(ids, table)) and torch.equal(head.rows(ids), table[ids])

    gen = torch.Generator().manual_seed(4)
    for m in (1, 7, 70):
        h = torch.randn(m, 72, generator=gen).to(BF16)
        _assert_gemm_close(model.compute_logits(h), h, table, None)
        qkv_bias = torch.cat([ckpt[prefix + f"self_attn.{p}_proj.bias"] for p in "qkv"])
        _assert_gemm_close(layer.self_attn.qkv_proj(h), h, qkv, qkv_bias)
        a = torch.randn(m, 100, generator=gen).to(BF16)
        _assert_gemm_close(layer.mlp.down_proj(a), a, ckpt[prefix + "mlp.down_proj.weight"], None)


def test_packed_model_refuses_a_second_load(tied_qwen2: Path) -> None:
    model, _ = _load(tied_qwen2, BF16)
    with pytest.raises(ValueError, match="already packed.*newly built model"):
        model.load_weights(iter_weights(tied_qwen2))


def test_float32_model_stays_plain(tied_qwen2: Path) -> None:
    model, ckpt = _load(tied_qwen2, torch.float32)
    assert pack_weights(model) == 0
    assert all(gemm.packed_shape(p) is None for p in model.parameters())
    assert torch.equal(model.lm_head.weight, ckpt["model.embed_tokens.weight"])


@pytest.mark.parametrize(("kernel", "flag"), [("gemm", "amx_bf16"), ("gemm_w8a8", "amx_int8")])
@pytest.mark.parametrize("setting", ["0", "1"])
def test_amx_path_follows_the_environment(setting: str, kernel: str, flag: str) -> None:
    """``PAGELLM_GEMM_AMX=0`` keeps a process's packed GEMMs on their vector paths (bfloat16 on AVX-512, W8A8 on
    VNNI); by default each takes AMX wherever the CPU has it."""
    probe = f"from pagellm.ops import {kernel}; print({kernel}.amx())"
    env = {**os.environ, "PAGELLM_GEMM_AMX": setting}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    has_amx = flag in gemm.cpu_flags().split()
    assert out.stdout.strip() == str(setting == "1" and has_amx)


@pytest.mark.parametrize("m", [1, 2, 5, 7, 16, 24, 40, 300])
@pytest.mark.parametrize("k", [576, 100, 1100])
def test_gate_up_silu_in_one_pass_equals_the_two_calls(m: int, k: int, isa: str) -> None:
    """The fused gate/up GEMM + SiLU·mul (the decoder stack's MLP on AMX and AVX-512 BF16: tiles of 1-2 rows with
    four gate/up pairs, 3-6 rows with two, 7-8 with one; K of 1100 in two blocks) gives exactly the bits of the GEMM
    followed by ``silu_and_mul``; the AVX2 build and a gate width that is not whole panels decline it (the caller
    then makes the two calls)."""
    from pagellm.ops import fused

    gen = torch.Generator().manual_seed(m + k)
    inter = 160
    w = (torch.randn(2 * inter, k, generator=gen) * 0.2).to(BF16)
    x = torch.randn(m, k, generator=gen).to(BF16)
    packed = gemm.pack(w)
    restore = _threads(2)
    try:
        one_pass = gemm.packed_linear_silu_mul(x, packed, 2 * inter)
        two_calls = fused.silu_and_mul(gemm.packed_linear(x, packed, 2 * inter))
        odd = gemm.packed_linear_silu_mul(x, gemm.pack(w[:2 * 40]), 2 * 40)  # 40 gate columns: 2.5 panels
    finally:
        restore()
    assert odd is None
    if gemm.path() == "AVX2":
        assert one_pass is None
        return
    assert one_pass is not None and torch.equal(one_pass.view(torch.int16), two_calls.view(torch.int16))


def test_path_names_the_kernel_that_runs(isa: str) -> None:
    """The worker's log line and the GEMM benchmark name the path from ``gemm.path()``: AMX tiles when switched
    on, else the vector path the library was built with: AVX-512 BF16 where the CPU has it (-march=native), AVX2 +
    FMA otherwise, or in the AVX2-only build."""
    flags = set(gemm.cpu_flags().split())
    vector = "AVX-512 BF16" if "avx512_bf16" in flags and isa != "avx2" else "AVX2"
    assert gemm.path() == ("AMX" if isa == "amx" else vector)
