"""PrefixCacheManager with fake token ids: lookup, stores, holds, eviction, SSD loads and resume checks as
plan ops. No MLX."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlxhost.kv
from mlxhost.kv.cache_ops import (
    CacheResults,
    CheckResume,
    ClearDisk,
    DropBlock,
    LoadBlock,
    PinSnapshot,
    ResumeIndex,
    UnpinSnapshot,
)
from mlxhost.kv.hashing import block_hashes
from mlxhost.kv.prefix_cache import PrefixCacheManager, PrefixHold, StoreOp

BS = 4


class Manager(PrefixCacheManager):
    """The manager as the scheduler drives it: holds kept by request id; evictions recorded as they happen."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.holds: dict[str, PrefixHold] = {}
        self.evicted: list[tuple[bytes, int]] = []

    def hit(self, request_id: str, tokens, **kw) -> list[int]:
        self.holds[request_id] = hold = self.lookup(request_id, tokens, **kw)
        return hold.block_ids

    def drop_hold(self, request_id: str) -> None:
        hold = self.holds.pop(request_id, None)
        if hold is not None:
            hold.release()

    def _on_evict(self, block_hash: bytes, block_id: int) -> None:
        self.evicted.append((block_hash, block_id))
        super()._on_evict(block_hash, block_id)


def make(num_blocks=16, model_key="m", **kw) -> tuple[Manager, list[tuple[bytes, int]]]:
    mgr = Manager(num_blocks, BS, model_key, **kw)
    return mgr, mgr.evicted


def toks(seed: int, n: int) -> list[int]:
    """n token ids that share nothing with another seed's."""
    return [seed * 1000 + i for i in range(n)]


def store(mgr: PrefixCacheManager, tokens: list[int]) -> list[StoreOp]:
    """What the scheduler and runner do for a finished request: plan, (copy), finish."""
    ops = mgr.plan_store(tokens)
    mgr.finish_stores()
    return ops


# The logical half (every module directly in kv/) and the SSD tier's file handling: plain Python.
NO_TENSOR_MODULES = [
    *(f"mlxhost.kv.{p.stem}" for p in sorted(Path(mlxhost.kv.__file__).parent.glob("*.py"))),
    "mlxhost.kv.store.snapshots", "mlxhost.kv.store.ssd_format", "mlxhost.kv.store.ssd_tier",
]


def test_kv_logical_modules_import_no_tensor_library():
    assert {"mlxhost.kv.block_pool", "mlxhost.kv.prefix_cache", "mlxhost.kv.hashing",
            "mlxhost.kv.inflight"} <= set(NO_TENSOR_MODULES)
    for module in NO_TENSOR_MODULES:  # one interpreter each: an import of one must not hide another's
        code = (f"import sys, {module}; "
                "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'numpy')]; assert not bad, bad")
        subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_store_covers_full_blocks_only_with_chained_hashes():
    mgr, _ = make()
    tokens = toks(1, 3 * BS + 2)
    ops = store(mgr, tokens)
    assert [op.start for op in ops] == [0, BS, 2 * BS]
    assert [op.block_hash for op in ops] == block_hashes(tokens, BS, model_key="m")
    assert len({op.block_id for op in ops}) == 3
    assert mgr.pool.num_cached == 3 and mgr.pool.num_used == 0


def test_lookup_returns_the_longest_cached_prefix():
    mgr, _ = make()
    ops = store(mgr, toks(1, 3 * BS))
    # Same first two blocks, then a different third one: two blocks hit.
    prompt = toks(1, 2 * BS) + toks(2, BS + 3)
    assert mgr.hit("r", prompt) == [ops[0].block_id, ops[1].block_id]
    # A first block that differs in one token hits nothing, even though later blocks match.
    other = toks(1, 3 * BS + 1)
    other[1] = -1
    assert mgr.hit("s", other) == []


def test_lookup_never_covers_the_whole_prompt():
    mgr, _ = make()
    prompt = toks(1, 3 * BS)
    ops = store(mgr, prompt + toks(9, BS))
    # Exactly three full blocks: the last token must be computed for its logits, so its block is not a hit.
    assert mgr.hit("exact", prompt) == [op.block_id for op in ops[:2]]
    # One more token: all three blocks hit and that token is left.
    assert mgr.hit("plus1", prompt + [7]) == [op.block_id for op in ops[:3]]
    assert mgr.hit("one", prompt[:1]) == []


