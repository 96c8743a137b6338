"""Paged attention in plain PyTorch: the reference backend and the oracle for every faster kernel.

K/V of the step's tokens are written into the paged cache first; attention then always reads K/V back from the
cache through the block table, so prefix hits, chunked prefill and decode are one code path.
Rows with one query token (decodes) are batched: their blocks are gathered into a padded [B, KVH, L, D] tensor,
and grouped-query heads are folded into the query axis so one SDPA call serves them all. Rows with several query
tokens (prompt chunks, draft verification) run one SDPA call each with a causal mask offset by their cached
context (extended to the end of its image for an image token that sees its image both ways), or with the row's
draft-tree mask (speculative decoding). The split is an implementation detail of
this kernel; the scheduler and runner know nothing of it. A layer with a sliding window takes the step's masks
with the window's lower bound added (built on its first call in the step, then shared by every such layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.attention.base import CommonAttentionInputs, quantize_kv, register_backend, window_starts


@dataclass
class ChunkRow:
    start: int                  # first token of the row in the flat batch
    end: int
    block_ids: torch.Tensor     # blocks covering the row's context
    seq_len: int
    mask: torch.Tensor | None   # [n, seq_len] bool; None when the row has no cached context (plain causal)


@dataclass
class TorchRefMetadata:
    slot_mapping: torch.Tensor
    num_tokens: int
    decode_tokens: torch.Tensor | None        # [B] flat indices of single-token rows
    decode_block_table: torch.Tensor | None   # [B, nb]
    decode_mask: torch.Tensor | None          # [B, 1, 1, nb * block_size] bool
    chunks: list[ChunkRow]
    decode_seq_lens: torch.Tensor | None = None  # [B] context lengths of single-token rows (kernels use it)
    common: CommonAttentionInputs | None = None  # what it was built from (for the sliding-window variants)
    windows: dict[int, TorchRefMetadata] = field(default_factory=dict)  # window → the step's windowed masks

    def for_window(self, window: int | None) -> TorchRefMetadata:
        """This step's metadata for a layer attending inside ``window`` keys (None: every key)."""
        if window is None:
            return self
        if window not in self.windows:
            assert self.common is not None
            self.windows[window] = build_metadata(self.common, window)
        return self.windows[window]


def build_metadata(common: CommonAttentionInputs, window: int | None = None) -> TorchRefMetadata:
    q_lens = np.diff(common.query_start_loc)
    starts = None if window is None else torch.from_numpy(window_starts(common.token_positions(), window))
    chunks = [_chunk(common, int(r), starts) for r in np.flatnonzero(q_lens > 1)]
    return TorchRefMetadata(common.slot_mapping, int(common.query_start_loc[-1]), *decode_rows(common, window),
                            chunks, common=common)


