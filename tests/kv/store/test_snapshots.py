"""SnapshotStore: byte budget, LRU eviction, pins held by requests. No MLX."""

from __future__ import annotations

from mlxhost.kv.store.snapshots import SnapshotStore


def test_budget_evicts_least_recently_used_but_never_a_pinned_snapshot():
    store = SnapshotStore(max_bytes=30)
    for h in (b"a", b"b", b"c"):
        assert store.put(h, h.decode(), 10)
    assert store.get(b"a") == "a"  # now b is the least recently used
    store.pin("r1", b"b")
    assert store.put(b"d", "d", 10)
    assert b"b" in store and b"c" not in store and store.nbytes == 30 and store.num_evictions == 1
    store.unpin("r1")
    assert store.put(b"e", "e", 10) and b"b" not in store


def test_a_snapshot_larger_than_the_budget_is_refused_and_pins_can_overfill_until_released():
    store = SnapshotStore(max_bytes=20)
    assert not store.put(b"big", "x", 21) and len(store) == 0
    store.put(b"a", "a", 10)
    store.put(b"b", "b", 10)
    store.pin("r1", b"a")
    store.pin("r2", b"b")
    assert not store.put(b"c", "c", 10)  # nothing unpinned to evict but itself
    assert len(store) == 2
    store.clear()  # pinned ones stay
    assert len(store) == 2
    store.unpin("r1")
    store.unpin("r2")
    store.clear()
    assert len(store) == 0 and store.nbytes == 0
