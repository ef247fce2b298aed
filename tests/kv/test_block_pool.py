import pytest

from mlxhost.kv.block_pool import Block, BlockPool, FreeBlockQueue, NoFreeBlocksError
from mlxhost.kv.hashing import hash_block

BS = 4


def ids(blocks):
    return [b.block_id for b in blocks]


def cache(pool, block, tokens):
    return pool.cache_full_block(block, hash_block(None, tokens), tokens)


# -- FreeBlockQueue -----------------------------------------------------------


def test_free_queue_fifo_and_middle_removal():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # O(1) from the middle
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert ids(q) == [1, 3, 4, 2]
    q.remove(blocks[2])  # the last one
    q.remove(blocks[1])  # the first one
    assert ids(q) == [3, 4] and len(q) == 2


def test_free_queue_rejects_misuse():
    q = FreeBlockQueue()
    with pytest.raises(IndexError):
        q.popleft()
    b = Block(0)
    with pytest.raises(ValueError):
        q.remove(b)
    q.append(b)
    with pytest.raises(ValueError):
        q.append(b)
    assert q.popleft() is b and len(q) == 0


# -- allocation and reference counts -------------------------------------------


def test_allocate_touch_free_refcounts():
    pool = BlockPool(4, BS)
    a, b = pool.allocate(2)
    assert (a.ref_count, b.ref_count) == (1, 1)
    assert pool.num_free == 2 and pool.num_used == 2 and pool.usage == 0.5
    pool.touch([a])
    assert a.ref_count == 2
    pool.free([a])
    assert a.ref_count == 1 and pool.num_free == 2
    pool.free([a, b])
    assert (a.ref_count, b.ref_count) == (0, 0) and pool.num_free == 4
    with pytest.raises(ValueError):
        pool.free([a])  # double free is a bug, not a silent no-op


def test_allocate_is_all_or_nothing():
    pool = BlockPool(3, BS)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3, BS)
    a, b, c = pool.allocate(3)
    cache(pool, a, [1, 2, 3, 4])
    pool.free([a, b, c])
    # b and c hold nothing worth keeping, so they go first and `a` stays a hit.
    assert set(ids(pool.allocate(2))) == {b.block_id, c.block_id}
    assert pool.lookup(a.block_hash, [1, 2, 3, 4]) is a


# -- LRU order and lazy eviction -----------------------------------------------


def test_lru_order_of_cached_free_blocks_and_touch_from_middle():
    pool = BlockPool(3, BS)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        cache(pool, blk, [i] * BS)
    a, b, c = blocks
    pool.free([c, b, a])  # a sequence freed tail first
    assert ids(pool.free_queue) == [c.block_id, b.block_id, a.block_id]
    pool.touch([b])  # prefix hit on a free cached block: leaves the queue in O(1)
    assert ids(pool.free_queue) == [c.block_id, a.block_id]
    assert b.ref_count == 1 and pool.num_free == 2
    pool.free([b])  # most recently used goes to the back
    assert ids(pool.free_queue) == [c.block_id, a.block_id, b.block_id]
    (reused,) = pool.allocate(1)
    assert reused is c  # least recently used is evicted first
    assert c.block_hash is None and pool.num_cached == 2


def test_lazy_eviction_keeps_freed_block_findable_until_reused():
    evicted = []
    pool = BlockPool(1, BS, on_evict=lambda h, i: evicted.append((h, i)))
    (blk,) = pool.allocate(1)
    h = cache(pool, blk, [7, 7, 7, 7]).block_hash
    pool.free([blk])
    assert pool.lookup(h, [7, 7, 7, 7]) is blk  # freed, but still a hit
    assert evicted == [] and pool.num_cached == 1
    (again,) = pool.allocate(1)
    assert again is blk
    assert pool.lookup(h, [7, 7, 7, 7]) is None
    assert evicted == [(h, blk.block_id)]
    assert pool.num_cached == 0 and pool.num_evictions == 1
    assert blk.token_ids is None


