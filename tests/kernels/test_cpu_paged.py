"""The C++ paged decode kernel against its plain-PyTorch twin (``attention/torch_ref.py``) and dense attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagellm.attention.base import CommonAttentionInputs
from pagellm.attention.cpu_paged import CpuPagedBackend
from pagellm.attention.torch_ref import TorchRefBackend


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


def _dense_reference(q, cache, common, row_tokens, heads, kv_heads, scale):
    """Attention of one decode row computed densely from the cache, in float64."""
    row, token = row_tokens
    ctx = int(common.seq_lens[row])
    bs = common.block_size
    idx = [int(common.block_table[row, p // bs]) * bs + p % bs for p in range(ctx)]
    keys = cache[0].reshape(-1, kv_heads, q.shape[-1])[idx].double().repeat_interleave(heads // kv_heads, 1)
    vals = cache[1].reshape(-1, kv_heads, q.shape[-1])[idx].double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("hd,thd->ht", q[token].double(), keys) * scale
    return torch.einsum("ht,thd->hd", scores.softmax(-1), vals).reshape(-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
# Shapes cover the kernel's register-resident fixed shapes (head_dim 64/128), its generic vector walk (other
# multiples of 16) and block sizes that split the 16-token tiles.
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 32, 8), (8, 1, 16, 1), (12, 2, 48, 4)])
def test_decode_kernel_matches_reference(dtype, tol, heads, kv_heads, head_dim, block_size) -> None:
    ctx_lens = [1, 5, block_size, block_size + 1, 97, 3 * block_size]
    q, k, v, cache, common = _random_step([1] * len(ctx_lens), ctx_lens, heads, kv_heads, head_dim, block_size,
                                          dtype, seed=heads + block_size)
    scale = head_dim ** -0.5
    ref_cache, fast_cache = cache.clone(), cache.clone()
    ref = TorchRefBackend()
    fast = CpuPagedBackend()
    expected = ref.forward(q, k, v, ref_cache, ref.build(common), scale)
    got = fast.forward(q, k, v, fast_cache, fast.build(common), scale)
    assert torch.equal(ref_cache, fast_cache)  # both wrote the new K/V into the same slots
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    for row in range(len(ctx_lens)):  # and both agree with dense float64 attention
        dense = _dense_reference(q, fast_cache, common, (row, row), heads, kv_heads, scale)
        torch.testing.assert_close(got[row].double(), dense, atol=tol, rtol=tol)


def test_mixed_batch_uses_kernel_for_decodes_and_reference_for_chunks() -> None:
    q_lens, ctx_lens = [1, 7, 1, 20, 1], [40, 7, 3, 52, 129]
    q, k, v, cache, common = _random_step(q_lens, ctx_lens, 6, 2, 32, 16, torch.float32, seed=3)
    ref, fast = TorchRefBackend(), CpuPagedBackend()
    expected = ref.forward(q, k, v, cache.clone(), ref.build(common), 0.2)
    got = fast.forward(q, k, v, cache.clone(), fast.build(common), 0.2)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_chunk_rows_match_dense_causal_attention() -> None:
    """Reference path for multi-token rows: a prompt chunk after 20 cached tokens equals masked dense attention."""
    q, k, v, cache, common = _random_step([12], [32], 4, 2, 16, 8, torch.float32, seed=4)
    ref = TorchRefBackend()
    out = ref.forward(q, k, v, cache, ref.build(common), 0.25)
    idx = [int(common.block_table[0, p // 8]) * 8 + p % 8 for p in range(32)]
    keys = cache[0].reshape(-1, 2, 16)[idx].repeat_interleave(2, 1).transpose(0, 1)
    vals = cache[1].reshape(-1, 2, 16)[idx].repeat_interleave(2, 1).transpose(0, 1)
    mask = torch.arange(32)[None, :] <= torch.arange(20, 32)[:, None]
    dense = F.scaled_dot_product_attention(q.transpose(0, 1), keys, vals, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out, dense.transpose(0, 1).reshape(12, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_batched_chunk_groups_match_reference(dtype, tol) -> None:
    """Prompt chunks of similar and very different lengths, with and without cached context, batched by group."""
    q_lens, ctx_lens = [5, 8, 9, 16, 3, 40, 1], [5, 40, 9, 48, 3, 100, 17]
    q, k, v, cache, common = _random_step(q_lens, ctx_lens, 6, 3, 64, 16, dtype, seed=5)
    ref, fast = TorchRefBackend(), CpuPagedBackend()
    metadata = fast.build(common)
    # Rows without cached context (lengths 5, 9, 3) group apart from the others (8, 16, 40), each set cut so the
    # longest row is at most twice the shortest: {3, 5} | {9} (bf16: causal over the step's k/v) and {8, 16} | {40}.
    assert [g.token_index.shape for g in metadata.groups] == [(2, 5), (1, 9), (2, 16), (1, 40)]
    assert [g.fresh for g in metadata.groups] == [True, True, False, False]
    expected = ref.forward(q, k, v, cache.clone(), ref.build(common), 0.125)
    got = fast.forward(q, k, v, cache.clone(), metadata, 0.125)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
