import pytest

from mlxserve.cache.block_pool import BlockPool
from mlxserve.cache.hashing import block_hashes
from mlxserve.cache.kv_manager import KVCacheManager

BS = 4


def make(num_blocks=8, model_key="m"):
    pool = BlockPool(num_blocks, BS)
    return pool, KVCacheManager(pool, BS, model_key)


def run_prefill(mgr, rid, tokens, extra_keys=()):
    """Admit a request, 'compute' its prompt and cache its full blocks."""
    hits, num_cached = mgr.get_computed_blocks(rid, tokens, extra_keys)
    assert mgr.allocate_slots(rid, len(tokens)) is not None
    mgr.cache_blocks(rid, tokens)
    return hits, num_cached


def test_cold_request_allocates_and_caches_only_full_blocks():
    pool, mgr = make()
    tokens = list(range(10))
    hits, num_cached = mgr.get_computed_blocks("a", tokens)
    assert hits == [] and num_cached == 0
    new = mgr.allocate_slots("a", len(tokens))
    assert len(new) == 3 and mgr.get_block_ids("a") == [b.block_id for b in new]
    assert mgr.cache_blocks("a", tokens) == 2
    assert pool.num_cached == 2 and mgr.num_cached_blocks("a") == 2
    expected = block_hashes(tokens, BS, model_key="m")
    assert [b.block_hash for b in new[:2]] == expected and new[2].block_hash is None


def test_second_request_reuses_prefix_and_shares_blocks():
    pool, mgr = make()
    prompt = list(range(10))
    run_prefill(mgr, "a", prompt)
    a_blocks = mgr.get_blocks("a")
    hits, num_cached = mgr.get_computed_blocks("b", prompt[:8] + [99, 98, 97])
    assert num_cached == 8 and hits == a_blocks[:2]
    assert mgr.allocate_slots("b", 11) is not None
    assert mgr.get_blocks("b")[:2] == a_blocks[:2]
    assert [b.ref_count for b in a_blocks] == [2, 2, 1]
    s = mgr.stats()
    assert s["num_queried_tokens"] == 21 and s["num_hit_tokens"] == 8
    assert s["hit_rate"] == pytest.approx(8 / 21)
    assert s["num_used_blocks"] == 4 and s["num_free_blocks"] == 4


def test_never_returns_the_whole_prompt():
    _, mgr = make()
    prompt = list(range(8))  # exactly two blocks
    run_prefill(mgr, "a", prompt)
    mgr.free("a")
    hits, num_cached = mgr.get_computed_blocks("b", prompt)
    assert len(hits) == 1 and num_cached == 4  # last block recomputed for the logits
    hits, num_cached = mgr.get_computed_blocks("c", prompt + [42])
    assert len(hits) == 2 and num_cached == 8  # a partial tail is left to compute anyway


def test_longest_prefix_stops_at_first_miss():
    pool, mgr = make()
    prompt = list(range(13))
    run_prefill(mgr, "a", prompt)
    b0, b1, b2, _ = mgr.get_blocks("a")
    mgr.free("a")
    # Evict only the middle block: pin the others, evict the LRU front, unpin.
    pool.touch([b0, b2])
    assert pool.evict_unreferenced(1) == 1 and b1.block_hash is None
    pool.free([b2, b0])
    assert b2.block_hash is not None  # still cached, but after the hole
    misses = pool.num_misses
    hits, num_cached = mgr.get_computed_blocks("b", prompt)
    assert hits == [b0] and num_cached == 4
    assert pool.num_misses == misses + 1  # stopped, did not look up b2


def test_allocate_counts_free_cached_hits_as_demand():
    pool, mgr = make(num_blocks=4)
    prompt = list(range(13))
    run_prefill(mgr, "a", prompt)
    mgr.free("a")
    assert pool.num_free == 4 and pool.num_cached == 3
    hits, num_cached = mgr.get_computed_blocks("b", prompt)
    assert num_cached == 12
    new = mgr.allocate_slots("b", 13)  # 3 reclaimed hits + 1 new block = the whole pool
    assert new is not None and len(new) == 1 and pool.num_free == 0
    # No room for another request: None, and nothing changes.
    assert mgr.get_computed_blocks("c", [50] * 5) == ([], 0)
    assert mgr.allocate_slots("c", 5) is None
    assert mgr.get_block_ids("c") == [] and pool.num_free == 0


def test_allocate_none_when_short_and_no_side_effects():
    pool, mgr = make(num_blocks=4)
    run_prefill(mgr, "a", list(range(12)))  # 3 blocks
    refs = [b.ref_count for b in pool.blocks]
    mgr.get_computed_blocks("b", list(range(100, 109)))
    assert mgr.allocate_slots("b", 9) is None  # needs 3, 1 free
    assert [b.ref_count for b in pool.blocks] == refs and pool.num_free == 1
    assert mgr.stats()["num_queried_tokens"] == 12  # b was not admitted


