"""Sliding-window attention (Mistral, windowed Qwen layers): the C++ paged kernel and its plain-PyTorch twin each
let a token see only the keys of its last W positions, on every path (the walks, the flash tiles, float8 caches,
the AVX2 build), against dense float64 attention."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagellm.attention.base import CommonAttentionInputs, quantize_kv
from pagellm.attention.cpu_paged import CpuPagedBackend, build_metadata, load_kernel
from pagellm.attention.torch_ref import TorchRefBackend
from pagellm.spec.tree import place_trees, row_mask, static_tree
from tests.kernels.test_cpu_paged import AVX2_BUILD, TOLERANCE, _dense, _random_step  # noqa: F401 (kernel_build's swap)

# Flash tiles (head_dim 64 and 128, bf16), the fixed and generic vector walks, one-token blocks, the scalar walk
# (head_dim 24) and key tiles cut by small blocks.
SHAPES = [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 32, 8), (8, 1, 16, 1), (4, 2, 24, 8), (8, 2, 64, 4)]
WINDOWS = [1, 7, 40]  # the token alone; inside one block or two; longer than some rows' contexts


def _windowed_step(heads, kv_heads, head_dim, block_size, dtype, seed):
    """Decodes, fresh prompts, chunks after cached context and draft trees whose nodes sit at root + depth."""
    tree = static_tree([3, 2])
    rows = [(1, 40, None), (37, 37, None), (5, 61, None), (len(tree) + 1, 30, tree), (1, 3, None),
            (70, 70, None), (22, 70, None), (3, 3, None), (5, 5 + block_size, None), (1, 120, None)]
    q, k, v, cache, common = _random_step([r[0] for r in rows], [r[1] for r in rows], heads, kv_heads, head_dim,
                                          block_size, dtype, seed)
    positions = torch.from_numpy(common.token_positions().copy())
    trees = place_trees(positions, common.query_start_loc, {i: p for i, (_, _, p) in enumerate(rows) if p})
    return q, k, v, cache, dataclasses.replace(common, tree_masks=trees, positions=positions.numpy())


def _run(backend, q, k, v, cache, common, window, scale):
    return backend.forward(q, k, v, cache, backend.build(common), scale, sliding_window=window)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_windowed_step_matches_reference_and_dense(window, dtype, heads, kv_heads, head_dim, block_size,
                                                   kernel_build) -> None:
    q, k, v, cache, common = _windowed_step(heads, kv_heads, head_dim, block_size, dtype, seed=heads + window)
    scale = head_dim ** -0.5
    ref_cache, fast_cache = cache.clone(), cache.clone()
    expected = _run(TorchRefBackend(), q, k, v, ref_cache, common, window, scale)
    got = _run(CpuPagedBackend(), q, k, v, fast_cache, common, window, scale)
    assert torch.equal(ref_cache, fast_cache)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), _dense(q, fast_cache, common, scale, window), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 2, 24, 8)])
def test_windowed_float8_caches_match_reference_and_dense(kv_dtype, heads, kv_heads, head_dim, block_size,
                                                          kernel_build) -> None:
    q, k, v, cache, common = _windowed_step(heads, kv_heads, head_dim, block_size, torch.bfloat16, seed=4)
    ref_cache, fast_cache = quantize_kv(cache, kv_dtype), quantize_kv(cache, kv_dtype)
    expected = _run(TorchRefBackend(), q, k, v, ref_cache, common, 7, 0.125)
    got = _run(CpuPagedBackend(), q, k, v, fast_cache, common, 7, 0.125)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.double(), _dense(q, fast_cache, common, 0.125, 7), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_flash_tiles_agree_with_the_token_walk(window) -> None:
    q, k, v, cache, common = _windowed_step(9, 3, 64, 16, torch.bfloat16, seed=11)
    kernel, md = load_kernel(), build_metadata(common)
    CpuPagedBackend().forward(q, k, v, cache, md, 0.125)  # writes the step's K/V
    flash = kernel.attention(q, cache[0], cache[1], md, 0.125, flash_min_tokens=2, sliding_window=window)
    walk = kernel.attention(q, cache[0], cache[1], md, 0.125, flash_min_tokens=1 << 30, sliding_window=window)
    torch.testing.assert_close(flash.float(), walk.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(flash.double(), _dense(q, cache, common, 0.125, window), atol=2e-2, rtol=2e-2)


def test_a_window_that_holds_every_key_changes_nothing() -> None:
    """A window at least as long as every context is full attention, bit for bit; a shorter one changes the rows
    whose context outgrows it, and only those."""
    q, k, v, cache, common = _windowed_step(9, 3, 64, 16, torch.float32, seed=2)
    backend = CpuPagedBackend()
    full = backend.forward(q, k, v, cache, backend.build(common), 0.125)
    assert torch.equal(_run(backend, q, k, v, cache, common, 120, 0.125), full)
    windowed = _run(backend, q, k, v, cache, common, 40, 0.125)
    outgrown = torch.from_numpy(common.token_positions() >= 40)
    assert torch.equal(windowed[~outgrown], full[~outgrown])
    assert not torch.isclose(windowed[outgrown], full[outgrown]).all(dim=-1).any()


def test_windowed_float32_tokens_are_bitwise_independent_of_their_row() -> None:
    """Under a window too, a float32 token's output is the same bits in a whole prompt, in a chunk after a prefix
    hit and as a decode (the walk starts at its window's block, whose tiles a walk from key 0 takes too)."""
    heads, kv_heads, head_dim, bs, window = 9, 3, 64, 16, 21
    q, k, v, cache, common = _random_step([70], [70], heads, kv_heads, head_dim, bs, torch.float32, seed=21)
    backend = CpuPagedBackend()
    whole = _run(backend, q, k, v, cache, common, window, 0.125)
    for rows in ([(48, 22)], [(0, 16), (16, 33), (49, 21)], [(p, 1) for p in (0, 20, 21, 47, 69)]):
        tokens = np.concatenate([np.arange(first, first + n) for first, n in rows])
        qsl = np.concatenate([[0], np.cumsum([n for _, n in rows])]).astype(np.int64)
        step = CommonAttentionInputs(qsl, np.array([first + n for first, n in rows], dtype=np.int64),
                                     np.repeat(common.block_table, len(rows), axis=0), common.slot_mapping[tokens],
                                     bs)
        idx = torch.from_numpy(tokens)
        assert torch.equal(_run(backend, q[idx], k[idx], v[idx], cache, step, window, 0.125), whole[idx]), rows


def test_window_starts_follow_each_tokens_position() -> None:
    """A tree node's window is counted from its own position (root + depth), not from its place in the row."""
    parents = static_tree([2])  # root + 2 children, both at depth 1
    _, _, _, _, common = _random_step([1, 3, 4], [9, 20, 4], 2, 1, 16, 4, torch.float32, seed=1)
    positions = torch.from_numpy(common.token_positions().copy())
    trees = place_trees(positions, common.query_start_loc, {1: parents})
    assert positions.tolist() == [8, 17, 18, 18, 0, 1, 2, 3]
    assert torch.equal(trees[1], row_mask(3, parents))
    md = build_metadata(dataclasses.replace(common, tree_masks=trees, positions=positions.numpy()))
    assert md.ctx_start(4).tolist() == [5, 14, 15, 15, 0, 0, 0, 0]
    assert md.ctx_start(None) is None
    causal = build_metadata(common)  # no positions given: each row's tokens at the end of its context
    assert causal.ctx_start(4).tolist() == [5, 14, 15, 16, 0, 0, 0, 0]
