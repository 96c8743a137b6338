"""The C++ paged attention kernel against its plain-PyTorch twin (``attention/torch_ref.py``) and dense float64
attention: decodes, prompt chunks (fresh and after a prefix hit), speculative chains and draft trees in one step."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagellm.attention import cpu_paged
from pagellm.attention.base import CommonAttentionInputs, quantize_kv, window_starts
from pagellm.attention.cpu_paged import CpuPagedBackend, PagedKernel, build_metadata, load_kernel
from pagellm.attention.torch_ref import TorchRefBackend
from pagellm.ops import build
from pagellm.spec.tree import row_mask, static_tree


def _random_step(q_lens: list[int], ctx_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, seed: int):
    """A paged cache holding each request's context in shuffled blocks, plus the step's new q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = np.zeros((len(ctx_lens), max(blocks_needed)), dtype=np.int64)
    for row, n in enumerate(blocks_needed):
        table[row, :n] = [order.pop() for _ in range(n)]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    total = sum(q_lens)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    slots = []
    for row, (ql, cl) in enumerate(zip(q_lens, ctx_lens)):
        for pos in range(cl - ql, cl):
            slots.append(int(table[row, pos // block_size]) * block_size + pos % block_size)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    common = CommonAttentionInputs(qsl, np.array(ctx_lens, dtype=np.int64), table,
                                   torch.tensor(slots, dtype=torch.int64), block_size)
    return q, k, v, cache, common


def _dense(q: torch.Tensor, cache: torch.Tensor, common: CommonAttentionInputs, scale: float,
           window: int | None = None, sinks: torch.Tensor | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """Every row in float64 from the (already written) cache: causal, or the row's tree mask after its context;
    under a sliding ``window`` the keys before each token's window (counted from its position) dropped; with
    ``sinks`` ([heads]) each head's softmax taken over its scores and its sink, whose share is then dropped; with
    ``softcap`` each scaled score made softcap * tanh(score / softcap) first."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, bs = cache.shape[3], common.block_size
    trees = common.tree_masks or {}
    first_key = torch.from_numpy(window_starts(common.token_positions(), window)) if window else None
    out = []
    for row in range(len(common.seq_lens)):
        start, end = int(common.query_start_loc[row]), int(common.query_start_loc[row + 1])
        n, ctx = end - start, int(common.seq_lens[row])
        idx = [int(common.block_table[row, p // bs]) * bs + p % bs for p in range(ctx)]
        keys = cache[0].reshape(-1, kv_heads, head_dim)[idx].double().repeat_interleave(heads // kv_heads, 1)
        vals = cache[1].reshape(-1, kv_heads, head_dim)[idx].double().repeat_interleave(heads // kv_heads, 1)
        own = trees[row] if row in trees else torch.ones(n, n, dtype=torch.bool).tril_()
        allowed = torch.cat([torch.ones(n, ctx - n, dtype=torch.bool), own], dim=1)
        if first_key is not None:
            allowed &= torch.arange(ctx)[None, :] >= first_key[start:end, None]
        scores = torch.einsum("qhd,thd->hqt", q[start:end].double(), keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            probs = torch.cat([scores, sinks.double()[:, None, None].expand(-1, n, 1)], -1).softmax(-1)[..., :-1]
        out.append(torch.einsum("hqt,thd->qhd", probs, vals).reshape(n, -1))
    return torch.cat(out)


def assert_matches_reference_and_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                                       common: CommonAttentionInputs, window: int | None, scale: float, tol: float,
                                       **extra: object) -> None:
    """One step on the C++ backend and on the reference backend (each on its own copy of ``cache``), with ``extra``
    (``sinks=``, ``softcap=``) given to both: they agree within ``tol``, the C++ output agrees with dense float64
    attention with ``extra``, and ``extra`` matters (the dense output without it differs by more than 20 ``tol``)."""
    ref_cache, fast_cache = cache.clone(), cache.clone()
    kwargs = dict(sliding_window=window, **extra)
    expected = TorchRefBackend().forward(q, k, v, ref_cache, TorchRefBackend().build(common), scale, **kwargs)
    got = CpuPagedBackend().forward(q, k, v, fast_cache, CpuPagedBackend().build(common), scale, **kwargs)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    dense = _dense(q, fast_cache, common, scale, window, **extra)  # type: ignore[arg-type]
    torch.testing.assert_close(got.double(), dense, atol=tol, rtol=tol)
    assert (dense - _dense(q, fast_cache, common, scale, window)).abs().max() > 20 * tol


def _both(q, k, v, cache, common, scale):
    """(torch_ref output, cpu_paged output, the cache after the step's K/V were written)."""
    ref, fast = TorchRefBackend(), CpuPagedBackend()
    ref_cache, fast_cache = cache.clone(), cache.clone()
    expected = ref.forward(q, k, v, ref_cache, ref.build(common), scale)
    got = fast.forward(q, k, v, fast_cache, fast.build(common), scale)
    assert torch.equal(ref_cache, fast_cache)  # both wrote the new K/V into the same slots
    return expected, got, fast_cache


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# Shapes cover the flash tiles (head_dim 64/128, bf16), the walk's register-resident fixed shapes, its generic
# vector walk (other multiples of 16), the scalar walk (head_dim 24) and block sizes that split the key tiles.
SHAPES = [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 32, 8), (8, 1, 16, 1), (12, 2, 48, 4), (6, 3, 64, 32),
          (4, 2, 24, 8), (8, 2, 64, 4), (14, 2, 64, 16), (12, 2, 128, 16), (24, 8, 128, 16), (15, 3, 128, 16),
          (14, 2, 128, 16), (16, 2, 128, 16)]
# (14, 2, 64) and (12, 2, 128): Qwen2-0.5B and 1.5B (groups 7, 6); then the head-128 groups 3 (Llama 3.2 3B),
# 5 (Qwen2.5/3 14B's 40 over 8, here 15 over 3), 7 (Qwen2.5-7B's 28 over 4) and 8 (Qwen2.5-3B). bfloat16
# single-token rows of head_dim 64/128 take the AVX-512 BF16 walk (walk_bf16.h); (8, 2, 64, 4) gives it key tiles
# cut by small blocks.


@functools.cache
def _avx2_kernel() -> PagedKernel:
    """The kernel compiled for x86-64-v3 (AVX2, FMA, no AVX-512): its token walk is walk_avx2.h, and it has no flash
    tiles (prompt rows take the walk)."""
    return PagedKernel(ctypes.CDLL(str(build.build_avx2_library(cpu_paged.SOURCE))),
                       lambda: ctypes.CDLL(str(build.build_avx2_library(cpu_paged.FP8_SOURCE))))


AVX2_BUILD = (cpu_paged, "load_kernel", _avx2_kernel)  # the kernel_build fixture's swap (tests/kernels/conftest.py)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_decode_rows_match_reference(dtype, heads, kv_heads, head_dim, block_size, kernel_build) -> None:
    ctx_lens = [1, 5, block_size, block_size + 1, 97, 3 * block_size]
    q, k, v, cache, common = _random_step([1] * len(ctx_lens), ctx_lens, heads, kv_heads, head_dim, block_size,
                                          dtype, seed=heads + block_size)
    scale = head_dim ** -0.5
    expected, got, written = _both(q, k, v, cache, common, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), _dense(q, written, common, scale), atol=tol, rtol=tol)


def _mixed_step(heads, kv_heads, head_dim, block_size, dtype, seed):
    """Decodes, fresh prompts, chunks after cached context, chains and trees (one of 84 nodes: two mask words)."""
    small, big = static_tree([3, 2]), static_tree([4, 4, 4, 1])[:84]
    rows = [  # (query tokens, context length, tree parents or None)
        (1, 40, None), (37, 37, None), (5, 61, None), (len(small) + 1, 30, small), (1, 3, None),
        (70, 70, None), (22, 70, None), (3, 3, None), (85, 120, big), (5, 5 + block_size, None), (2, 17, None),
    ]
    q, k, v, cache, common = _random_step([r[0] for r in rows], [r[1] for r in rows], heads, kv_heads, head_dim,
                                          block_size, dtype, seed)
    trees = {i: row_mask(n, parents) for i, (n, _, parents) in enumerate(rows) if parents is not None}
    return q, k, v, cache, dataclasses.replace(common, tree_masks=trees)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_mixed_step_matches_reference_and_dense(dtype, heads, kv_heads, head_dim, block_size, kernel_build) -> None:
    q, k, v, cache, common = _mixed_step(heads, kv_heads, head_dim, block_size, dtype, seed=heads * block_size)
    scale = head_dim ** -0.5
    expected, got, written = _both(q, k, v, cache, common, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), _dense(q, written, common, scale), atol=tol, rtol=tol)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_float8_caches_match_reference_and_dense(kv_dtype, dtype, heads, kv_heads, head_dim, block_size,
                                                 kernel_build) -> None:
    """``--kv-cache-dtype fp8*``: K/V are written rounded (the same bits by both backends) and every path (the
    bf16 walk and flash tiles, the float32 walks, the AVX2 build's portable walk) attends over the stored values."""
    q, k, v, cache, common = _mixed_step(heads, kv_heads, head_dim, block_size, dtype, seed=heads * block_size)
    scale = head_dim ** -0.5
    ref, fast = TorchRefBackend(), CpuPagedBackend()
    ref_cache, fast_cache = quantize_kv(cache, kv_dtype), quantize_kv(cache, kv_dtype)
    expected = ref.forward(q, k, v, ref_cache, ref.build(common), scale)
    got = fast.forward(q, k, v, fast_cache, fast.build(common), scale)
    assert got.dtype == dtype and torch.equal(ref_cache.view(torch.uint8), fast_cache.view(torch.uint8))
    slots = common.slot_mapping
    stored = fast_cache[0].view(-1, kv_heads, head_dim)[slots]
    assert torch.equal(stored.view(torch.uint8), quantize_kv(k, kv_dtype).view(torch.uint8))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), _dense(q, fast_cache, common, scale), atol=tol, rtol=tol)


