"""Exact tests of the KV free list, the block pool and block hashing (no model, no torch)."""

from __future__ import annotations

import pytest

from pagellm.kv.block import FreeBlockQueue, KVBlock
from pagellm.kv.block_pool import BlockPool
from pagellm.kv.hashing import extend_block_hashes, hash_block_tokens
from pagellm.request import BlockHash


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def check_links(queue: FreeBlockQueue) -> None:
    """Walk the list both ways: the links agree with each other and with ``num_free_blocks``."""
    forward = list(queue)
    backward = []
    block = queue._tail.prev_free
    while block is not queue._head:
        backward.append(block)
        block = block.prev_free
    assert backward[::-1] == forward
    assert len(forward) == len(queue) == queue.num_free_blocks


def H(name: str) -> BlockHash:
    return BlockHash(name.encode())


# ------------------------------------------------------------------------------------------- FreeBlockQueue
class TestFreeBlockQueue:
    def test_initial_order_is_the_given_order(self):
        blocks = [KVBlock(i) for i in range(5)]
        queue = FreeBlockQueue(blocks)
        assert ids(queue) == [0, 1, 2, 3, 4]
        assert len(queue) == 5
        check_links(queue)

    def test_popleft_takes_the_head(self):
        queue = FreeBlockQueue([KVBlock(i) for i in range(3)])
        first = queue.popleft()
        assert first.block_id == 0
        assert first.prev_free is None and first.next_free is None
        assert ids(queue) == [1, 2]
        assert queue.popleft().block_id == 1
        assert ids(queue) == [2]
        check_links(queue)

    def test_remove_from_the_middle_relinks_neighbours(self):
        blocks = [KVBlock(i) for i in range(5)]
        queue = FreeBlockQueue(blocks)
        queue.remove(blocks[2])
        assert ids(queue) == [0, 1, 3, 4]
        assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
        assert blocks[2].prev_free is None and blocks[2].next_free is None
        assert len(queue) == 4
        check_links(queue)

    def test_append_goes_to_the_tail(self):
        blocks = [KVBlock(i) for i in range(4)]
        queue = FreeBlockQueue(blocks[:2])
        queue.append(blocks[3])
        queue.append(blocks[2])
        assert ids(queue) == [0, 1, 3, 2]
        check_links(queue)

    def test_popleft_n_and_extend_equal_one_at_a_time(self):
        """The bulk forms (one relink per call) leave the list exactly as popleft / append one by one would."""
        for n in (0, 1, 3, 5):
            one, bulk = [KVBlock(i) for i in range(5)], [KVBlock(i) for i in range(5)]
            q1, q2 = FreeBlockQueue(one), FreeBlockQueue(bulk)
            taken = [q1.popleft() for _ in range(n)]
            assert ids(q2.popleft_n(n)) == ids(taken)
            assert ids(q1) == ids(q2) and len(q1) == len(q2)
            for block in reversed(taken):
                q1.append(block)
            q2.extend([bulk[i] for i in reversed(ids(taken))])
            assert ids(q1) == ids(q2)
            check_links(q1)
            check_links(q2)
        queue = FreeBlockQueue([KVBlock(0), KVBlock(1)])
        with pytest.raises(AssertionError):
            queue.extend([queue._head.next_free])   # already in the list

    def test_mixed_operations(self):
        blocks = [KVBlock(i) for i in range(6)]
        queue = FreeBlockQueue(blocks)
        assert queue.popleft() is blocks[0]
        queue.remove(blocks[3])
        queue.append(blocks[0])
        queue.remove(blocks[5])          # the last real block
        queue.append(blocks[3])
        queue.remove(blocks[1])          # the first real block
        queue.append(blocks[5])
        assert ids(queue) == [2, 4, 0, 3, 5]
        assert queue.popleft() is blocks[2]
        assert ids(queue) == [4, 0, 3, 5]
        check_links(queue)

    def test_empty_queue_raises_and_recovers(self):
        blocks = [KVBlock(i) for i in range(2)]
        queue = FreeBlockQueue(blocks)
        queue.popleft()
        queue.popleft()
        assert len(queue) == 0 and list(queue) == []
        with pytest.raises(ValueError, match="no free KV blocks"):
            queue.popleft()
        assert len(queue) == 0
        queue.append(blocks[1])
        assert ids(queue) == [1]
        check_links(queue)

    def test_empty_from_the_start(self):
        queue = FreeBlockQueue([])
        assert len(queue) == 0
        with pytest.raises(ValueError):
            queue.popleft()

    def test_double_append_and_foreign_remove_are_caught(self):
        blocks = [KVBlock(i) for i in range(3)]
        queue = FreeBlockQueue(blocks[:2])
        with pytest.raises(AssertionError):
            queue.append(blocks[0])      # already in the list
        with pytest.raises(AssertionError):
            queue.remove(blocks[2])      # never in the list
        assert ids(queue) == [0, 1]
        check_links(queue)


