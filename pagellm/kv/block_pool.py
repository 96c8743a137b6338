"""The pool of KV blocks: allocation, reference counts, the prefix-cache table and lazy eviction.

A block is in exactly one of two states: in use (``ref_cnt > 0``) or free (in the free queue). A free block may
still carry a hash: its contents stay valid and findable until the block is handed out again (lazy eviction).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from pagellm.kv.block import FreeBlockQueue, KVBlock
from pagellm.kv.events import KVEventRecorder
from pagellm.kv.residency import BlockResidency
from pagellm.request import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, events: KVEventRecorder | None = None,
                 residency: BlockResidency | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0  # cached blocks whose contents were dropped to make room
        self.events = events  # KV cache events: the table's entries as they come and go (kv/events.py)
        self.residency = residency  # sampled blocks' lifetimes (--kv-cache-metrics, kv/residency.py)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take blocks from the head of the free queue, evicting whatever they cached."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        taken = self.free_queue.popleft_n(num_blocks)
        for block in taken:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            if self.residency is not None:
                self.residency.allocated(block.block_id)
        return taken

    def get_new_block(self) -> KVBlock:
        """``get_new_blocks(1)[0]``, without the list (a decoding request takes one block at a time)."""
        block = self.free_queue.popleft()
        block_hash = block.block_hash
        if block_hash is not None:  # ``_evict``, inlined
            if self.cached.get(block_hash) is block:
                del self.cached[block_hash]
                self.num_evictions += 1
                if self.events is not None:
                    self.events.removed(block_hash)
                if self.residency is not None:
                    self.residency.evicted(block.block_id)
            block.block_hash = None
        block.ref_cnt = 1
        if self.residency is not None:
            self.residency.allocated(block.block_id)
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to blocks found in the prefix cache (pulling free ones out of the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            if self.residency is not None:
                self.residency.accessed(block.block_id)

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; those that reach zero join the free queue's tail in order."""
        freed = []
        for block in ordered_blocks:
            ref_cnt = block.ref_cnt = block.ref_cnt - 1
            if ref_cnt == 0:
                freed.append(block)
            else:
                assert ref_cnt > 0, f"{block} freed twice"
        self.free_queue.extend(freed)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a block whose contents are final. The first block with a given hash stays canonical.
        (``KVCacheManager._register`` inlines this.)"""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            self.num_evictions += 1
            if self.events is not None:
                self.events.removed(block.block_hash)
            if self.residency is not None:
                self.residency.evicted(block.block_id)
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        if self.residency is not None:
            self.residency.reset()
        return True

    def blocks_by_id(self, ids: Sequence[int]) -> list[KVBlock]:
        return [self.blocks[i] for i in ids]
