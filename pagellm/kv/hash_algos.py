"""vLLM's block hashes (``--prefix-caching-hash-algo``), for KV-aware routers that hash prompts themselves.

A router such as llm-d's precise prefix-cache scorer computes the hashes of a prompt's blocks on its own and looks
them up in the index it builds from the engine's KV events; that works only when the engine's hashes are the ones it
computes, which are vLLM's. ``VllmBlockHasher(algo)`` computes them as vLLM 0.32 does:

- a block's hash is ``hash((parent, tuple(token_ids), extra_keys))``, ``parent`` being the previous block's hash or,
  for a first block, the root: ``hash(seed)``, the seed being ``PYTHONHASHSEED`` when set, else ``"vllm-none-hash"``
  for the SHA-256 algorithms and 32 random bytes (hex) per process for the xxHash ones (a predictable seed would let
  anyone precompute colliding blocks of a non-cryptographic hash);
- ``hash`` serialises with pickle (``sha256``, ``xxhash``) or canonical CBOR (``sha256_cbor``, ``xxhash_cbor``, the
  one other languages reproduce) and digests with SHA-256 (32 bytes) or XXH3-128 (16 bytes);
- ``extra_keys`` is None or a tuple of tagged keys: ``("lora", name, path)`` on every block of an adapter's request,
  ``("mm", digest, offset)`` on each block that holds some of an image's tokens (the image's digest and where its
  first token sits, from the block's start: vLLM's key; ``Request.image_spans``),
  ``("cache_salt", salt)`` on its first block when the caller gave a salt, ``("prompt_embeds", sha256(rows))`` on
  every block of an embeddings prompt. Where pagellm keeps a request's blocks to itself and vLLM does not (a request
  asking for prompt logprobs computes every position), its first block adds ``("pagellm", salt)``, so those blocks
  hash apart from everything a router computes.

Token prompts, with or without a LoRA adapter and a cache salt, hash as vLLM's (``tests/unit/test_hash_algos.py`` holds
vLLM's own values). pagellm's default (no algorithm given) is its own layout in ``hashing.py``, computed natively
by the scheduler's fast path; these hashes are computed in Python, so the scheduler takes its Python path with them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from typing import Any, Callable

import cbor2
import xxhash

from pagellm.request import BlockHash, Request, caller_salt

logger = logging.getLogger(__name__)

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_SEED = "vllm-none-hash"


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value: Any) -> bytes:
    return cbor2.dumps(value, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_PARTS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickled, _sha256),
    "sha256_cbor": (_cbor, _sha256),
    "xxhash": (_pickled, xxhash.xxh3_128_digest),
    "xxhash_cbor": (_cbor, xxhash.xxh3_128_digest),
}


def check_algo(algo: str | None) -> None:
    if algo is not None and algo not in _PARTS:
        raise ValueError(f"prefix_caching_hash_algo={algo!r}; use one of {', '.join(HASH_ALGOS)} (vLLM's block "
                         "hashes), or leave it unset for pagellm's own")


def root_seed(algo: str) -> str:
    """vLLM's seed of the root hash: ``PYTHONHASHSEED`` when set, else a fixed one for SHA-256 and a random one for
    xxHash."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo.startswith("xxhash"):
        logger.warning("prefix_caching_hash_algo=%s without PYTHONHASHSEED: this process roots its block hashes on a "
                       "random seed, so no router or other server reproduces them; set PYTHONHASHSEED", algo)
        return os.urandom(32).hex()
    return DEFAULT_SEED


class VllmBlockHasher:
    """The chained block hashes of ``algo``, with vLLM's extra keys (module docstring)."""

    def __init__(self, algo: str, seed: str | None = None) -> None:
        check_algo(algo)
        self.algo = algo
        self._serialise, self._digest = _PARTS[algo]
        self.root = BlockHash(self.hash(root_seed(algo) if seed is None else seed))

    def hash(self, value: Any) -> bytes:
        return self._digest(self._serialise(value))

    def block(self, parent: bytes | None, token_ids: list[int], extra_keys: tuple | None) -> BlockHash:
        return BlockHash(self.hash((parent or self.root, tuple(token_ids), extra_keys)))

    def extend(self, request: Request, block_size: int) -> None:
        """Append to ``request.block_hashes`` the hashes of its full blocks not hashed yet."""
        hashes, tokens = request.block_hashes, request.all_token_ids
        parent = hashes[-1] if hashes else None
        for index in range(len(hashes), len(tokens) // block_size):
            parent = self.block(parent, tokens[index * block_size:(index + 1) * block_size],
                                block_keys(request, index, block_size) or None)
            hashes.append(parent)

    def token_hashes(self, token_ids: list[int], block_size: int) -> list[BlockHash]:
        """The hashes of the full blocks of ``token_ids`` as a request without extra keys has them."""
        hashes: list[BlockHash] = []
        parent = None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            parent = self.block(parent, token_ids[start:start + block_size], None)
            hashes.append(parent)
        return hashes


def make_hasher(algo: str | None) -> VllmBlockHasher | None:
    """The hasher of ``prefix_caching_hash_algo``; None (pagellm's own hashes) when it is unset."""
    return VllmBlockHasher(algo) if algo is not None else None


def block_keys(request: Request, index: int, block_size: int) -> tuple:
    """The extra keys of a request's block ``index`` (module docstring), tagged: empty when it has none."""
    params = request.sampling_params
    lora = params.lora_request
    keys: tuple = (("lora", lora.lora_name, lora.lora_path),) if lora is not None else ()
    start = index * block_size
    keys += tuple(("mm", span.digest, span.start - start) for span in request.image_spans or ()
                  if start < span.end and span.start < start + block_size)
    if index == 0:
        salt = caller_salt(request.cache_salt)
        if salt is not None:
            keys += (("cache_salt", salt),)
        if params.prompt_logprobs is not None:
            keys += (("pagellm", request.cache_salt),)
    if request.prompt_embeds is not None:
        keys += (("prompt_embeds", _rows_digest(request, index, block_size)),)
    return keys


def _rows_digest(request: Request, index: int, block_size: int) -> bytes:
    """SHA-256 of the embeddings rows of block ``index`` (of none, for a block past the prompt)."""
    embeds = request.prompt_embeds
    width = len(embeds.data) // request.num_prompt_tokens  # type: ignore[union-attr]
    return hashlib.sha256(embeds.data[index * block_size * width:(index + 1) * block_size * width]).digest()

