"""KVCacheManager: which blocks each request holds, prefix-cache look-ups, and slot allocation.

Contract with the scheduler:
- ``get_computed_blocks(request)`` finds the longest run of cached full blocks that prefix the request's tokens,
  leaving at least the last token to compute (its logits are needed).
- ``allocate_slots(request, num_computed, num_new, ...)`` gives a request that has ``num_computed`` tokens in its
  blocks room for ``num_new`` more (plus lookahead slots for draft tokens), or returns ``None`` without changing
  anything when the pool cannot.
- ``free(request)`` returns every block; blocks that carry a hash stay findable until reused.
- ``allocate_running(requests, rooms, finals, ...)`` is ``allocate_slots`` for many running requests in order
  (one call per step instead of one per request), stopping before the first one the pool cannot serve.
- ``slots_and_next_full(request_id)``: the number of token slots the request's blocks hold and the token count at
  which its next not-yet-registered block becomes full. For a step whose tokens (and lookahead) fit in the slots,
  ``allocate_slots`` would allocate nothing: the scheduler skips it, calling only ``cache_full_blocks`` when the
  step's final tokens reach the second number (most steps of a decoding request need no manager call at all).
- ``hash_blocks(request)`` hashes the request's full blocks ahead of time (the scheduler calls it on arrival);
  look-ups and registration hash whatever is still missing themselves. A prompt with images keys each block by
  its salt without the images' part and the images begun before the block's end (``Request.image_spans``), so
  prompts share the blocks of their common text and common first images.
Only tokens that are final (never draft tokens) are hashed into the cache.

With ``sliding_window`` set (a model whose every layer attends to its last W positions only), a request's blocks
that lie wholly before the window of its next token are released as it moves on (when it next needs a block, and
at admission), so a long request holds about W / block_size blocks. A released block keeps its place in the
request's list as ``RELEASED`` (block id 0, never read: attention starts at the window's block) and goes back to the
pool like a freed one (oldest first): still findable by its hash until reused. A prefix hit then needs only the
blocks the next token's window sees (``get_computed_blocks``), the ones before them coming as ``RELEASED``.
"""

from __future__ import annotations

import hashlib
from typing import Callable

from pagellm.kv.block import BlockId, KVBlock
from pagellm.kv.block_pool import BlockPool
from pagellm.kv.events import KVEventRecorder
from pagellm.kv.hash_algos import VllmBlockHasher
from pagellm.kv.hashing import ROOT_HASH, embeds_block_hashes, extend_block_hashes
from pagellm.kv.residency import BlockResidency
from pagellm.request import BlockHash, Request, RequestId

