"""run_cache_ops: a plan's cache ops run on the store in order, pins and unpins first; a failed load is a result.
A fake store records the calls, no MLX."""

from __future__ import annotations

from mlxhost.kv.cache_ops import CacheResults, CheckResume, ClearDisk, DropBlock, LoadBlock, PinSnapshot, UnpinSnapshot
from mlxhost.kv.store.ops import run_cache_ops
from mlxhost.kv.store.snapshots import SnapshotStore


class FakeStore:
    def __init__(self, on_disk: set[bytes], resumable: set[int]) -> None:
        self.on_disk, self.resumable, self.calls = on_disk, resumable, []
        self.snapshots = SnapshotStore(1 << 20)

    def drop(self, block_id):
        self.calls.append(("drop", block_id))

    def load_from_ssd(self, block_hash, token_ids, block_id):
        self.calls.append(("load", block_id))
        return block_hash in self.on_disk

    def can_resume(self, request_id, block_ids, block_hash, token_ids):
        self.calls.append(("check", request_id, len(block_ids)))
        return len(block_ids) in self.resumable

    def release(self, request_id):
        self.calls.append(("unpin", request_id))
        self.snapshots.unpin(request_id)

    def clear_ssd(self):
        self.calls.append(("clear",))

    def take_lost_windows(self):
        return [9]


def check(rid: str, ids: tuple[int, ...]) -> CheckResume:
    return CheckResume(rid, ids, tuple(bytes([b]) for b in ids), tuple((b,) for b in ids))


def test_ops_run_in_order_with_pins_first_and_failed_loads_as_results():
    store = FakeStore(on_disk={b"\x01"}, resumable={1, 3})
    ops = [DropBlock(5), LoadBlock(1, b"\x01", (1,)), LoadBlock(2, b"\x02", (2,)), check("r", (1, 2, 3)),
           PinSnapshot("s", b"\x07"), ClearDisk()]
    results = run_cache_ops(store, ops)
    assert store.calls == [("drop", 5), ("load", 1), ("load", 2), ("check", "r", 1), ("clear",)]
    # The check starts below the block whose load failed; the pin was made before anything else ran.
    assert results == CacheResults(failed_loads=(2,), resume_depths=(("r", 1),), lost_windows=(9,))
    assert store.snapshots._pinned_by == {"s": b"\x07"}


def test_a_check_for_a_hold_that_ended_later_in_the_plan_is_not_made():
    store = FakeStore(on_disk=set(), resumable={2})
    ops = [check("r", (1, 2)), UnpinSnapshot("r"), check("r", (1, 2))]  # preempted, then admitted again
    results = run_cache_ops(store, ops)
    assert store.calls == [("unpin", "r"), ("check", "r", 2)]
    assert results.depth_of("r") == 2


def test_no_store_or_no_ops_is_no_work():
    assert run_cache_ops(None, [DropBlock(1)]) == CacheResults()
    assert run_cache_ops(FakeStore(set(), set()), []) == CacheResults()