def test_stats_count_queried_and_hit_tokens():
    mgr, _ = make()
    assert mgr.stats()["hit_rate"] == 0.0
    store(mgr, toks(1, 2 * BS))
    mgr.hit("a", toks(1, 2 * BS + 2))  # 2 blocks hit
    mgr.hit("b", toks(2, 10))  # miss
    s = mgr.stats()
    assert s["queried_tokens"] == 2 * BS + 2 + 10
    assert s["hit_tokens"] == 2 * BS
    assert s["hit_rate"] == 2 * BS / (2 * BS + 12)
    assert (s["block_size"], s["num_blocks"], s["num_cached_blocks"], s["num_used_blocks"]) == (BS, 16, 2, 2)
    mgr.drop_hold("a")
    assert mgr.stats()["num_used_blocks"] == 0


def test_plan_store_skips_cached_blocks_and_the_requests_own_hit():
    mgr, _ = make()
    prompt = toks(1, 2 * BS + 1)
    first = store(mgr, prompt)
    assert len(first) == 2
    assert mgr.plan_store(prompt) == []  # everything already cached
    hit = mgr.hit("r", prompt + toks(2, BS))
    assert hit == [op.block_id for op in first]
    ops = mgr.plan_store(prompt + toks(2, BS) + toks(3, BS))
    # Only the blocks after the hit, at their positions in the sequence.
    assert [op.start for op in ops] == [2 * BS, 3 * BS]
    assert not {op.block_id for op in ops} & set(hit)
    mgr.drop_hold("r")
    mgr.finish_stores()
    assert mgr.pool.num_cached == 4 and mgr.pool.num_used == 0


def test_planned_blocks_cannot_be_evicted_before_finish_stores():
    mgr, evicted = make(num_blocks=2)
    ops = mgr.plan_store(toks(1, 2 * BS))
    assert len(ops) == 2 and mgr.pool.num_free == 0
    # Another finished request in the same step: no free block, so it stores nothing and evicts nothing.
    assert mgr.plan_store(toks(2, 2 * BS)) == []
    assert evicted == []
    mgr.finish_stores()
    assert mgr.pool.num_free == 2 and mgr.pool.num_cached == 2
    # Now they are ordinary cache entries: a later store may evict them.
    assert len(mgr.plan_store(toks(3, BS))) == 1
    assert len(evicted) == 1 and evicted[0][1] in {op.block_id for op in ops}


def test_plan_store_does_not_evict_the_head_its_new_blocks_extend():
    mgr, evicted = make(num_blocks=3)
    head = toks(1, 2 * BS)
    store(mgr, head)  # another request stored the first two blocks; they are the least recently used
    (other,) = store(mgr, toks(2, BS))  # the pool is full
    ops = store(mgr, head + toks(3, BS + 1))
    assert [op.start for op in ops] == [2 * BS]
    # The room came from the unrelated block, not from the head the new block hangs off.
    assert evicted == [(other.block_hash, other.block_id)]
    assert len(mgr.hit("r", head + toks(3, BS + 1))) == 3


def test_release_frees_tail_first():
    mgr, evicted = make(num_blocks=3)
    ops = store(mgr, toks(1, 3 * BS))
    assert len(mgr.hit("r", toks(1, 3 * BS + 1))) == 3
    mgr.drop_hold("r")
    # Eviction order now: the tail of r's prefix first, its head last.
    assert mgr.evict_to(2) == 1
    assert evicted == [(ops[2].block_hash, ops[2].block_id)]
    assert mgr.evict_to(1) == 1
    assert evicted[-1] == (ops[1].block_hash, ops[1].block_id)
    assert mgr.hit("s", toks(1, 3 * BS + 1)) == [ops[0].block_id]


def test_a_hold_is_released_once():
    mgr, _ = make()
    store(mgr, toks(1, BS))
    hold = mgr.lookup("r", toks(1, BS + 1))
    assert mgr.pool.num_used == 1
    hold.release()
    hold.release()
    assert mgr.pool.num_used == 0 and hold.released and hold.block_ids == []


def test_storing_past_capacity_evicts_least_recently_used():
    mgr, evicted = make(num_blocks=3)
    a, b, c = (store(mgr, toks(i, BS + 1))[0] for i in (1, 2, 3))
    # Use a: b becomes the least recently used.
    assert mgr.hit("r", toks(1, BS + 1)) == [a.block_id]
    mgr.drop_hold("r")
    (d,) = store(mgr, toks(4, BS + 1))
    assert evicted == [(b.block_hash, b.block_id)]
    assert d.block_id == b.block_id  # its id is reused
    assert mgr.hit("x", toks(2, BS + 1)) == []
    assert mgr.hit("y", toks(1, BS + 1)) == [a.block_id]
    assert mgr.hit("z", toks(3, BS + 1)) == [c.block_id]
    assert mgr.stats()["evictions"] == 1
    assert mgr.pool.num_cached == 3


