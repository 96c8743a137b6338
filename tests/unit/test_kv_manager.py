"""Exact tests of KVCacheManager: prefix hits, slot allocation, caching and freeing (no model, no torch)."""

from __future__ import annotations

import random

import pytest

from pagellm.kv.hashing import extend_block_hashes
from pagellm.kv.manager import RELEASED, KVCacheManager, cdiv
from pagellm.request import BlockHash, Request
from pagellm.sampling_params import SamplingParams

BS = 16


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def prefill(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> list[int]:
    """Look up hits, allocate the rest of the prompt (or ``num_tokens``); return block ids."""
    hits, num_hit = kv.get_computed_blocks(request)
    num_new = (request.num_tokens - num_hit) if num_tokens is None else num_tokens
    assert kv.allocate_slots(request, 0, num_new, hits) is not None
    return kv.block_ids(request.request_id)


PROMPT = list(range(1000, 1040))   # 40 tokens: blocks [0:16] [16:32] [32:40]


def test_cdiv():
    assert [cdiv(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_first_request_gets_blocks_in_id_order_and_full_blocks_are_cached():
    kv = KVCacheManager(10, BS)
    a = req("a", PROMPT)
    assert kv.get_computed_blocks(a) == ([], 0)
    new = kv.allocate_slots(a, 0, 40)
    assert ids(new) == [0, 1, 2]
    assert kv.block_ids("a") == [0, 1, 2]
    blocks = kv.pool.blocks
    assert blocks[0].block_hash == a.block_hashes[0]
    assert blocks[1].block_hash == a.block_hashes[1]
    assert blocks[2].block_hash is None           # 8 tokens: not full, not cached
    assert len(a.block_hashes) == 2
    assert kv.num_free_blocks == 7
    assert kv.usage == pytest.approx(0.3)


@pytest.mark.parametrize(
    "tokens, expected_hit_blocks",
    [
        (PROMPT[:20] + [7] * 10, 1),    # 20 shared tokens → only the whole first block hits
        (PROMPT[:15] + [7] * 20, 0),    # shared prefix shorter than one block
        (PROMPT[:32], 1),               # exactly two cached blocks: the last token must still be computed
        (PROMPT[:33], 2),               # two blocks + 1 token: both blocks hit
        (PROMPT, 2),                    # the same prompt: its third block was never full
        ([7] + PROMPT[1:], 0),          # first token differs → the chain breaks at block 0
        (PROMPT[:16] + [7] + PROMPT[17:], 1),  # a difference in block 1 keeps block 0
    ],
)
def test_prefix_hit_lengths(tokens, expected_hit_blocks):
    kv = KVCacheManager(10, BS)
    prefill(kv, req("a", PROMPT))
    hits, num_hit = kv.get_computed_blocks(req("b", tokens))
    assert ids(hits) == list(range(expected_hit_blocks))
    assert num_hit == expected_hit_blocks * BS


def test_hit_is_shared_and_ref_counted_while_the_first_request_runs():
    kv = KVCacheManager(10, BS)
    a = req("a", PROMPT)
    prefill(kv, a)
    b = req("b", PROMPT[:33] + [5, 5])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32
    new = kv.allocate_slots(b, 0, b.num_tokens - num_hit, hits)
    assert ids(new) == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert kv.num_free_blocks == 6
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert ids(kv.pool.free_queue) == [4, 5, 6, 7, 8, 9, 2]
    kv.free(b)
    assert ids(kv.pool.free_queue) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert kv.num_free_blocks == 10


def test_free_returns_blocks_tail_first_and_they_stay_findable():
    kv = KVCacheManager(10, BS)
    a = req("a", PROMPT)
    prefill(kv, a)
    kv.free(a)
    assert kv.block_ids("a") == []
    assert ids(kv.pool.free_queue) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert kv.num_free_blocks == 10
    # The same prompt comes back: both cached blocks hit although free, and come out of the free list.
    again = req("again", PROMPT)
    hits, num_hit = kv.get_computed_blocks(again)
    assert (ids(hits), num_hit) == ([0, 1], 32)
    new = kv.allocate_slots(again, 0, 8, hits)
    assert ids(new) == [3]
    assert kv.block_ids("again") == [0, 1, 3]
    assert ids(kv.pool.free_queue) == [4, 5, 6, 7, 8, 9, 2]
    assert kv.pool.num_evictions == 0


def test_eviction_order_follows_the_free_list():
    kv = KVCacheManager(4, BS)
    a = req("a", PROMPT)
    prefill(kv, a)                       # blocks 0, 1 (cached), 2 (partial)
    kv.free(a)
    assert ids(kv.pool.free_queue) == [3, 2, 1, 0]
    c = req("c", list(range(2000, 2032)))
    assert prefill(kv, c) == [3, 2]      # the uncached blocks go first: nothing evicted
    assert kv.pool.num_evictions == 0
    d = req("d", list(range(3000, 3010)))
    assert prefill(kv, d) == [1]         # a's second block is evicted before its first
    assert kv.pool.num_evictions == 1
    hits, num_hit = kv.get_computed_blocks(req("a2", PROMPT))
    assert (ids(hits), num_hit) == ([0], 16)


def test_cache_salt_separates_caches():
    kv = KVCacheManager(10, BS)
    prefill(kv, req("a", PROMPT, salt="alice"))
    assert kv.get_computed_blocks(req("b", PROMPT))[1] == 0
    assert kv.get_computed_blocks(req("c", PROMPT, salt="bob"))[1] == 0
    hits, num_hit = kv.get_computed_blocks(req("d", PROMPT, salt="alice"))
    assert (ids(hits), num_hit) == ([0, 1], 32)
    expected: list[BlockHash] = []
    extend_block_hashes(expected, PROMPT, BS, ("alice",))
    assert kv.pool.blocks[0].block_hash == expected[0]


def test_prefix_caching_disabled_never_hits_nor_hashes():
    kv = KVCacheManager(10, BS, enable_caching=False)
    a = req("a", PROMPT)
    assert prefill(kv, a) == [0, 1, 2]
    assert kv.get_computed_blocks(req("b", PROMPT)) == ([], 0)
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.pool.cached == {}
    kv.free(a)
    assert kv.get_computed_blocks(req("c", PROMPT)) == ([], 0)


def test_allocation_failure_has_no_side_effects():
    kv = KVCacheManager(4, BS)
    prefill(kv, req("a", PROMPT))        # 3 of 4 blocks
    b = req("b", list(range(2000, 2040)))
    before = (ids(kv.pool.free_queue), [blk.ref_cnt for blk in kv.pool.blocks])
    assert kv.allocate_slots(b, 0, 40) is None
    assert kv.block_ids("b") == [] and "b" not in kv.req_blocks
    assert (ids(kv.pool.free_queue), [blk.ref_cnt for blk in kv.pool.blocks]) == before
    assert kv.allocate_slots(b, 0, 16) is not None   # one block does fit
    assert kv.block_ids("b") == [3]


def test_running_request_keeps_its_blocks_when_growth_fails():
    kv = KVCacheManager(3, BS)
    a = req("a", PROMPT[:32])
    prefill(kv, a)                        # blocks 0, 1
    assert kv.allocate_slots(a, 32, 17) is None   # would need 2 more blocks, only 1 free
    assert kv.block_ids("a") == [0, 1]
    assert ids(kv.pool.free_queue) == [2]


def test_free_cached_hits_are_not_double_counted_as_free_space():
    kv = KVCacheManager(4, BS)
    a = req("a", list(range(48)))
    prefill(kv, a)                        # 3 full blocks, all cached
    kv.free(a)
    assert ids(kv.pool.free_queue) == [3, 2, 1, 0]
    # 48 cached tokens + 17 more: 3 hits (free) + 2 new blocks > 4 blocks in total.
    too_big = req("too_big", list(range(48)) + [9] * 17)
    hits, num_hit = kv.get_computed_blocks(too_big)
    assert (ids(hits), num_hit) == ([0, 1, 2], 48)
    assert kv.allocate_slots(too_big, 0, 17, hits) is None
    assert ids(kv.pool.free_queue) == [3, 2, 1, 0]
    assert [b.ref_cnt for b in kv.pool.blocks] == [0, 0, 0, 0]
    assert "too_big" not in kv.req_blocks
    assert len(kv.pool.cached) == 3 and kv.pool.num_evictions == 0
    # 48 cached + 16 more: 3 hits + 1 new block fit exactly.
    fits = req("fits", list(range(48)) + [9] * 16)
    hits, num_hit = kv.get_computed_blocks(fits)
    assert ids(kv.allocate_slots(fits, 0, 16, hits)) == [3]
    assert kv.block_ids("fits") == [0, 1, 2, 3]
    assert kv.num_free_blocks == 0


def test_lookahead_slots_reserve_extra_blocks():
    kv = KVCacheManager(10, BS)
    a = req("a", PROMPT[:16])
    assert ids(kv.allocate_slots(a, 0, 16)) == [0]
    b = req("b", list(range(2000, 2016)))
    assert ids(kv.allocate_slots(b, 0, 16, num_lookahead_tokens=3)) == [1, 2]
    assert kv.pool.blocks[1].block_hash is not None   # the 16 prompt tokens are final
    assert kv.pool.blocks[2].block_hash is None       # lookahead slots are not


def test_chunks_cache_blocks_as_they_fill():
    kv = KVCacheManager(10, BS)
    a = req("a", PROMPT)
    assert ids(kv.allocate_slots(a, 0, 20)) == [0, 1]
    assert kv.pool.blocks[0].block_hash == a.block_hashes[0]
    assert kv.pool.blocks[1].block_hash is None       # only 4 of its 16 tokens are computed
    assert ids(kv.allocate_slots(a, 20, 20)) == [2]
    assert kv.pool.blocks[1].block_hash == a.block_hashes[1]
    assert kv.pool.blocks[2].block_hash is None
    assert kv.num_cached_blocks["a"] == 2


def test_draft_tokens_are_never_cached():
    kv = KVCacheManager(10, BS)
    a = req("a", PROMPT[:15])
    prefill(kv, a)                                    # block 0 holds 15 tokens
    a.append_output_token(1)                          # 16 final tokens; the last is not computed yet
    a.spec_token_ids = [2, 3, 4, 5, 6]
    assert ids(kv.allocate_slots(a, 15, 1 + 5)) == [1]    # 15 + 6 = 21 slots → 2 blocks
    assert kv.pool.blocks[0].block_hash == a.block_hashes[0]
    assert kv.pool.blocks[1].block_hash is None       # holds only drafts
    assert len(a.block_hashes) == 1


def test_output_tokens_extend_the_cache():
    kv = KVCacheManager(10, BS)
    a = req("a", PROMPT[:15])
    prefill(kv, a)
    a.append_output_token(77)
    assert kv.allocate_slots(a, 15, 1) == []
    assert kv.pool.blocks[0].block_hash is not None
    hits, num_hit = kv.get_computed_blocks(req("b", PROMPT[:15] + [77, 5]))
    assert (ids(hits), num_hit) == ([0], 16)


def test_reset_prefix_cache():
    kv = KVCacheManager(4, BS)
    a = req("a", PROMPT)
    prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(req("b", PROMPT)) == ([], 0)


def test_allocate_running_equals_allocate_slots_one_by_one():
    """The scheduler's one-call form serves requests exactly as allocate_slots would one at a time (block ids,
    registered blocks, slots, next-full counts), and stops before the first one the pool cannot serve."""
    rng = random.Random(0)
    prefix = [rng.randrange(20) for _ in range(12)]
    for _ in range(30):
        fast, plain = KVCacheManager(14, 4), KVCacheManager(14, 4)
        prompts = [prefix[:rng.randint(0, 12)] + [rng.randrange(20) for _ in range(rng.randint(1, 9))]
                   for _ in range(4)]
        mine = {kv: [req(f"r{i}", p) for i, p in enumerate(prompts)] for kv in (fast, plain)}
        for kv in (fast, plain):   # admitted: each holds its first block
            for r in mine[kv]:
                assert kv.allocate_slots(r, 0, 1) is not None
        computed = [1] * len(prompts)
        for _ in range(6):
            order = sorted(rng.sample(range(len(prompts)), rng.randint(1, len(prompts))))
            num_new = {i: rng.randint(1, 6) for i in order}
            look = {i: rng.choice([0, 0, 3]) for i in order}
            for kv in (fast, plain):   # tokens the runner sampled since the last round
                for i in order:
                    r = mine[kv][i]
                    while r.num_tokens < computed[i] + 1:
                        r.append_output_token(7)
            rooms = [computed[i] + num_new[i] + look[i] for i in order]
            finals = [min(computed[i] + num_new[i], mine[fast][i].num_tokens) for i in order]
            fast_ids: dict[str, list[int]] = {}
            before = [fast.slots_and_next_full(f"r{i}") for i in order]
            num_served = fast.allocate_running([mine[fast][i] for i in order], rooms, finals, fast_ids)
            plain_ids, served = {}, 0
            for i in order:
                blocks = plain.allocate_slots(mine[plain][i], computed[i], num_new[i], None, look[i])
                if blocks is None:
                    break
                if blocks:
                    plain_ids[f"r{i}"] = ids(blocks)
                # the rule the scheduler updates its columns by (allocate_running's contract)
                slots, next_full = before[served]
                room, final = rooms[served], finals[served]
                expected = (max(slots, -(-room // 4) * 4), (final // 4 + 1) * 4 if final >= next_full else next_full)
                assert expected == plain.slots_and_next_full(f"r{i}") == fast.slots_and_next_full(f"r{i}")
                served += 1
            assert num_served == served and fast_ids == plain_ids
            assert {r: ids(b) for r, b in fast.req_blocks.items()} == {r: ids(b) for r, b in plain.req_blocks.items()}
            assert {h: b.block_id for h, b in fast.pool.cached.items()} == \
                {h: b.block_id for h, b in plain.pool.cached.items()}
            assert fast.num_cached_blocks == plain.num_cached_blocks
            for i in order[:served]:
                computed[i] += num_new[i]


def _decode(kv: KVCacheManager, request: Request, computed: int, steps: int) -> int:
    """Append ``steps`` decoded tokens one step at a time (as the scheduler's running path does); returns the new
    computed count."""
    for _ in range(steps):
        request.append_output_token(7)
        room = computed + 1
        if -(-room // BS) > len(kv.req_blocks[request.request_id]):
            assert kv.allocate_running([request], [room], [room], {}, [computed]) == 1
        else:
            kv.cache_full_blocks(request, room)
        computed += 1
    return computed


def test_a_sliding_window_releases_the_blocks_behind_it():
    """Window 20, blocks of 16: a token at position p sees keys from p - 19 on, so once the request has computed
    c tokens its blocks before block (c - 19) // 16 go back to the pool, cached (findable), oldest first (a window's
    hit needs a prefix's last blocks, so the earliest are the first to evict)."""
    kv = KVCacheManager(12, BS, sliding_window=20)
    a = req("a", list(range(100, 180)))  # 80 tokens: 5 blocks
    assert prefill(kv, a, 80) == [0, 1, 2, 3, 4]
    computed = _decode(kv, a, 80, 1)  # block 5 opened for token 80: blocks before (80 - 19) // 16 = 3 released
    assert kv.block_ids("a") == [0, 0, 0, 3, 4, 5] and kv.num_released["a"] == 3
    assert kv.num_free_blocks == 12 - 3
    assert [b.block_id for b in kv.pool.free_queue][-3:] == [0, 1, 2]  # released oldest first, still cached
    assert all(kv.pool.blocks[i].block_hash == a.block_hashes[i] for i in range(3))
    computed = _decode(kv, a, computed, 32)  # two more blocks opened: the window has moved two blocks on
    held = [b for b in kv.req_blocks["a"] if b.ref_cnt]
    assert len(kv.req_blocks["a"]) == 8 and len(held) == 3 and kv.num_released["a"] == 5
    # a second request with the same prefix hits 64 tokens, of which it needs blocks 2 and 3 (keys 45.. on)
    b = req("b", list(range(100, 180)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits[:2] == [RELEASED] * 2 and ids(hits[2:]) == [2, 3] and num_hit == 64
    kv.free(a)
    assert kv.num_free_blocks == 12 and "a" not in kv.num_released


def test_hits_behind_the_window_go_straight_back():
    kv = KVCacheManager(12, BS, sliding_window=20)
    a = req("a", list(range(100, 180)))
    prefill(kv, a, 80)
    kv.free(a)
    b = req("b", list(range(100, 180)) + [1, 2])  # 82 tokens: 5 full blocks hit
    assert prefill(kv, b) == [0, 0, 0, 3, 4, 5]  # hits before (80 - 19) // 16 = 3 are released at once
    assert kv.num_free_blocks == 12 - 3
    kv.free(b)
    assert kv.num_free_blocks == 12


def test_without_a_window_nothing_is_released():
    kv = KVCacheManager(12, BS)
    a = req("a", list(range(100, 180)))
    prefill(kv, a, 80)
    _decode(kv, a, 80, 40)
    assert kv.block_ids("a") == list(range(8)) and kv.num_free_blocks == 4 and not kv.num_released


def test_a_window_hit_needs_only_the_blocks_the_window_sees():
    """Under a window of 20 a prefix hit of 80 tokens needs only blocks 3 and 4 (the next token, at 80, sees keys
    61..80): a request decoding past its prompt releases and then reuses the prompt's first block, evicting it, and
    a second request with the same prompt still hits all 80 tokens, the first three blocks as RELEASED."""
    kv = KVCacheManager(8, BS, sliding_window=20)
    prompt = list(range(100, 180))
    a = req("a", prompt)
    prefill(kv, a, 80)
    _decode(kv, a, 80, 64)  # opens blocks at 80, 96, 112 and 128: the last reuses released prompt block 0
    assert kv.pool.cached.get(a.block_hashes[0]) is None  # a plain prefix hit would find nothing
    kv.free(a)
    b = req("b", prompt + [1, 2])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 80 and hits[:3] == [RELEASED] * 3
    assert hits[3:] == [kv.pool.cached[a.block_hashes[3]], kv.pool.cached[a.block_hashes[4]]]
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, 0, 2, hits) is not None
    assert kv.block_ids("b")[:3] == [0, 0, 0] and kv.num_released["b"] == 3
    assert kv.num_free_blocks == free_before - 3  # the two hits and one new block, nothing for the released ones
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_without_a_window_the_same_eviction_breaks_the_hit():
    kv = KVCacheManager(8, BS)
    prompt = list(range(100, 180))
    a = req("a", prompt)
    prefill(kv, a, 40)
    kv.free(a)
    kv.pool.get_new_blocks(kv.num_free_blocks)  # every cached block reused: nothing to hit
    b = req("b", prompt + [1, 2])
    assert kv.get_computed_blocks(b) == ([], 0)