NEVER = 1 << 62  # the next-full count when prefix caching is off: no block is ever registered
RELEASED = KVBlock(0)  # the place of a block released behind a sliding window (not the pool's; never read)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int = 0, events: KVEventRecorder | None = None,
                 hasher: VllmBlockHasher | None = None, residency: BlockResidency | None = None) -> None:
        self.block_size = block_size
        self.hasher = hasher  # vLLM's block hashes (kv/hash_algos.py); None: pagellm's own (kv/hashing.py)
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window  # 0: every block is kept until the request ends
        self.num_released: dict[RequestId, int] = {}  # leading blocks released behind the window
        self.pool = BlockPool(num_blocks, enable_caching, events, residency)
        self.req_blocks: dict[RequestId, list[KVBlock]] = {}
        self.num_cached_blocks: dict[RequestId, int] = {}  # leading blocks of a request registered in the cache
        # Returns a freed request's blocks to the pool as ``pool.free_blocks(reversed(blocks))`` does; the scheduler
        # sets its native twin here (sched/native.py).
        self.release_blocks: Callable[[list[KVBlock]], None] | None = None
        # ``extend_block_hashes`` for an unsalted request, ``(hashes, tokens, block_size, root) -> done``: the
        # scheduler sets its native twin here; when it answers False (a token outside int32) the Python one runs.
        self.native_hashes: Callable[[list, list[int], int, bytes], bool] | None = None

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
        self.hash_blocks(request)
        # The last token is always computed so its logits exist; so at most (num_tokens - 1) tokens can hit.
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window:
            hits, num_hit = self._window_hits(request.block_hashes[:max_blocks])
        else:
            hits, cached = [], self.pool.cached
            for block_hash in request.block_hashes[:max_blocks]:
                block = cached.get(block_hash)
                if block is None:
                    break
                hits.append(block)
            num_hit = len(hits) * self.block_size
        if self.pool.events is not None:
            self.pool.events.reused(request, num_hit // self.block_size)
        return hits, num_hit

    def _window_hits(self, hashes: list) -> tuple[list[KVBlock], int]:
        """Under a sliding window a prefix hit needs only the blocks its next token can see: the longest prefix of
        ``hashes`` whose last blocks, from the one holding the first key in the window on, are all cached (the
        hashes are chained, so those blocks stand for the whole prefix); the blocks before them come as
        ``RELEASED``."""
        cached, bs, window = self.pool.cached, self.block_size, self.sliding_window
        best, first_best, run = 0, 0, 0
        for index, block_hash in enumerate(hashes):
            run = run + 1 if block_hash in cached else 0
            end = index + 1
            first = max(end * bs - window + 1, 0) // bs  # the block of the first key position end * bs sees
            if run >= end - first:
                best, first_best = end, first
        hits = [RELEASED] * first_best + [cached[h] for h in hashes[first_best:best]]
        return hits, best * bs

    def allocate_slots(
        self,
        request: Request,
        num_computed: int,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_lookahead_tokens: int = 0,
        must_fit_tokens: int = 0,
        reserve: int = 0,
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` after the ``num_computed`` ones (and the prefix hits); None if out of
        blocks. An admission may ask that room for ``must_fit_tokens`` in all would be there too (a whole prompt, not
        its first chunk), with ``reserve`` blocks left free besides (the scheduler's watermark)."""
        rid, bs, pool = request.request_id, self.block_size, self.pool
        held = self.req_blocks.get(rid)
        if held is None:
            held = self.req_blocks[rid] = []
        num_hits = len(new_computed_blocks) if new_computed_blocks else 0
        num_computed += num_hits * bs
        if self.sliding_window and held:
            self.release_behind_window(rid, num_computed)
        num_new_blocks = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, bs) - len(held) - num_hits
        new_blocks: list[KVBlock] = []
        if num_new_blocks > 0 or num_hits:
            # Free hits are still counted in the free queue; touching them takes them out of it.
            released = new_computed_blocks.count(RELEASED) if self.sliding_window and new_computed_blocks else 0
            real_hits = new_computed_blocks[released:] if new_computed_blocks else []
            num_free_hits = [b.ref_cnt for b in real_hits].count(0)
            needed = max(num_new_blocks, cdiv(must_fit_tokens, bs) - len(held) - num_hits)
            if needed + reserve > pool.free_queue.num_free_blocks - num_free_hits:
                if not held:
                    del self.req_blocks[rid]
                return None
            if new_computed_blocks:
                pool.touch(real_hits)
                held.extend(new_computed_blocks)
                self.num_cached_blocks[rid] = num_hits  # hits are registered already: none to register again
                if released:  # a window's hit: the blocks before it are behind the window already
                    self.num_released[rid] = released
            if num_new_blocks > 0:
                new_blocks = pool.get_new_blocks(num_new_blocks)
                held.extend(new_blocks)
        if self.enable_caching:
            self.cache_full_blocks(request, min(num_computed + num_new_tokens, len(request.all_token_ids)))
        if self.sliding_window and num_hits:  # hits behind the window (a long shared prefix) go straight back
            self.release_behind_window(rid, num_computed)
        return new_blocks

    def release_behind_window(self, rid: RequestId, num_computed: int) -> None:
        """Release the request's blocks that no token from position ``num_computed`` on can see any more (every
        key of theirs lies before ``num_computed - sliding_window + 1``)."""
        held = self.req_blocks[rid]
        first = self.num_released.get(rid, 0)
        end = min(max(num_computed - self.sliding_window + 1, 0) // self.block_size, len(held))
        if end <= first:
            return
        behind = [b for b in held[first:end] if b is not RELEASED]
        held[first:end] = [RELEASED] * (end - first)
        self.num_released[rid] = end
        self.pool.free_blocks(behind)  # oldest first, so evicted first: a window's hit needs a prefix's last blocks

    def allocate_running(self, requests: list[Request], rooms: list[int], finals: list[int],
                         new_block_ids: dict[str, list[int]], computed: list[int] | None = None) -> int:
        """``allocate_slots`` for each request in order, none with prefix hits: request ``i`` needs ``rooms[i]``
        slots (computed + new + lookahead tokens) and will have ``finals[i]`` final tokens after the step. Stops
        before the first request the pool cannot serve (changing nothing for it) and returns how many it served:
        each now holds ``max(its blocks, ceil(rooms[i] / block_size))`` blocks, and if ``finals[i]`` reached its
        next-full count its blocks up to ``finals[i] // block_size`` are registered (the scheduler updates its
        columns from that rule). The ids of new blocks go into ``new_block_ids``. Under a sliding window,
        ``computed[i]`` (the tokens request ``i`` computed before the step) says which of its blocks to release
        first."""
        bs, pool, cached_counts = self.block_size, self.pool, self.num_cached_blocks
        free_queue, req_blocks, take, register = pool.free_queue, self.req_blocks, pool.get_new_block, self._register
        never = NEVER if not self.enable_caching else 0
        served = 0
        for i, (request, room, final) in enumerate(zip(requests, rooms, finals)):
            rid = request.request_id
            held = req_blocks[rid]  # a running request's list exists from its admission on
            num_new_blocks = -(-room // bs) - len(held)
            if num_new_blocks > 0:
                if computed is not None and self.sliding_window:  # what the window left behind goes back first
                    self.release_behind_window(rid, computed[i])
                if num_new_blocks > free_queue.num_free_blocks:
                    break
                if num_new_blocks == 1:  # a decoding request entering its next block: most calls
                    block = take()
                    held.append(block)
                    new_block_ids[rid] = [block.block_id]
                else:
                    blocks = pool.get_new_blocks(num_new_blocks)
                    held += blocks
                    new_block_ids[rid] = [b.block_id for b in blocks]
            served += 1
            num_cached = cached_counts.get(rid, 0)
            if final >= (num_cached + 1) * bs + never:  # a block fills (never, with prefix caching off)
                register(request, held, num_cached, final // bs)
        return served

    def slots_and_next_full(self, request_id: str) -> tuple[int, int]:
        """Token slots in the request's blocks, and the token count at which its next unregistered block fills."""
        rid = RequestId(request_id)
        slots = len(self.req_blocks.get(rid, ())) * self.block_size
        if not self.enable_caching:
            return slots, NEVER
        return slots, (self.num_cached_blocks.get(rid, 0) + 1) * self.block_size

    def free(self, request: Request) -> None:
        """Return all of a request's blocks, tail first, so its least shareable blocks are evicted first."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if self.num_released.pop(request.request_id, 0):
            blocks = [b for b in blocks if b is not RELEASED]
        if self.release_blocks is not None:
            self.release_blocks(blocks)
        else:
            self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def hash_blocks(self, request: Request) -> None:
        """Hash the request's full blocks not hashed yet (a no-op with prefix caching off). An embeddings prompt's
        full blocks are hashed by their rows (``embeds_block_hashes``), the blocks after them with its whole salt."""
        hashes, tokens = request.block_hashes, request.all_token_ids
        if self.hasher is not None:
            if self.enable_caching:
                self.hasher.extend(request, self.block_size)
            return
        if self.enable_caching and request.prompt_embeds is not None and not hashes:
            hashes.extend(self._embeds_hashes(request))
        if self.enable_caching and request.image_spans and not hashes:
            self._image_hashes(request)
        if self.enable_caching and len(tokens) >= (len(hashes) + 1) * self.block_size:
            if request.cache_salt:
                extend_block_hashes(hashes, tokens, self.block_size, (request.cache_salt,))
            elif self.native_hashes is None or not self.native_hashes(hashes, tokens, self.block_size, ROOT_HASH):
                extend_block_hashes(hashes, tokens, self.block_size)

    def _image_hashes(self, request: Request) -> None:
        """The hashes of a prompt's full blocks with images: a block is keyed by the salt before its images' part and
        the digests of the images begun before its end (so prompts share the blocks of their common text and their
        common first images, whatever images come later; none before an image differs)."""
        salt, bs, tokens = request.cache_salt or "", self.block_size, request.all_token_ids
        base = salt[:salt.rfind("images-")].rstrip("/")
        spans = request.image_spans or []
        digest = hashlib.sha256()
        for seen in range(len(spans) + 1):
            end = spans[seen].start // bs * bs if seen < len(spans) else len(tokens)
            key = f"{base}/images-{digest.hexdigest()}" if seen else base
            extend_block_hashes(request.block_hashes, tokens[:end], bs, (key,) if key else None)
            if seen < len(spans):
                digest.update(spans[seen].digest.encode())

    def _embeds_hashes(self, request: Request) -> list[BlockHash]:
        """The hashes of an embeddings prompt's full blocks. Its cache salt ends with the digest of all its rows
        (which keys the blocks after them); these take the salt before it (the caller's, an adapter's)."""
        embeds, salt = request.prompt_embeds, request.cache_salt or ""
        base = salt[:salt.rfind("embeds-")].rstrip("/") or None
        return embeds_block_hashes(embeds.data, embeds.dtype, request.num_prompt_tokens,  # type: ignore[union-attr]
                                   request.num_prompt_tokens // self.block_size, self.block_size, base)

    def cache_full_blocks(self, request: Request, num_final_tokens: int) -> int:
        """Register the request's blocks that will be full of final tokens once this step runs (prefix caching
        on), each hashed once; returns the token count at which its next unregistered block fills."""
        rid, bs = request.request_id, self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        end = num_final_tokens // bs
        if end > start:
            start = self._register(request, self.req_blocks[rid], start, end)
        return (start + 1) * bs

    def _register(self, request: Request, blocks: list[KVBlock], start: int, end: int) -> int:
        """Hash (if not done yet) and register the request's blocks ``start .. end - 1``; returns ``end``. A block
        that already carries a hash keeps it; the first block registered with a hash stays canonical."""
        hashes = request.block_hashes
        if len(hashes) < end and self.hasher is not None:
            self.hasher.extend(request, self.block_size)
        elif len(hashes) < end:
            extend_block_hashes(hashes, request.all_token_ids, self.block_size,
                                (request.cache_salt,) if request.cache_salt else None)
        if self.pool.events is not None:
            return self._register_recording(request, blocks, start, end)
        cached = self.pool.cached
        for index in range(start, end):  # ``BlockPool.cache_full_block``, inlined
            block = blocks[index]
            if block.block_hash is None and block is not RELEASED:
                block.block_hash = block_hash = hashes[index]
                if block_hash not in cached:
                    cached[block_hash] = block
        self.num_cached_blocks[request.request_id] = end
        return end

    def _register_recording(self, request: Request, blocks: list[KVBlock], start: int, end: int) -> int:
        """``_register`` with KV events on: each run of blocks that became findable is one ``BlockStored``."""
        hashes, cached, events = request.block_hashes, self.pool.cached, self.pool.events
        run_start = None
        for index in range(start, end + 1):
            block = blocks[index] if index < end else None
            stored = False
            if block is not None and block.block_hash is None and block is not RELEASED:
                block.block_hash = block_hash = hashes[index]
                if block_hash not in cached:
                    cached[block_hash] = block
                    stored = True
            if stored and run_start is None:
                run_start = index
            elif not stored and run_start is not None:
                events.stored(request, run_start, index)
                run_start = None
        self.num_cached_blocks[request.request_id] = end
        return end