def test_blocks_held_by_a_running_request_are_never_evicted():
    mgr, evicted = make(num_blocks=3)
    held = store(mgr, toks(1, 2 * BS))
    assert mgr.hit("running", toks(1, 2 * BS + 1)) == [op.block_id for op in held]
    for i in range(2, 8):
        assert len(store(mgr, toks(i, BS))) == 1  # churns through the one block left
    held_ids = {op.block_id for op in held}
    assert not held_ids & {block_id for _, block_id in evicted}
    # A store that needs more room than is free takes what there is and evicts nothing held.
    assert len(store(mgr, toks(20, 3 * BS))) == 1
    assert mgr.clear() == 1  # the unheld block only
    assert mgr.hit("again", toks(1, 2 * BS + 1)) == [op.block_id for op in held]
    mgr.drop_hold("running")
    mgr.drop_hold("again")
    assert mgr.clear() == 2 and mgr.pool.num_cached == 0


def test_model_key_separates_models():
    tokens = toks(1, 2 * BS)
    m1, _ = make(model_key="model-a")
    m2, _ = make(model_key="model-b")
    h1 = [op.block_hash for op in store(m1, tokens)]
    h2 = [op.block_hash for op in store(m2, tokens)]
    assert h1 == block_hashes(tokens, BS, model_key="model-a")
    assert not set(h1) & set(h2)
    # A cold tier shared by both (keyed by hash, like the SSD tier) never serves one model's block to the other.
    shared = {h: tuple(tokens[i * BS : (i + 1) * BS]) for i, h in enumerate(h1)}
    m3, _ = make(model_key="model-b", disk=FakeDisk(shared))
    assert m3.hit("r", tokens + [0]) == [] and m3.take_ops() == []
    m4, _ = make(model_key="model-a", disk=FakeDisk(shared))
    assert len(m4.hit("r", tokens + [0])) == 2


def test_clear_drops_every_unreferenced_block():
    mgr, evicted = make()
    ops = store(mgr, toks(1, 3 * BS))
    assert mgr.clear() == 3
    assert sorted(b for _, b in evicted) == sorted(op.block_id for op in ops)
    assert mgr.pool.num_cached == 0 and mgr.pool.num_free == 16
    assert mgr.hit("r", toks(1, 3 * BS + 1)) == []
    # And the cache fills again afterwards.
    assert len(store(mgr, toks(1, 3 * BS))) == 3


def test_clear_between_steps_drops_the_last_finished_requests_blocks():
    # The engine answers DELETE /v1/cache between two steps: the runner has copied the blocks planned
    # in the last step, but when the engine went idle no schedule() ran `finish_stores` after it.
    mgr, _ = make()
    mgr.plan_store(toks(1, 2 * BS))
    assert mgr.clear() == 2
    assert mgr.stats()["num_cached_blocks"] == 0 and mgr.pool.num_used == 0


class FakeDisk:
    """The SSD tier's index: hash -> tokens. Only `contains` is asked while deciding; the store runs the loads."""

    def __init__(self, blocks: dict[bytes, tuple[int, ...]]) -> None:
        self.blocks = blocks

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def run(self, ops) -> CacheResults:
        """What the store would find: a load succeeds if the file holds exactly its tokens."""
        failed = [op.block_id for op in ops if isinstance(op, LoadBlock) and self.blocks.get(op.block_hash) != op.token_ids]
        return CacheResults(tuple(failed))


def test_an_ssd_hit_is_a_load_in_the_plan_and_a_normal_hit_once_its_result_is_in():
    tokens = toks(1, 3 * BS)
    hashes = block_hashes(tokens, BS, model_key="m")
    # The SSD tier has the first two blocks only.
    disk = FakeDisk({h: tuple(tokens[i * BS : (i + 1) * BS]) for i, h in enumerate(hashes[:2])})
    mgr, _ = make(disk=disk)
    hold = mgr.lookup("r", tokens + [5])
    assert hold.loading and len(hold.block_ids) == 2  # held, not usable before the loads ran
    ops = mgr.take_ops()
    assert ops == [LoadBlock(b, h, tuple(tokens[i * BS : (i + 1) * BS]))
                   for i, (b, h) in enumerate(zip(hold.block_ids, hashes))]
    assert mgr.stats()["hit_tokens"] == 0  # counted once settled
    mgr.finish_ops(disk.run(ops))
    assert not hold.loading and hold.num_tokens == 2 * BS and mgr.stats()["hit_tokens"] == 2 * BS
    assert mgr.pool.num_cached == 2 and mgr.pool.num_used == 2  # now memory blocks held by r
    hold.release()
    # Second time: memory hits, nothing to load.
    again = mgr.lookup("s", tokens + [5])
    assert again.block_ids == hold.block_ids or len(again.block_ids) == 2
    assert not again.loading and mgr.take_ops() == []


