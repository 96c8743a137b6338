"""KVCacheManager: which blocks each request holds, prefix-cache look-ups, and slot allocation.

Contract with the scheduler:
- ``get_computed_blocks(request)`` finds the longest run of cached full blocks that prefix the request's tokens,
  leaving at least the last token to compute (its logits are needed).
- ``allocate_slots(...)`` gives a request room for ``num_new_tokens`` more tokens (plus lookahead slots for draft
  tokens), or returns ``None`` without changing anything when the pool cannot.
- ``free(request)`` returns every block; blocks that carry a hash stay findable until reused.
- After each of these, ``request.kv_slots`` is the number of token slots the request's blocks hold and
  ``request.kv_next_full`` the token count at which its next not-yet-registered block becomes full. A step whose
  tokens (and lookahead) fit in ``kv_slots`` and whose final tokens stay below ``kv_next_full`` needs nothing from
  the manager: ``allocate_slots`` would allocate nothing and register nothing, so the scheduler skips the call.
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
        computed = new_computed_blocks or []
        held = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        needed_total = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, needed_total - len(held) - len(computed))
        # Free hits are still counted in the free queue; touching them takes them out of it.
        num_free_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            if not held:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(computed)
        held.extend(computed)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        held.extend(new_blocks)
        request.kv_slots = len(held) * self.block_size
        if self.enable_caching:
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
            request.kv_next_full = (self.num_cached_blocks.get(request.request_id, 0) + 1) * self.block_size
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

    def _cache_full_blocks(self, request: Request, num_final_tokens: int) -> None:
        """Register the request's blocks that will be full of final tokens once this step runs."""
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        end = num_final_tokens // self.block_size
        if end <= start:
            return
        self._update_hashes(request)
        blocks = self.req_blocks[rid]
        for index in range(start, end):
            self.pool.cache_full_block(blocks[index], request.block_hashes[index])
        self.num_cached_blocks[rid] = end
