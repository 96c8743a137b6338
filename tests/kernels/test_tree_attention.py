"""Draft-tree attention (speculative decoding) against dense masked attention, tree shapes and KV compaction."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagellm.attention.cpu_paged import CpuPagedBackend
from pagellm.attention.torch_ref import TorchRefBackend
from pagellm.spec.tree import ancestor_mask, child_rank, compact_kv, depths, row_mask, static_tree
from tests.kernels.test_cpu_paged import _random_step

HEADS, KV_HEADS, HEAD_DIM, BS = 4, 2, 16, 8


def test_static_tree_shape_and_masks() -> None:
    parents = static_tree([2, 2])
    assert parents == [-1, -1, 0, 0, 1, 1]
    assert depths(parents) == [1, 1, 2, 2, 2, 2]
    assert child_rank(parents) == [0, 1, 0, 1, 0, 1]
    mask = ancestor_mask(parents).int().tolist()
    assert mask[0] == [1, 0, 0, 0, 0, 0, 0]          # the root sees itself
    assert mask[3] == [1, 1, 0, 1, 0, 0, 0]          # node 2: root, node 0, itself
    assert mask[6] == [1, 0, 1, 0, 0, 0, 1]          # node 5: root, node 1, itself
    rows = row_mask(4, [-1, 0]).int().tolist()       # one causal token before a root with a 2-chain
    assert rows == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    with pytest.raises(ValueError):
        static_tree([2, 0])


def _dense_tree(q, cache, common, row, tree_mask, scale):
    """Float64 attention of one row: every cached context key, then the row's own keys under ``tree_mask``."""
    start, end = int(common.query_start_loc[row]), int(common.query_start_loc[row + 1])
    n, ctx = end - start, int(common.seq_lens[row])
    idx = [int(common.block_table[row, p // BS]) * BS + p % BS for p in range(ctx)]
    keys = cache[0].reshape(-1, KV_HEADS, HEAD_DIM)[idx].double().repeat_interleave(HEADS // KV_HEADS, 1)
    vals = cache[1].reshape(-1, KV_HEADS, HEAD_DIM)[idx].double().repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,thd->hqt", q[start:end].double(), keys) * scale
    allowed = torch.cat([torch.ones(n, ctx - n, dtype=torch.bool), tree_mask], dim=1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqt,thd->qhd", scores.softmax(-1), vals).reshape(n, -1)


@pytest.mark.parametrize("backend", [TorchRefBackend, CpuPagedBackend])
def test_tree_rows_match_dense_masked_attention(backend) -> None:
    parents = static_tree([3, 2])                     # 9 nodes + root
    q_lens, ctx_lens = [1, 10, 12, 5], [30, 10, 40, 21]  # a decode, a prompt, a tree row, a 1+root+3-chain row
    q, k, v, cache, common = _random_step(q_lens, ctx_lens, HEADS, KV_HEADS, HEAD_DIM, BS, torch.float32, seed=5)
    trees = {2: row_mask(12, parents), 3: row_mask(5, [-1, 0, 1])}
    common = dataclasses.replace(common, tree_masks=trees)
    impl = backend()
    written = cache.clone()
    out = impl.forward(q, k, v, written, impl.build(common), 0.25)
    for row, mask in trees.items():
        start, end = int(common.query_start_loc[row]), int(common.query_start_loc[row + 1])
        torch.testing.assert_close(out[start:end].double(), _dense_tree(q, written, common, row, mask, 0.25),
                                   atol=1e-5, rtol=1e-5)
    # The non-tree rows are untouched by the tree rows' presence.
    plain = TorchRefBackend()
    expected = plain.forward(q, k, v, cache.clone(), plain.build(dataclasses.replace(common, tree_masks=None)), 0.25)
    torch.testing.assert_close(out[:11], expected[:11], atol=1e-5, rtol=1e-5)


def test_compact_kv_moves_the_accepted_path() -> None:
    cache = torch.arange(2 * 4 * BS * 2 * 3, dtype=torch.float32).view(2, 4, BS, 2, 3)
    before = cache.clone()
    # root in slot 9; nodes 0..5 in slots 10..15; accepted path: nodes 1 then 4 → slots 10, 11
    compact_kv([cache], [11, 14], [10, 11])
    flat, old = cache.view(2, -1, 2, 3), before.view(2, -1, 2, 3)
    assert torch.equal(flat[:, 10], old[:, 11]) and torch.equal(flat[:, 11], old[:, 14])
    untouched = [s for s in range(4 * BS) if s not in (10, 11)]
    assert torch.equal(flat[:, untouched], old[:, untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chain_shaped_tree_attends_exactly_like_the_chain(dtype) -> None:
    """A tree whose nodes each have one child is a chain: through cpu_paged its rows must equal the causal rows of
    the same tokens bit for bit (both kernels see the same keys in the same tiles; only the mask's form differs)."""
    q_lens, ctx_lens = [1, 6, 6, 40], [30, 21, 47, 70]  # a decode, two 1 + 5 chains (one across blocks), a chunk
    q, k, v, cache, common = _random_step(q_lens, ctx_lens, HEADS, KV_HEADS, HEAD_DIM, BS, dtype, seed=9)
    chain = static_tree([1, 1, 1, 1, 1])
    impl = CpuPagedBackend()
    causal = impl.forward(q, k, v, cache.clone(), impl.build(common), 0.25)
    as_tree = dataclasses.replace(common, tree_masks={1: row_mask(6, chain), 2: row_mask(6, chain)})
    tree = impl.forward(q, k, v, cache.clone(), impl.build(as_tree), 0.25)
    assert torch.equal(tree, causal)