def test_stale_hits_are_rechecked_before_admission():
    pool, mgr = make(num_blocks=3)
    prompt = list(range(9))
    run_prefill(mgr, "a", prompt)  # 3 blocks, 2 cached
    mgr.free("a")
    hits, num_cached = mgr.get_computed_blocks("b", prompt)
    assert num_cached == 8
    # Another request allocates first and reuses every block, evicting b's hits.
    mgr.get_computed_blocks("c", [7] * 12)
    assert mgr.allocate_slots("c", 12) is not None
    mgr.free("c")
    assert mgr.allocate_slots("b", 9) is None  # stale: asks the scheduler to retry
    assert mgr.get_computed_blocks("b", prompt) == ([], 0)
    assert mgr.allocate_slots("b", 9) is not None


def test_decode_caches_blocks_incrementally_at_boundaries():
    pool, mgr = make()
    tokens = list(range(6))
    run_prefill(mgr, "a", tokens)
    assert pool.num_cached == 1
    for t in range(100, 107):  # decode: KV of all but the newest token is written
        tokens.append(t)
        assert mgr.allocate_slots("a", len(tokens)) is not None
        mgr.cache_blocks("a", tokens, num_computed_tokens=len(tokens) - 1)
        assert mgr.num_cached_blocks("a") == (len(tokens) - 1) // BS
    assert len(tokens) == 13 and mgr.num_cached_blocks("a") == 3
    expected = block_hashes(tokens, BS, model_key="m")
    assert [b.block_hash for b in mgr.get_blocks("a")[:3]] == expected


def test_free_releases_tail_first():
    pool, mgr = make()
    run_prefill(mgr, "a", list(range(12)))
    blocks = mgr.get_blocks("a")
    mgr.free("a")
    assert list(pool.free_queue) == blocks[::-1]  # tail is evicted before the head
    assert all(b.ref_count == 0 for b in blocks) and mgr.get_block_ids("a") == []
    mgr.free("a")  # freeing twice is harmless at this level


def test_fork_copy_on_write_on_divergence_only():
    pool, mgr = make()
    prompt = list(range(6))
    run_prefill(mgr, "p", prompt)
    full, tail = mgr.get_blocks("p")
    mgr.fork("p", "c")
    assert mgr.get_blocks("c") == [full, tail] and (full.ref_count, tail.ref_count) == (2, 2)
    assert pool.num_used == 2  # nothing copied yet

    assert mgr.allocate_slots("p", 7) == []  # p writes token 6 into the shared tail
    (cow,) = mgr.take_pending_copies()
    assert cow.needs_copy and cow.src_block_id == tail.block_id
    assert mgr.get_blocks("p") == [full, cow.block]
    assert mgr.get_blocks("c") == [full, tail]  # the other keeps the original
    assert tail.ref_count == 1 and full.ref_count == 2

    assert mgr.allocate_slots("c", 7) == []  # c's tail is private now: no copy
    assert mgr.take_pending_copies() == []
    assert mgr.get_blocks("c") == [full, tail]
    mgr.free("p")
    mgr.free("c")
    assert pool.num_free == pool.num_blocks


def test_fork_errors():
    _, mgr = make()
    with pytest.raises(KeyError):
        mgr.fork("missing", "x")
    run_prefill(mgr, "p", [1, 2, 3])
    run_prefill(mgr, "q", [1, 2, 3])
    with pytest.raises(ValueError):
        mgr.fork("p", "q")


def test_copy_on_write_needs_a_free_block():
    pool, mgr = make(num_blocks=2)
    run_prefill(mgr, "p", list(range(6)))
    mgr.fork("p", "c")
    assert pool.num_free == 0
    assert mgr.allocate_slots("p", 7) is None  # the copy has nowhere to go
    assert mgr.take_pending_copies() == []


def test_model_key_and_extra_keys_isolate_caches():
    pool = BlockPool(16, BS)
    mgr_a = KVCacheManager(pool, BS, "model-a")
    mgr_b = KVCacheManager(pool, BS, "model-b")
    prompt = list(range(9))
    run_prefill(mgr_a, "a", prompt)
    assert mgr_b.get_computed_blocks("b", prompt) == ([], 0)
    assert mgr_a.get_computed_blocks("x", prompt, extra_keys=("img",)) == ([], 0)
    assert mgr_a.get_computed_blocks("y", prompt)[1] == 8


def test_concurrent_identical_prompts_do_not_double_cache():
    pool, mgr = make()
    prompt = list(range(9))
    for rid in ("a", "b"):  # both admitted before either cached anything
        assert mgr.get_computed_blocks(rid, prompt) == ([], 0)
        assert mgr.allocate_slots(rid, 9) is not None
    mgr.cache_blocks("a", prompt)
    mgr.cache_blocks("b", prompt)
    assert pool.num_cached == 2
    assert all(b.block_hash is None for b in mgr.get_blocks("b"))
    mgr.free("b")
    assert len(pool.free_queue) == 0  # b's duplicates hold nothing: reused first


def test_reset_prefix_cache_and_admitted_requery():
    pool, mgr = make()
    run_prefill(mgr, "a", list(range(8)))
    with pytest.raises(RuntimeError):
        mgr.get_computed_blocks("a", list(range(8)))
    assert mgr.reset_prefix_cache() is False and pool.num_cached == 2
    mgr.free("a")
    assert mgr.reset_prefix_cache() is True
    assert pool.num_cached == 0 and mgr.stats()["num_cached_blocks"] == 0


def test_block_size_must_match_pool():
    with pytest.raises(ValueError):
        KVCacheManager(BlockPool(4, BS), BS * 2)
