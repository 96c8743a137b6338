"""Batched attention for rows with several query tokens (prompt chunks, draft verification).

The reference backend runs one SDPA call per such row; with many short prompts per step that is thousands of
small calls per step. Here rows of similar length are grouped (the longest at most twice the shortest), padded
into one [rows, heads, q_len, D] batch with a mask that encodes each row's causal offset and length, and served
by one SDPA call per group. Padding query slots attend to key 0 only (their outputs are dropped), so no row is
ever fully masked.

Rows that start at position 0 (a whole prompt, or its first chunk: no cached context) are grouped apart: their
keys are exactly the step's own k/v, so they need neither the cache gather nor a mask, and SDPA runs its causal
kernel (``is_causal``). Padding slots sit after each row's last token, so causality alone keeps real queries from
seeing them. float32 steps keep the masked path for these rows too: then a prompt computed after a prefix-cache hit
reproduces the same prompt computed without one bit for bit (the float32 contract the API tests check).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.attention.base import CommonAttentionInputs


@dataclass
class ChunkGroup:
    token_index: torch.Tensor   # [G, Lq] flat token index of each query slot (padding repeats a valid token)
    valid: torch.Tensor         # [G, Lq] bool: slot holds a real query token
    block_table: torch.Tensor   # [G, nb]
    mask: torch.Tensor          # [G, 1, Lq, nb * block_size] bool
    fresh: bool = False         # no row has cached context: low-precision steps attend causally over the step's k/v


def group_rows(q_lens: np.ndarray, rows: np.ndarray, ratio: float = 2.0) -> list[np.ndarray]:
    """Rows sorted by query length, cut into groups whose longest row is at most ``ratio`` × the shortest."""
    ordered = rows[np.argsort(q_lens[rows], kind="stable")]
    groups: list[np.ndarray] = []
    start = 0
    for end in range(1, len(ordered) + 1):
        if end == len(ordered) or q_lens[ordered[end]] > ratio * q_lens[ordered[start]]:
            groups.append(ordered[start:end])
            start = end
    return groups


def build_group(common: CommonAttentionInputs, rows: np.ndarray, fresh: bool = False) -> ChunkGroup:
    starts = common.query_start_loc[rows]
    q_lens = common.query_start_loc[rows + 1] - starts
    seq_lens = common.seq_lens[rows]
    lq = int(q_lens.max())
    nb = int(-(-seq_lens.max() // common.block_size))
    slot = np.arange(lq)[None, :]
    valid = slot < q_lens[:, None]
    token_index = np.where(valid, starts[:, None] + slot, starts[:, None])
    positions = (seq_lens - q_lens)[:, None] + slot                       # [G, Lq]
    keys = np.arange(nb * common.block_size)[None, None, :]
    mask = (keys <= positions[:, :, None]) & (keys < seq_lens[:, None, None])
    mask = np.where(valid[:, :, None], mask, keys == 0)
    return ChunkGroup(torch.from_numpy(token_index), torch.from_numpy(valid),
                      torch.from_numpy(np.ascontiguousarray(common.block_table[rows, :nb])),
                      torch.from_numpy(mask).unsqueeze(1), fresh)


def group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, group: ChunkGroup,
                    scale: float) -> torch.Tensor:
    """Outputs [G, Lq, H * D] for one group (padding slots included; the caller keeps the valid ones)."""
    rows, lq = group.token_index.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    queries = q[group.token_index].transpose(1, 2)                        # [G, H, Lq, D]
    causal = group.fresh and q.dtype != torch.float32
    if causal:                                                            # no cached context: the step's own k/v
        keys, values = k[group.token_index].transpose(1, 2), v[group.token_index].transpose(1, 2)
    else:
        keys, values = _gather(kv_cache[0], group.block_table), _gather(kv_cache[1], group.block_table)
    repeat = num_heads // keys.shape[1]
    keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=None if causal else group.mask,
                                         scale=scale, is_causal=causal)
    return out.transpose(1, 2).reshape(rows, lq, num_heads * head_dim)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    blocks = cache[block_table]                                           # [G, nb, bs, KVH, D]
    rows, _, _, kv_heads, head_dim = blocks.shape
    return blocks.view(rows, -1, kv_heads, head_dim).transpose(1, 2)