def test_lookup_rejects_hash_match_with_other_tokens():
    pool = BlockPool(2, BS)
    (blk,) = pool.allocate(1)
    h = cache(pool, blk, [1, 2, 3, 4]).block_hash
    fake = hash_block(None, [9, 9, 9, 9])
    pool.cached[fake] = blk  # simulate a collision: another key points at blk
    assert pool.lookup(fake, [9, 9, 9, 9]) is None
    assert pool.num_collisions == 1 and pool.num_misses == 1
    assert pool.lookup(h, [1, 2, 3, 4]) is blk and pool.num_hits == 1


def test_cache_full_block_dedupes_to_existing():
    pool = BlockPool(3, BS)
    a, b = pool.allocate(2)
    assert cache(pool, a, [1, 2, 3, 4]) is a
    assert cache(pool, b, [1, 2, 3, 4]) is a  # same content: existing block kept
    assert b.block_hash is None and pool.num_cached == 1
    assert cache(pool, a, [1, 2, 3, 4]) is a  # idempotent
    pool.free([b])
    assert len(pool.empty_queue) == 2 and len(pool.free_queue) == 0
    with pytest.raises(ValueError):
        cache(pool, b, [5, 6, 7, 8])  # a free block cannot be cached
    with pytest.raises(ValueError):
        pool.cache_full_block(a, b"x" * 16, [1, 2])  # not a full block


def test_cache_full_block_collision_leaves_block_uncached():
    pool = BlockPool(2, BS)
    a, b = pool.allocate(2)
    h = cache(pool, a, [1, 2, 3, 4]).block_hash
    assert pool.cache_full_block(b, h, [5, 6, 7, 8]) is b
    assert b.block_hash is None and pool.cached[h] is a and pool.num_collisions == 1


# -- copy-on-write -------------------------------------------------------------


def test_copy_on_write_only_when_shared():
    pool = BlockPool(3, BS)
    (blk,) = pool.allocate(1)
    res = pool.copy_on_write(blk)
    assert res.block is blk and not res.needs_copy and pool.num_free == 2

    pool.touch([blk])  # now shared by two owners
    res = pool.copy_on_write(blk)
    assert res.needs_copy
    assert res.src_block_id == blk.block_id and res.dst_block_id != blk.block_id
    assert blk.ref_count == 1 and res.block.ref_count == 1 and pool.num_free == 1


def test_copy_on_write_without_free_blocks_raises_and_keeps_refs():
    pool = BlockPool(1, BS)
    (blk,) = pool.allocate(1)
    pool.touch([blk])
    with pytest.raises(NoFreeBlocksError):
        pool.copy_on_write(blk)
    assert blk.ref_count == 2


# -- cap enforcement and reset -------------------------------------------------


def test_evict_unreferenced_drops_lru_free_cached_blocks_only():
    evicted = []
    pool = BlockPool(4, BS, on_evict=lambda h, i: evicted.append(i))
    blocks = pool.allocate(4)
    for i, blk in enumerate(blocks):
        cache(pool, blk, [i] * BS)
    a, b, c, d = blocks
    pool.free([c, a, b])  # d stays in use
    assert pool.num_cached == 4
    # Cap of 2 cached blocks: drop 2, least recently used first.
    assert pool.evict_unreferenced(pool.num_cached - 2) == 2
    assert evicted == [c.block_id, a.block_id]
    assert pool.num_cached == 2 and set(pool.cached.values()) == {b, d}
    assert pool.num_evictions == 2
    # Only free cached blocks can go; d is referenced.
    assert pool.evict_unreferenced(10) == 1
    assert set(pool.cached.values()) == {d} and d.block_hash is not None
    assert pool.num_free == 3 and len(pool.empty_queue) == 3


