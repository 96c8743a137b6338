"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its token ids and its extra keys (for example a cache salt), so two
blocks hash equal only when the whole prefix up to and including them is equal. The hashed message has a fixed
layout: the parent's 16-byte hash (a fixed root value for a first block), the block's token ids as little-endian
int32 (``struct`` refuses an id outside that range rather than wrapping it, so distinct token lists give distinct
bytes), then the msgpack encoding of the extra keys (nothing when there are none). SHA-256 keeps collisions (and
cache-poisoning through crafted prompts) out of reach; the digest is truncated to 16 bytes.

``extend_block_hashes`` packs a whole run of new blocks into bytes in one call and hashes each block from a slice
of them (a memoryview: no copy), so a prompt costs one ``struct.pack`` plus one SHA-256 per block, with no Python
object per token.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import msgspec

from pagellm.request import BlockHash

_encoder = msgspec.msgpack.Encoder()
_sha256 = hashlib.sha256
ROOT_HASH = BlockHash(hashlib.sha256(b"pagellm prefix cache: no parent").digest()[:16])


_packers: dict[int, struct.Struct] = {}  # block size → its compiled format


def _packer(num_tokens: int) -> struct.Struct:
    packer = _packers.get(num_tokens)
    if packer is None:
        packer = _packers[num_tokens] = struct.Struct(f"<{num_tokens}i")
    return packer


def _suffix(extra_keys: tuple | None) -> bytes:
    return _encoder.encode(extra_keys) if extra_keys else b""


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    payload = (parent or ROOT_HASH) + struct.pack(f"<{len(token_ids)}i", *token_ids) + _suffix(extra_keys)
    return BlockHash(hashlib.sha256(payload).digest()[:16])


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra_keys: tuple | None = None
) -> None:
    """Append the hashes of every block of ``token_ids`` that became full since ``hashes`` was last extended."""
    first, last = len(hashes), len(token_ids) // block_size
    if last <= first:
        return
    parent: bytes = hashes[-1] if hashes else ROOT_HASH
    if last == first + 1:  # one block (a decoding request filled one): no slicing, no loop, no helper call
        packer = _packers.get(block_size) or _packer(block_size)
        data = packer.pack(*token_ids[first * block_size:last * block_size])
        if extra_keys:
            data += _encoder.encode(extra_keys)
        hashes.append(_sha256(parent + data).digest()[:16])  # type: ignore[arg-type]
        return
    data = memoryview(struct.pack(f"<{(last - first) * block_size}i",
                                  *token_ids[first * block_size:last * block_size]))
    suffix, width, sha256 = _suffix(extra_keys), 4 * block_size, hashlib.sha256
    for offset in range(0, len(data), width):
        parent = sha256(parent + data[offset:offset + width] + suffix).digest()[:16]
        hashes.append(parent)  # type: ignore[arg-type]  # a BlockHash (NewType only costs a call here)


def embeds_block_hashes(data: bytes, dtype: str, num_rows: int, num_blocks: int, block_size: int,
                        salt: str | None) -> list[BlockHash]:
    """The chained hashes of the first ``num_blocks`` full blocks of an embeddings prompt (``data``: its
    ``num_rows`` rows, row-major): each over its parent, the block's placeholder ids (zeros) and the extra keys
    ("embeds", the rows' dtype, ``salt``, the digest of the block's rows). Equal leading rows under an equal salt
    share blocks; a block of rows never hashes as a block of tokens, whose extra keys are never four."""
    width = len(data) // num_rows * block_size
    zeros = [0] * block_size
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for block in range(num_blocks):
        digest = _sha256(data[block * width:(block + 1) * width]).digest()[:16]
        parent = hash_block_tokens(parent, zeros, ("embeds", dtype, salt, digest))
        hashes.append(parent)
    return hashes