def _chunk(common: CommonAttentionInputs, row: int, window_start: torch.Tensor | None) -> ChunkRow:
    """A multi-token row; ``window_start``: the step's [T] first visible keys under a sliding window, or None."""
    start, end = int(common.query_start_loc[row]), int(common.query_start_loc[row + 1])
    seq_len = int(common.seq_lens[row])
    nb = -(-seq_len // common.block_size)
    block_ids = torch.from_numpy(np.ascontiguousarray(common.block_table[row, :nb]))
    mask = None
    n = end - start
    tree = common.tree_masks.get(row) if common.tree_masks else None
    if tree is not None:  # the whole cached context, then the row's own ancestor-only mask
        mask = torch.cat([torch.ones(n, seq_len - n, dtype=torch.bool), tree], dim=1)
    elif seq_len != n or window_start is not None or common.visible_ends is not None:
        ends = torch.arange(seq_len - n, seq_len) + 1
        if common.visible_ends is not None:  # image tokens that see their whole image
            ends = torch.maximum(ends, torch.from_numpy(common.visible_ends[start:end]))
        mask = torch.arange(seq_len)[None, :] < ends[:, None]
    if window_start is not None:
        mask &= torch.arange(seq_len)[None, :] >= window_start[start:end, None]
    return ChunkRow(start, end, block_ids, seq_len, mask)


class TorchRefBackend:
    name = "torch_ref"

    def build(self, common: CommonAttentionInputs) -> TorchRefMetadata:
        return build_metadata(common)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TorchRefMetadata, scale: float, sliding_window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``softcap`` (Gemma 2's): each score becomes softcap * tanh(score / softcap) before the softmax; ``sinks``
        (gpt-oss's, [H]): one more logit per head in each softmax's denominator."""
        write_kv(kv_cache, k, v, metadata.slot_mapping)
        metadata = metadata.for_window(sliding_window)
        num_heads, head_dim = q.shape[1], q.shape[2]
        out = torch.empty(metadata.num_tokens, num_heads * head_dim, dtype=q.dtype)
        if metadata.decode_tokens is not None:
            out[metadata.decode_tokens] = _decode_attention(q[metadata.decode_tokens], kv_cache, metadata, scale,
                                                            softcap, sinks)
        for chunk in metadata.chunks:
            out[chunk.start:chunk.end] = chunk_attention(q[chunk.start:chunk.end], kv_cache, chunk, scale, softcap,
                                                         sinks)
        return out


def decode_rows(common: CommonAttentionInputs, window: int | None = None) -> tuple:
    """Flat token indices, block table [B, nb] and padding mask [B, 1, 1, nb * bs] of the single-token rows (the
    keys before each row's ``window`` last masked too, under a sliding window)."""
    q_lens = np.diff(common.query_start_loc)
    single = np.flatnonzero(q_lens == 1)
    if not len(single):
        return None, None, None
    lens = common.seq_lens[single]
    nb = int(-(-lens.max() // common.block_size))
    tokens = torch.from_numpy(common.query_start_loc[single])
    table = torch.from_numpy(np.ascontiguousarray(common.block_table[single, :nb]))
    span = torch.arange(nb * common.block_size)
    ends = torch.from_numpy(lens)[:, None]
    mask = span[None, :] < ends
    if window is not None:
        mask &= span[None, :] >= ends - window
    return tokens, table, mask.view(len(single), 1, 1, -1)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V rows at their slots; a float8 cache gets them rounded (``quantize_kv``)."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    if kv_cache.dtype != k.dtype:  # float8: index_copy_ has no float8 kernel, the bytes are copied as uint8
        k = quantize_kv(k, kv_cache.dtype).view(torch.uint8)
        v = quantize_kv(v, kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, nb] block ids → [B, KVH, nb * block_size, D] keys or values as ``dtype`` (a float8 cache's widened)."""
    blocks = cache[block_table].to(dtype)  # [B, nb, bs, KVH, D]
    batch, _, _, kv_heads, head_dim = blocks.shape
    return blocks.view(batch, -1, kv_heads, head_dim).transpose(1, 2)


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, md: TorchRefMetadata, scale: float,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    keys = _gather(kv_cache[0], md.decode_block_table, q.dtype)
    values = _gather(kv_cache[1], md.decode_block_table, q.dtype)
    kv_heads = keys.shape[1]
    # Query heads h = kv_head * group + g share kv_head: fold the group into the query axis.
    grouped = q.view(batch, kv_heads, num_heads // kv_heads, head_dim)
    sinks = None if sinks is None else sinks.view(kv_heads, num_heads // kv_heads, 1)
    out = _attend(grouped, keys, values, md.decode_mask, scale, softcap, sinks)
    return out.reshape(batch, num_heads * head_dim)


def chunk_attention(q: torch.Tensor, kv_cache: torch.Tensor, chunk: ChunkRow, scale: float,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    keys = _gather(kv_cache[0], chunk.block_ids[None], q.dtype)[0, :, :chunk.seq_len]
    values = _gather(kv_cache[1], chunk.block_ids[None], q.dtype)[0, :, :chunk.seq_len]
    group = num_heads // keys.shape[0]
    keys = keys.repeat_interleave(group, dim=0)
    values = values.repeat_interleave(group, dim=0)
    out = _attend(q.transpose(0, 1), keys, values, chunk.mask, scale, softcap,
                  None if sinks is None else sinks.view(num_heads, 1, 1))
    return out.transpose(0, 1).reshape(n, num_heads * head_dim)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over the keys ``mask`` (boolean; None: causal, the queries the keys' last) allows;
    with ``softcap``, each score capped as softcap * tanh(score / softcap) first (in float32, as transformers' eager
    Gemma 2 does); with ``sinks`` (broadcast to the scores' shape but their last axis), each softmax taken over the
    scores and its query head's sink, whose probability is then dropped (gpt-oss's, as transformers' eager
    attention computes it)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale)
    if mask is None:
        n, seq_len = q.shape[-2], keys.shape[-2]
        mask = torch.ones(n, seq_len, dtype=torch.bool).tril(seq_len - n)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1), values.float()).to(q.dtype)
    combined = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    probs = combined.softmax(-1)[..., :-1]
    return torch.matmul(probs, values.float()).to(q.dtype)


register_backend("torch_ref")(TorchRefBackend)
