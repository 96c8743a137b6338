"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its token ids and its extra keys (for example a cache salt), so two
blocks hash equal only when the whole prefix up to and including them is equal. SHA-256 keeps collisions (and
cache-poisoning through crafted prompts) out of reach; the digest is truncated to 16 bytes.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import msgspec

from pagellm.request import BlockHash

_encoder = msgspec.msgpack.Encoder()


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    payload = _encoder.encode((parent, token_ids, extra_keys))
    return BlockHash(hashlib.sha256(payload).digest()[:16])


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra_keys: tuple | None = None
) -> None:
    """Append the hashes of every block of ``token_ids`` that became full since ``hashes`` was last extended."""
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[index - 1] if index else None
        start = index * block_size
        hashes.append(hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys))