def test_float8_caches_stay_close_to_the_unrounded_attention() -> None:
    """The price of an 8-bit cache on random unit-variance K/V: outputs move, by at most a few tenths (e5m2, two
    mantissa bits, more than e4m3), never by the whole output's scale."""
    q, k, v, cache, common = _mixed_step(9, 3, 64, 16, torch.bfloat16, seed=3)
    backend = CpuPagedBackend()
    exact = backend.forward(q, k, v, cache.clone(), backend.build(common), 0.125).double()
    errors = {}
    for kv_dtype in FP8:
        rounded = backend.forward(q, k, v, quantize_kv(cache, kv_dtype), backend.build(common), 0.125).double()
        errors[kv_dtype] = (rounded - exact).abs().mean().item()
        assert 0 < errors[kv_dtype] < 0.05 and (rounded - exact).abs().max().item() < 0.6
    assert errors[torch.float8_e4m3fn] < errors[torch.float8_e5m2]


def test_paged_kernel_refuses_mixed_cache_dtypes() -> None:
    q, k, v, cache, common = _random_step([1], [5], 2, 1, 16, 4, torch.bfloat16, seed=1)
    md = build_metadata(common)
    with pytest.raises(ValueError, match="float8"):
        load_kernel().attention(q, quantize_kv(cache[0], torch.float8_e4m3fn), cache[1], md, 0.25)
    with pytest.raises(ValueError, match="float8"):
        load_kernel().attention(q, cache[0].half(), cache[1].half(), md, 0.25)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (16, 1, 64)])