# ------------------------------------------------------------------------------------------------ BlockPool
class TestBlockPool:
    def test_needs_at_least_one_block(self):
        with pytest.raises(ValueError):
            BlockPool(0, enable_caching=True)

    def test_fresh_pool_hands_out_blocks_in_id_order(self):
        pool = BlockPool(8, enable_caching=True)
        taken = pool.get_new_blocks(3)
        assert ids(taken) == [0, 1, 2]
        assert [b.ref_cnt for b in taken] == [1, 1, 1]
        assert ids(pool.free_queue) == [3, 4, 5, 6, 7]
        assert pool.num_free_blocks == 5
        assert pool.usage == pytest.approx(3 / 8)
        assert ids(pool.get_new_blocks(2)) == [3, 4]

    def test_asking_for_too_many_raises_without_side_effects(self):
        pool = BlockPool(4, enable_caching=True)
        pool.get_new_blocks(3)
        with pytest.raises(ValueError, match="only 1 free"):
            pool.get_new_blocks(2)
        assert ids(pool.free_queue) == [3]
        assert pool.blocks[3].ref_cnt == 0

    def test_freed_blocks_join_the_tail_in_the_given_order(self):
        """A request frees its blocks in reverse, so its last (least shareable) block is evicted first."""
        pool = BlockPool(8, enable_caching=True)
        taken = pool.get_new_blocks(3)
        pool.free_blocks(reversed(taken))
        assert ids(pool.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]
        assert [b.ref_cnt for b in taken] == [0, 0, 0]
        assert ids(pool.get_new_blocks(5)) == [3, 4, 5, 6, 7]
        assert ids(pool.get_new_blocks(1)) == [2]
        assert ids(pool.free_queue) == [1, 0]

    def test_one_block_at_a_time_matches_the_bulk_form(self):
        """get_new_block (the decode path) takes the head, evicts what it cached, exactly as get_new_blocks(1)."""
        pools = BlockPool(4, enable_caching=True), BlockPool(4, enable_caching=True)
        for pool in pools:
            taken = pool.get_new_blocks(4)
            pool.cache_full_block(taken[2], H("h2"))
            pool.free_blocks(taken[2:])
        one, bulk = pools[0].get_new_block(), pools[1].get_new_blocks(1)[0]
        assert (one.block_id, one.ref_cnt, one.block_hash) == (2, 1, None)
        assert (bulk.block_id, bulk.ref_cnt, bulk.block_hash) == (2, 1, None)
        assert [(ids(p.free_queue), p.cached, p.num_evictions) for p in pools] == [([3], {}, 1)] * 2
        pools[0].get_new_block()
        with pytest.raises(ValueError, match="no free KV blocks"):
            pools[0].get_new_block()

    def test_ref_counts_with_sharing(self):
        pool = BlockPool(4, enable_caching=True)
        a0, a1 = pool.get_new_blocks(2)
        pool.cache_full_block(a0, H("h0"))
        pool.touch([a0])                 # a second request shares a0
        assert (a0.ref_cnt, a1.ref_cnt) == (2, 1)
        pool.free_blocks([a1, a0])       # first holder leaves
        assert (a0.ref_cnt, a1.ref_cnt) == (1, 0)
        assert ids(pool.free_queue) == [2, 3, 1]
        pool.free_blocks([a0])           # second holder leaves
        assert a0.ref_cnt == 0
        assert ids(pool.free_queue) == [2, 3, 1, 0]
        with pytest.raises(AssertionError, match="freed twice"):
            pool.free_blocks([a0])

    def test_lazy_eviction_and_eviction_count(self):
        pool = BlockPool(4, enable_caching=True)
        b0, b1 = pool.get_new_blocks(2)
        pool.cache_full_block(b0, H("h0"))
        pool.cache_full_block(b1, H("h1"))
        pool.free_blocks([b1, b0])
        assert ids(pool.free_queue) == [2, 3, 1, 0]
        # Free but still findable, hash kept.
        assert pool.get_cached_block(H("h0")) is b0 and pool.get_cached_block(H("h1")) is b1
        assert b0.block_hash == H("h0")
        # Reusing uncached blocks evicts nothing.
        assert ids(pool.get_new_blocks(2)) == [2, 3]
        assert pool.num_evictions == 0
        assert pool.get_cached_block(H("h1")) is b1
        # Reusing a cached block evicts it, and only it.
        assert pool.get_new_blocks(1) == [b1]
        assert pool.num_evictions == 1
        assert pool.get_cached_block(H("h1")) is None and b1.block_hash is None
        assert pool.get_cached_block(H("h0")) is b0
        assert pool.cached == {H("h0"): b0}

    def test_touch_pulls_a_free_cached_block_out_of_the_free_list(self):
        pool = BlockPool(4, enable_caching=True)
        (b0,) = pool.get_new_blocks(1)
        pool.cache_full_block(b0, H("h0"))
        pool.free_blocks([b0])
        assert ids(pool.free_queue) == [1, 2, 3, 0]
        hit = pool.get_cached_block(H("h0"))
        pool.touch([hit])
        assert hit is b0 and b0.ref_cnt == 1
        assert ids(pool.free_queue) == [1, 2, 3]
        assert pool.num_free_blocks == 3
        assert b0.block_hash == H("h0") and pool.num_evictions == 0
        # The touched block is no longer handed out by get_new_blocks.
        assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
        pool.free_blocks([b0])
        assert ids(pool.free_queue) == [0]

    def test_first_block_with_a_hash_stays_canonical(self):
        pool = BlockPool(4, enable_caching=True)
        b0, b1 = pool.get_new_blocks(2)
        pool.cache_full_block(b0, H("same"))
        pool.cache_full_block(b1, H("same"))   # a duplicate computed by another request
        assert pool.get_cached_block(H("same")) is b0
        assert b1.block_hash == H("same")
        pool.free_blocks([b1])
        assert ids(pool.get_new_blocks(3)) == [2, 3, 1]
        # Evicting the duplicate neither drops the canonical entry nor counts as an eviction.
        assert pool.get_cached_block(H("same")) is b0
        assert pool.num_evictions == 0 and b1.block_hash is None

    def test_caching_an_already_cached_block_is_a_no_op(self):
        pool = BlockPool(2, enable_caching=True)
        (b0,) = pool.get_new_blocks(1)
        pool.cache_full_block(b0, H("a"))
        pool.cache_full_block(b0, H("b"))
        assert b0.block_hash == H("a")
        assert pool.cached == {H("a"): b0}

    def test_reset_prefix_cache_only_when_nothing_is_in_use(self):
        pool = BlockPool(3, enable_caching=True)
        b0, b1 = pool.get_new_blocks(2)
        pool.cache_full_block(b0, H("h0"))
        pool.free_blocks([b0])
        assert pool.reset_prefix_cache() is False
        assert pool.get_cached_block(H("h0")) is b0
        pool.free_blocks([b1])
        assert pool.reset_prefix_cache() is True
        assert pool.cached == {} and b0.block_hash is None
        assert ids(pool.free_queue) == [2, 0, 1]

    def test_blocks_by_id(self):
        pool = BlockPool(4, enable_caching=True)
        assert ids(pool.blocks_by_id([3, 1])) == [3, 1]


