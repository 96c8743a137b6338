"""KVCacheManager: which blocks each request holds, prefix-cache look-ups, and slot allocation.

Contract with the scheduler:
- ``get_computed_blocks(request)`` finds the longest run of cached full blocks that prefix the request's tokens,
  leaving at least the last token to compute (its logits are needed).
- ``allocate_slots(...)`` gives a request room for ``num_new_tokens`` more tokens (plus lookahead slots for draft
  tokens), or returns ``None`` without changing anything when the pool cannot.
- ``free(request)`` returns every block; blocks that carry a hash stay findable until reused.
- After each of these, ``request.kv_slots`` is the number of token slots the request's blocks hold and
  ``request.kv_next_full`` the token count at which its next not-yet-registered block becomes full. For a step
  whose tokens (and lookahead) fit in ``kv_slots``, ``allocate_slots`` would allocate nothing: the scheduler skips
  it, calling only ``cache_full_blocks`` when the step's final tokens reach ``kv_next_full`` (most steps of a
  decoding request need no manager call at all).
Only tokens that are final (never draft tokens) are hashed into the cache.
"""

from __future__ import annotations

from pagellm.kv.block import BlockId, KVBlock
from pagellm.kv.block_pool import BlockPool
from pagellm.kv.hashing import extend_block_hashes
from pagellm.request import Request, RequestId

_NEVER = 1 << 62  # kv_next_full when prefix caching is off: no block is ever registered


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[RequestId, list[KVBlock]] = {}
        self.num_cached_blocks: dict[RequestId, int] = {}  # leading blocks of a request registered in the cache

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[BlockId]:
        return [b.block_id for b in self.req_blocks.get(RequestId(request_id), [])]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The cached blocks that prefix ``request`` and the number of tokens they hold."""
        if not self.enable_caching:
            return [], 0
        self._update_hashes(request)
        # The last token is always computed so its logits exist; so at most (num_tokens - 1) tokens can hit.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` after the computed ones (and the prefix hits); None if out of blocks."""
        rid, bs, pool = request.request_id, self.block_size, self.pool
        held = self.req_blocks.get(rid)
        if held is None:
            held = self.req_blocks[rid] = []
        num_hits = len(new_computed_blocks) if new_computed_blocks else 0
        num_computed = request.num_computed_tokens + num_hits * bs
        num_new_blocks = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, bs) - len(held) - num_hits
        new_blocks: list[KVBlock] = []
        if num_new_blocks > 0 or num_hits:
            # Free hits are still counted in the free queue; touching them takes them out of it.
            num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if new_computed_blocks else 0
            if num_new_blocks > pool.free_queue.num_free_blocks - num_free_hits:
                if not held:
                    del self.req_blocks[rid]
                return None
            if new_computed_blocks:
                pool.touch(new_computed_blocks)
                held.extend(new_computed_blocks)
            if num_new_blocks > 0:
                new_blocks = pool.get_new_blocks(num_new_blocks)
                held.extend(new_blocks)
        request.kv_slots = len(held) * bs
        if self.enable_caching:
            self.cache_full_blocks(request, min(num_computed + num_new_tokens, len(request.all_token_ids)))
        else:
            request.kv_next_full = _NEVER
        return new_blocks

    def free(self, request: Request) -> None:
        """Return all of a request's blocks, tail first, so its least shareable blocks are evicted first."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        request.kv_slots = request.kv_next_full = 0
        self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _update_hashes(self, request: Request) -> None:
        extra = (request.cache_salt,) if request.cache_salt else None
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, extra)

    def cache_full_blocks(self, request: Request, num_final_tokens: int) -> None:
        """Register the request's blocks that will be full of final tokens once this step runs (prefix caching
        on), each hashed once, and move ``request.kv_next_full`` past them."""
        rid, bs = request.request_id, self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        end = num_final_tokens // bs
        if end > start:
            self._update_hashes(request)
            blocks, hashes, cache = self.req_blocks[rid], request.block_hashes, self.pool.cache_full_block
            for index in range(start, end):
                cache(blocks[index], hashes[index])
            self.num_cached_blocks[rid] = start = end
        request.kv_next_full = (start + 1) * bs