def test_bfloat16_flash_tiles_agree_with_the_token_walk(heads, kv_heads, head_dim) -> None:
    """The two bfloat16 paths (flash tiles for multi-token rows, the walk for single tokens) agree on every row."""
    q, k, v, cache, common = _mixed_step(heads, kv_heads, head_dim, 16, torch.bfloat16, seed=11)
    kernel, md = load_kernel(), build_metadata(common)
    CpuPagedBackend().forward(q, k, v, cache, md, 0.125)  # writes the step's K/V
    flash = kernel.attention(q, cache[0], cache[1], md, 0.125, flash_min_tokens=2)
    walk = kernel.attention(q, cache[0], cache[1], md, 0.125, flash_min_tokens=1 << 30)
    torch.testing.assert_close(flash.float(), walk.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(flash.double(), _dense(q, cache, common, 0.125), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (16, 1, 64, 16),
                                                              (14, 2, 64, 16), (9, 3, 64, 4)])
def test_flash_tiles_on_amx_agree_with_avx512(heads, kv_heads, head_dim, block_size) -> None:
    """On CPUs with AMX-BF16 the flash tiles' products run on AMX tiles: every row (prompts, chunks after cached
    context, chains, trees; tiles of 6 to 48 query vectors, key tiles cut by small blocks) agrees with the AVX-512
    BF16 tiles and the dense float64 attention."""
    q, k, v, cache, common = _mixed_step(heads, kv_heads, head_dim, block_size, torch.bfloat16, seed=5)
    kernel, md = load_kernel(), build_metadata(common)
    default = kernel.use_amx()
    if not kernel.use_amx(True):
        pytest.skip("this CPU has no AMX-BF16")
    try:
        CpuPagedBackend().forward(q, k, v, cache, md, 0.125)  # writes the step's K/V
        amx = kernel.attention(q, cache[0], cache[1], md, 0.125)
        kernel.use_amx(False)
        avx = kernel.attention(q, cache[0], cache[1], md, 0.125)
    finally:
        kernel.use_amx(default)
    assert not torch.equal(amx, avx)  # two paths ran (their float32 sums differ in order)
    torch.testing.assert_close(amx.float(), avx.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(amx.double(), _dense(q, cache, common, 0.125), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("setting", ["0", "1"])
def test_flash_tiles_follow_the_environment(setting: str) -> None:
    """``PAGELLM_ATTENTION_AMX=0`` keeps the flash tiles on AVX-512 BF16; by default they take AMX wherever the CPU
    has it."""
    from pagellm.ops.build import cpu_flags

    probe = "from pagellm.attention.cpu_paged import load_kernel; print(load_kernel().use_amx())"
    env = {**os.environ, "PAGELLM_ATTENTION_AMX": setting}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(setting == "1" and "amx_bf16" in cpu_flags().split())


def test_float32_tokens_are_bitwise_independent_of_their_row() -> None:
    """float32: a token's output is the same bits whether it is computed in a whole prompt, in a chunk after a
    prefix hit, as a decode, or next to other requests (prefix-cache hits reproduce misses bit for bit)."""
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    q, k, v, cache, common = _random_step([70], [70], heads, kv_heads, head_dim, bs, torch.float32, seed=21)
    backend = CpuPagedBackend()
    whole = backend.forward(q, k, v, cache, backend.build(common), 0.125)  # the miss: all 70 tokens at once
    table = common.block_table
    variants = {  # rows as (first token, count); context is everything before each row's last token
        "chunk after a 48-token hit": [(48, 22)],
        "three chunks side by side": [(0, 16), (16, 33), (49, 21)],
        "decodes": [(p, 1) for p in (0, 15, 16, 47, 69)],
        "a mixed step": [(60, 10), (20, 1), (0, 20)],
    }
    for name, rows in variants.items():
        tokens = np.concatenate([np.arange(first, first + n) for first, n in rows])
        qsl = np.concatenate([[0], np.cumsum([n for _, n in rows])]).astype(np.int64)
        step = CommonAttentionInputs(qsl, np.array([first + n for first, n in rows], dtype=np.int64),
                                     np.repeat(table, len(rows), axis=0), common.slot_mapping[tokens], bs)
        idx = torch.from_numpy(tokens)
        got = backend.forward(q[idx], k[idx], v[idx], cache, backend.build(step), 0.125)
        assert torch.equal(got, whole[idx]), name


def test_tree_metadata_packs_each_rows_mask() -> None:
    parents = static_tree([2, 2])  # 6 nodes + root
    q_lens, ctx_lens = [1, 7, 4], [9, 20, 4]
    _, _, _, _, common = _random_step(q_lens, ctx_lens, 2, 1, 16, 4, torch.float32, seed=1)
    mask = row_mask(7, parents)
    md = build_metadata(dataclasses.replace(common, tree_masks={1: mask}))
    # Tree tokens see the cached context (13 keys) and their own mask bits; other rows are causal, no bits.
    assert md.ctx_end.tolist() == [9, *[13] * 7, 1, 2, 3, 4]
    bits = md.tree_bits[:, 0].tolist()
    assert bits[0] == 0 and bits[8:] == [0] * 4
    assert bits[1:8] == [sum(1 << j for j in range(7) if mask[i, j]) for i in range(7)]