def test_a_failed_load_ends_the_hit_before_that_block_for_every_hold_and_forgets_it():
    tokens = toks(1, 3 * BS)
    hashes = block_hashes(tokens, BS, model_key="m")
    disk = FakeDisk({h: tuple(tokens[i * BS : (i + 1) * BS]) for i, h in enumerate(hashes)})
    mgr, _ = make(disk=disk)
    first = mgr.lookup("r", tokens + [5])
    second = mgr.lookup("s", tokens + [6])  # hits the same blocks while their loads are out: waits too
    assert first.loading and second.loading and second.block_ids == first.block_ids
    ops = mgr.take_ops()
    assert [type(op) for op in ops] == [LoadBlock] * 3  # each block loaded once
    broken = ops[1].block_id
    mgr.finish_ops(CacheResults((broken,)))
    assert first.block_ids == second.block_ids == [ops[0].block_id]
    assert not mgr.is_cached(hashes[1])  # no later lookup finds it empty
    assert mgr.is_cached(hashes[2])  # loaded fine: handed back, still cached (unreachable until block 1 returns)
    assert DropBlock(broken) in mgr.take_ops()
    first.release()
    second.release()
    assert mgr.pool.num_used == 0


def test_an_ssd_miss_does_not_evict_a_memory_block():
    # With no empty block left, a lookup that the disk index says is a miss must not cost a cached block.
    mgr, evicted = make(num_blocks=2, disk=FakeDisk({}))
    kept = [store(mgr, toks(i, BS + 1))[0] for i in (1, 2)]
    assert mgr.pool.num_free == 2 and mgr.pool.num_cached == 2
    assert mgr.hit("r", toks(3, 2 * BS)) == []
    assert evicted == [] and mgr.take_ops() == []
    assert mgr.hit("s", toks(1, BS + 1)) == [kept[0].block_id]
    assert mgr.hit("t", toks(2, BS + 1)) == [kept[1].block_id]


def test_no_load_is_planned_when_every_block_is_held():
    tokens = toks(1, BS)
    mgr, _ = make(num_blocks=1, disk=FakeDisk({block_hashes(tokens, BS, model_key="m")[0]: tuple(tokens)}))
    store(mgr, toks(2, BS))
    assert len(mgr.hit("holder", toks(2, BS + 1))) == 1
    assert mgr.hit("r", tokens + [0]) == []  # no free block to load into: a miss, not an error
    assert mgr.take_ops() == []


def test_a_load_evicted_before_the_plan_left_is_never_made():
    tokens = toks(1, BS)
    mgr, _ = make(num_blocks=1, disk=FakeDisk({block_hashes(tokens, BS, model_key="m")[0]: tuple(tokens)}))
    hold = mgr.lookup("r", tokens + [0])
    (block_id,) = hold.block_ids
    hold.release()  # its request left in the same step
    mgr.plan_store(toks(7, BS))  # needs the one block: evicts the block not loaded yet
    ops = mgr.take_ops()
    assert not any(isinstance(op, LoadBlock) for op in ops) and DropBlock(block_id) in ops


def test_a_hit_on_a_checked_model_waits_for_the_stores_check_and_pins_once():
    mgr, _ = make(resume=ResumeIndex(needs_snapshot=True))
    tokens = toks(1, 5 * BS + 1)
    ops = store(mgr, tokens[: 5 * BS])
    assert [op.is_row_end for op in ops] == [False] * 4 + [True]  # the last block ends the KV
    hold = mgr.lookup("r", tokens)
    assert hold.loading and hold.block_ids == [op.block_id for op in ops]
    (check,) = mgr.take_ops()
    assert check == CheckResume("r", tuple(op.block_id for op in ops), tuple(op.block_hash for op in ops),
                                tuple(op.token_ids for op in ops))
    mgr.finish_ops(CacheResults(resume_depths=(("r", 2),)))  # the store can resume after two blocks only
    assert hold.block_ids == [op.block_id for op in ops[:2]] and not hold.loading
    assert mgr.pool.num_used == 2 and mgr.pool.num_cached == 5  # the deeper blocks handed back, still cached
    hold.release()
    hold.release()  # idempotent: one unpin, one free
    assert mgr.take_ops() == [UnpinSnapshot("r")] and mgr.pool.num_used == 0
    # A check that found nowhere to resume: no hit.
    miss = mgr.lookup("q", tokens)
    mgr.take_ops()
    mgr.finish_ops(CacheResults(resume_depths=(("q", 0),)))
    assert miss.block_ids == [] and mgr.pool.num_used == 0