# ------------------------------------------------------------------------------------------------- hashing
class TestHashing:
    def test_hashed_bytes_are_the_documented_layout(self):
        """parent (a fixed root for a first block) + token ids as little-endian int32 + msgpack of the extra keys:
        pinned, so that a change of the layout is a deliberate one."""
        import hashlib
        import struct

        import msgspec

        from pagellm.kv.hashing import ROOT_HASH

        first = hash_block_tokens(None, [1, 2, 3, 4])
        assert first == hashlib.sha256(ROOT_HASH + struct.pack("<4i", 1, 2, 3, 4)).digest()[:16]
        salted = hash_block_tokens(first, [5, 6, 7, 8], ("s",))
        assert salted == hashlib.sha256(first + struct.pack("<4i", 5, 6, 7, 8)
                                        + msgspec.msgpack.encode(("s",))).digest()[:16]
        chain: list[BlockHash] = []
        extend_block_hashes(chain, [1, 2, 3, 4, 5, 6, 7, 8], 4, ("s",))
        assert chain[1] == hash_block_tokens(chain[0], [5, 6, 7, 8], ("s",))

    def test_token_ids_outside_int32_are_refused_not_wrapped(self):
        import struct

        for bad in (2 ** 31, -2 ** 31 - 1, 2 ** 32 + 1):
            with pytest.raises(struct.error):
                hash_block_tokens(None, [1, bad])
            with pytest.raises(struct.error):
                extend_block_hashes([], [1, 2, 3, bad], 4)

    def test_deterministic_16_bytes(self):
        h = hash_block_tokens(None, [1, 2, 3, 4])
        assert isinstance(h, bytes) and len(h) == 16
        assert h == hash_block_tokens(None, [1, 2, 3, 4])
        assert h != hash_block_tokens(None, [1, 2, 3, 5])
        assert h != hash_block_tokens(None, [4, 3, 2, 1])

    def test_same_tokens_under_a_different_parent_hash_differently(self):
        p1 = hash_block_tokens(None, [1, 1, 1, 1])
        p2 = hash_block_tokens(None, [2, 2, 2, 2])
        assert hash_block_tokens(p1, [7, 7, 7, 7]) != hash_block_tokens(p2, [7, 7, 7, 7])
        assert hash_block_tokens(p1, [7, 7, 7, 7]) != hash_block_tokens(None, [7, 7, 7, 7])

    def test_extra_keys_change_the_hash(self):
        plain = hash_block_tokens(None, [1, 2, 3, 4])
        salted = hash_block_tokens(None, [1, 2, 3, 4], ("salt",))
        assert salted != plain
        assert salted == hash_block_tokens(None, [1, 2, 3, 4], ("salt",))
        assert salted != hash_block_tokens(None, [1, 2, 3, 4], ("other",))

    def test_only_full_blocks_are_hashed_and_the_chain_links(self):
        tokens = list(range(10))
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, tokens, 4)
        assert len(hashes) == 2   # tokens 8, 9 do not fill a block
        assert hashes[0] == hash_block_tokens(None, tokens[0:4])
        assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
        extend_block_hashes(hashes, tokens, 4)
        assert len(hashes) == 2   # nothing new became full

    def test_incremental_extension_equals_one_shot(self):
        tokens = list(range(100, 117))
        incremental: list[BlockHash] = []
        for end in range(len(tokens) + 1):
            extend_block_hashes(incremental, tokens[:end], 4, ("s",))
        one_shot: list[BlockHash] = []
        extend_block_hashes(one_shot, tokens, 4, ("s",))
        assert incremental == one_shot and len(one_shot) == 4

    def test_prefix_difference_propagates_down_the_chain(self):
        a: list[BlockHash] = []
        b: list[BlockHash] = []
        extend_block_hashes(a, [1, 2, 3, 4, 9, 9, 9, 9], 4)
        extend_block_hashes(b, [1, 2, 3, 5, 9, 9, 9, 9], 4)
        assert a[0] != b[0] and a[1] != b[1]
        c: list[BlockHash] = []
        extend_block_hashes(c, [1, 2, 3, 4, 9, 9, 9, 0], 4)
        assert a[0] == c[0] and a[1] != c[1]

    def test_salt_changes_every_block(self):
        plain: list[BlockHash] = []
        salted: list[BlockHash] = []
        extend_block_hashes(plain, list(range(8)), 4)
        extend_block_hashes(salted, list(range(8)), 4, ("x",))
        assert plain[0] != salted[0] and plain[1] != salted[1]