def test_reset_refuses_while_in_use_then_clears():
    evicted = []
    pool = BlockPool(2, BS, on_evict=lambda h, i: evicted.append(i))
    a, b = pool.allocate(2)
    cache(pool, a, [1] * BS)
    cache(pool, b, [2] * BS)
    pool.free([a])
    assert pool.reset() is False
    assert pool.num_cached == 2 and evicted == []
    pool.free([b])
    assert pool.reset() is True
    assert pool.num_cached == 0 and len(pool.free_queue) == 0 and pool.num_free == 2
    assert sorted(evicted) == [a.block_id, b.block_id]
    assert pool.num_evictions == 0  # a reset is not pressure eviction


def test_invalid_sizes():
    with pytest.raises(ValueError):
        BlockPool(0, BS)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


# -- keep hints (cache breakpoints) ----------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _cached_free(pool, n, first_token=0):
    """n blocks cached and freed in this order (so LRU order is this order)."""
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        cache(pool, b, [first_token + i] * BS)
    pool.free(blocks)
    return blocks


def test_kept_blocks_survive_eviction_of_unmarked_blocks_of_the_same_age():
    clock = FakeClock()
    pool = BlockPool(6, BS, clock=clock)
    blocks = _cached_free(pool, 6)  # one request's blocks, all freed in the same step
    marked = blocks[:3]  # the part under a breakpoint: the oldest in LRU order, so plain LRU evicts them first
    for b in marked:
        pool.keep(b, clock.now + 300)
    assert pool.num_kept == 3 and pool.num_free == 6
    assert pool.evict_unreferenced(3) == 3
    assert all(b.is_cached for b in marked)
    assert not any(b.is_cached for b in blocks[3:])
    # An allocation takes the emptied blocks first; the kept ones stay hits.
    pool.allocate(3)
    assert all(pool.lookup(b.block_hash, b.token_ids) is b for b in marked)


def test_kept_blocks_are_evicted_last_not_never():
    clock = FakeClock()
    pool = BlockPool(3, BS, clock=clock)
    blocks = _cached_free(pool, 3)
    pool.keep(blocks[0], clock.now + 300)
    got = pool.allocate(3)  # a hint, not a guarantee: memory still goes to running requests
    assert got[-1] is blocks[0] and pool.num_kept == 0 and not blocks[0].is_cached


def test_expired_keep_is_plain_lru_again():
    clock = FakeClock()
    pool = BlockPool(4, BS, clock=clock)
    blocks = _cached_free(pool, 4)
    pool.keep(blocks[0], clock.now + 300)
    pool.keep(blocks[1], clock.now + 3600)  # "ttl": "1h"
    clock.now += 301
    assert pool.evict_unreferenced(2) == 2  # the unmarked ones go first, even now
    assert pool.evict_unreferenced(1) == 1
    assert not blocks[0].is_cached and blocks[1].is_cached  # then the expired one, before the live keep


def test_keep_renews_and_survives_use():
    clock = FakeClock()
    pool = BlockPool(3, BS, clock=clock)
    blocks = _cached_free(pool, 3)
    pool.keep(blocks[0], clock.now + 300)
    pool.keep(blocks[0], clock.now + 100)  # never shortened
    assert blocks[0].keep_until == clock.now + 300
    pool.touch([blocks[0]])  # a hit takes it out of the kept queue
    assert pool.num_kept == 0
    pool.free([blocks[0]])
    assert pool.num_kept == 1  # back under its hint
    clock.now += 400
    pool.touch([blocks[0]])
    pool.free([blocks[0]])  # its time ran out while in use: plain LRU, at the back
    assert pool.num_kept == 0 and list(pool.free_queue)[-1] is blocks[0]


def test_reset_and_drop_clear_the_keep():
    clock = FakeClock()
    pool = BlockPool(2, BS, clock=clock)
    blocks = _cached_free(pool, 2)
    pool.keep(blocks[0], clock.now + 300)
    assert pool.reset() and pool.num_cached == 0 and pool.num_kept == 0
    assert blocks[0].keep_until == 0.0 and pool.num_free == 2