def test_lost_windows_are_forgotten_once_unreferenced():
    mgr, _ = make(resume=ResumeIndex(needs_snapshot=True))
    tokens = toks(1, 2 * BS + 1)
    ops = store(mgr, tokens[: 2 * BS])
    hold = mgr.lookup("r", tokens)
    mgr.take_ops()
    mgr.finish_ops(CacheResults(resume_depths=(("r", 1),), lost_windows=(ops[1].block_id,)))
    assert not mgr.is_cached(ops[1].block_hash)  # stored whole again by the recompute
    assert mgr.is_cached(ops[0].block_hash) and hold.block_ids == [ops[0].block_id]


def test_clear_with_disk_plans_the_disk_clear():
    mgr, _ = make(disk=FakeDisk({}))
    store(mgr, toks(1, BS))
    assert mgr.clear(disk=True) == 1
    ops = mgr.take_ops()
    assert ClearDisk() in ops and sum(isinstance(op, DropBlock) for op in ops) == 1


def test_blocks_under_a_cache_breakpoint_outlive_unmarked_blocks_of_the_same_age():
    now = [0.0]
    mgr, evicted = make(num_blocks=4, clock=lambda: now[0])
    marked, plain = toks(1, 2 * BS), toks(2, 2 * BS)
    # Two requests stored in one step: the same age. Their blocks are freed in reverse planning order, so
    # plain LRU would evict the marked request's blocks first.
    plain_ops = mgr.plan_store(plain)
    marked_ops = mgr.plan_store(marked)
    mgr.finish_stores()
    assert list(mgr.pool.free_queue)[0].block_id == marked_ops[-1].block_id
    assert mgr.keep(mgr.hashes(marked), 300) == 2
    store(mgr, toks(3, 2 * BS))  # needs two blocks: the unmarked ones go
    assert {h for h, _ in evicted} == {op.block_hash for op in plain_ops}
    assert mgr.hit("r", marked + [7]) == [op.block_id for op in marked_ops]
    mgr.drop_hold("r")  # a hit renews the keep, and the blocks go back under it
    assert mgr.stats()["num_kept_blocks"] == 2
    now[0] = 301.0  # the TTL ran out: plain LRU again
    store(mgr, toks(4, 4 * BS))
    assert mgr.hit("s", marked + [7]) == []


def test_a_hit_the_index_answers_from_memory_pins_at_once_without_a_check():
    snapshots: set[bytes] = set()
    resume = ResumeIndex({"swa": set()}, {"swa": lambda n: max(0, n - 2 * BS)}, True, snapshots)
    mgr, _ = make(resume=resume)
    tokens = toks(1, 3 * BS + 1)
    ops = store(mgr, tokens[: 3 * BS])
    ids = [op.block_id for op in ops]
    resume.parts["swa"].update(ids[1:])  # the window's two blocks carry sliding KV
    snapshots.add(ops[-1].block_hash)
    hold = mgr.lookup("r", tokens)
    assert not hold.loading and hold.block_ids == ids
    assert mgr.take_ops() == [PinSnapshot("r", ops[-1].block_hash)]
    hold.release()
    assert mgr.take_ops() == [UnpinSnapshot("r")]
    # A window block without its sliding KV in memory: the store is asked (it may be on disk).
    resume.parts["swa"].discard(ids[2])
    hold = mgr.lookup("q", tokens)
    assert hold.loading and [type(op) for op in mgr.take_ops()] == [CheckResume]
    hold.release()
    # The store's index is stale for blocks evicted since the last plan left: not trusted.
    resume.parts["swa"].add(ids[2])
    mgr.take_ops()
    mgr.pool.uncache(mgr.pool.blocks[ids[2]])  # e.g. a discarded store: its DropBlock has not run yet
    mgr.finish_stores()
    assert mgr.lookup("p", tokens).block_ids == ids[:2]  # the hit ends before it, and the snapshot is not there
    assert [type(op) for op in mgr.take_ops()] == [DropBlock, CheckResume]
