"""PrefixCacheManager with fake token ids: lookup, stores, holds, eviction, the cold-tier hook. No MLX."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlxhost.kv
from mlxhost.kv.hashing import block_hashes
from mlxhost.kv.prefix_cache import PrefixCacheManager, StoreOp

BS = 4


def make(num_blocks=16, model_key="m", **kw) -> tuple[PrefixCacheManager, list[tuple[bytes, int]]]:
    evicted: list[tuple[bytes, int]] = []
    mgr = PrefixCacheManager(num_blocks, BS, model_key, on_evict=lambda h, b: evicted.append((h, b)), **kw)
    return mgr, evicted


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
    assert mgr.lookup("r", prompt) == [ops[0].block_id, ops[1].block_id]
    # A first block that differs in one token hits nothing, even though later blocks match.
    other = toks(1, 3 * BS + 1)
    other[1] = -1
    assert mgr.lookup("s", other) == []


def test_lookup_never_covers_the_whole_prompt():
    mgr, _ = make()
    prompt = toks(1, 3 * BS)
    ops = store(mgr, prompt + toks(9, BS))
    # Exactly three full blocks: the last token must be computed for its logits, so its block is not a hit.
    assert mgr.lookup("exact", prompt) == [op.block_id for op in ops[:2]]
    # One more token: all three blocks hit and that token is left.
    assert mgr.lookup("plus1", prompt + [7]) == [op.block_id for op in ops[:3]]
    assert mgr.lookup("one", prompt[:1]) == []


def test_stats_count_queried_and_hit_tokens():
    mgr, _ = make()
    assert mgr.stats()["hit_rate"] == 0.0
    store(mgr, toks(1, 2 * BS))
    mgr.lookup("a", toks(1, 2 * BS + 2))  # 2 blocks hit
    mgr.lookup("b", toks(2, 10))  # miss
    s = mgr.stats()
    assert s["queried_tokens"] == 2 * BS + 2 + 10
    assert s["hit_tokens"] == 2 * BS
    assert s["hit_rate"] == 2 * BS / (2 * BS + 12)
    assert (s["block_size"], s["num_blocks"], s["num_cached_blocks"], s["num_used_blocks"]) == (BS, 16, 2, 2)
    mgr.release("a")
    assert mgr.stats()["num_used_blocks"] == 0


def test_plan_store_skips_cached_blocks_and_the_requests_own_hit():
    mgr, _ = make()
    prompt = toks(1, 2 * BS + 1)
    first = store(mgr, prompt)
    assert len(first) == 2
    assert mgr.plan_store(prompt) == []  # everything already cached
    hit = mgr.lookup("r", prompt + toks(2, BS))
    assert hit == [op.block_id for op in first]
    ops = mgr.plan_store(prompt + toks(2, BS) + toks(3, BS))
    # Only the blocks after the hit, at their positions in the sequence.
    assert [op.start for op in ops] == [2 * BS, 3 * BS]
    assert not {op.block_id for op in ops} & set(hit)
    mgr.release("r")
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
    assert len(mgr.lookup("r", head + toks(3, BS + 1))) == 3


def test_release_frees_tail_first():
    mgr, evicted = make(num_blocks=3)
    ops = store(mgr, toks(1, 3 * BS))
    assert len(mgr.lookup("r", toks(1, 3 * BS + 1))) == 3
    mgr.release("r")
    # Eviction order now: the tail of r's prefix first, its head last.
    assert mgr.evict_to(2) == 1
    assert evicted == [(ops[2].block_hash, ops[2].block_id)]
    assert mgr.evict_to(1) == 1
    assert evicted[-1] == (ops[1].block_hash, ops[1].block_id)
    assert mgr.lookup("s", toks(1, 3 * BS + 1)) == [ops[0].block_id]


def test_release_of_an_unknown_request_is_a_no_op():
    mgr, _ = make()
    mgr.release("never-admitted")
    mgr.lookup("r", toks(1, 5))
    mgr.release("r")
    mgr.release("r")
    assert mgr.pool.num_used == 0


def test_storing_past_capacity_evicts_least_recently_used():
    mgr, evicted = make(num_blocks=3)
    a, b, c = (store(mgr, toks(i, BS + 1))[0] for i in (1, 2, 3))
    # Use a: b becomes the least recently used.
    assert mgr.lookup("r", toks(1, BS + 1)) == [a.block_id]
    mgr.release("r")
    (d,) = store(mgr, toks(4, BS + 1))
    assert evicted == [(b.block_hash, b.block_id)]
    assert d.block_id == b.block_id  # its id is reused
    assert mgr.lookup("x", toks(2, BS + 1)) == []
    assert mgr.lookup("y", toks(1, BS + 1)) == [a.block_id]
    assert mgr.lookup("z", toks(3, BS + 1)) == [c.block_id]
    assert mgr.stats()["evictions"] == 1
    assert mgr.pool.num_cached == 3


def test_blocks_held_by_a_running_request_are_never_evicted():
    mgr, evicted = make(num_blocks=3)
    held = store(mgr, toks(1, 2 * BS))
    assert mgr.lookup("running", toks(1, 2 * BS + 1)) == [op.block_id for op in held]
    for i in range(2, 8):
        assert len(store(mgr, toks(i, BS))) == 1  # churns through the one block left
    held_ids = {op.block_id for op in held}
    assert not held_ids & {block_id for _, block_id in evicted}
    # A store that needs more room than is free takes what there is and evicts nothing held.
    assert len(store(mgr, toks(20, 3 * BS))) == 1
    assert mgr.clear() == 1  # the unheld block only
    assert mgr.lookup("again", toks(1, 2 * BS + 1)) == [op.block_id for op in held]
    mgr.release("running")
    mgr.release("again")
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
    m3, _ = make(model_key="model-b", lookup_cold=lambda h, t, b: shared.get(h) == tuple(t))
    assert m3.lookup("r", tokens + [0]) == []
    m4, _ = make(model_key="model-a", lookup_cold=lambda h, t, b: shared.get(h) == tuple(t))
    assert len(m4.lookup("r", tokens + [0])) == 2


def test_clear_drops_every_unreferenced_block():
    mgr, evicted = make()
    ops = store(mgr, toks(1, 3 * BS))
    assert mgr.clear() == 3
    assert sorted(b for _, b in evicted) == sorted(op.block_id for op in ops)
    assert mgr.pool.num_cached == 0 and mgr.pool.num_free == 16
    assert mgr.lookup("r", toks(1, 3 * BS + 1)) == []
    # And the cache fills again afterwards.
    assert len(store(mgr, toks(1, 3 * BS))) == 3


def test_clear_between_steps_drops_the_last_finished_requests_blocks():
    # The engine answers DELETE /v1/cache between two steps: the runner has copied the blocks planned
    # in the last step, but when the engine went idle no schedule() ran `finish_stores` after it.
    mgr, _ = make()
    mgr.plan_store(toks(1, 2 * BS))
    assert mgr.clear() == 2
    assert mgr.stats()["num_cached_blocks"] == 0 and mgr.pool.num_used == 0


class FakeCold:
    """A second tier: a dict hash -> tokens; counts calls and fills."""

    def __init__(self, blocks: dict[bytes, tuple[int, ...]]) -> None:
        self.blocks = blocks
        self.calls: list[tuple[bytes, int]] = []

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def __call__(self, block_hash: bytes, tokens, block_id: int) -> bool:
        self.calls.append((block_hash, block_id))
        return self.blocks.get(block_hash) == tuple(tokens)


def test_cold_tier_is_asked_on_a_memory_miss_and_becomes_a_normal_hit():
    tokens = toks(1, 3 * BS)
    hashes = block_hashes(tokens, BS, model_key="m")
    # The cold tier has the first two blocks only.
    cold = FakeCold({h: tuple(tokens[i * BS : (i + 1) * BS]) for i, h in enumerate(hashes[:2])})
    mgr, _ = make(lookup_cold=cold)
    hit = mgr.lookup("r", tokens + [5])
    assert len(hit) == 2
    assert [h for h, _ in cold.calls] == hashes  # asked for each block until the first miss
    assert [b for _, b in cold.calls[:2]] == hit  # filled into the blocks that were then served
    assert mgr.pool.num_cached == 2 and mgr.pool.num_used == 2  # now memory blocks held by r
    assert mgr.stats()["hit_tokens"] == 2 * BS
    mgr.release("r")
    # Second time: memory hits, the cold tier is not asked for them.
    cold.calls.clear()
    assert mgr.lookup("s", tokens + [5]) == hit
    assert [h for h, _ in cold.calls] == [hashes[2]]
    # The failed fill left no block behind.
    mgr.release("s")
    assert mgr.pool.num_cached == 2 and mgr.pool.num_used == 0


def test_cold_miss_does_not_evict_a_memory_block():
    # With no empty block left, a cold lookup that finds nothing must not cost a cached block.
    mgr, evicted = make(num_blocks=2, lookup_cold=FakeCold({}), has_cold=FakeCold({}).contains)
    kept = [store(mgr, toks(i, BS + 1))[0] for i in (1, 2)]
    assert mgr.pool.num_free == 2 and mgr.pool.num_cached == 2
    assert mgr.lookup("r", toks(3, 2 * BS)) == []
    assert evicted == []
    assert mgr.lookup("s", toks(1, BS + 1)) == [kept[0].block_id]
    assert mgr.lookup("t", toks(2, BS + 1)) == [kept[1].block_id]


def test_cold_lookup_is_skipped_when_every_block_is_held():
    tokens = toks(1, BS)
    cold = FakeCold({block_hashes(tokens, BS, model_key="m")[0]: tuple(tokens)})
    mgr, _ = make(num_blocks=1, lookup_cold=cold)
    store(mgr, toks(2, BS))
    assert len(mgr.lookup("holder", toks(2, BS + 1))) == 1
    assert mgr.lookup("r", tokens + [0]) == []  # no free block to load into: a miss, not an error
    assert cold.calls == []


class FakeResume:
    """A physical half that can resume only at the depths it is told (sliding data, snapshots)."""

    def __init__(self, depths: set[int]) -> None:
        self.depths = depths
        self.asked: list[int] = []
        self.released: list[str] = []

    def can_resume(self, request_id, block_ids, block_hash, token_ids) -> bool:
        self.asked.append(len(block_ids))
        assert len(token_ids) == BS
        return len(block_ids) in self.depths

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def take_lost_windows(self) -> list[int]:
        return []


def test_a_hit_stops_at_the_deepest_depth_the_physical_half_can_resume():
    resume = FakeResume({2})
    mgr, _ = make(resume=resume)
    tokens = toks(1, 5 * BS + 1)
    ops = store(mgr, tokens[: 5 * BS])
    assert [op.is_row_end for op in ops] == [False] * 4 + [True]  # the last block ends the KV
    ids = mgr.lookup("r", tokens)
    assert ids == [op.block_id for op in ops[:2]] and resume.asked == [5, 4, 3, 2]
    assert mgr.pool.num_used == 2  # the three deeper blocks were handed back, still cached
    assert mgr.pool.num_cached == 5
    mgr.release("r")
    assert resume.released == ["r"] and mgr.pool.num_used == 0
    resume.depths = set()
    assert mgr.lookup("q", tokens) == [] and mgr.pool.num_used == 0


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
    assert mgr.lookup("r", marked + [7]) == [op.block_id for op in marked_ops]
    mgr.release("r")  # a hit renews the keep, and the blocks go back under it
    assert mgr.stats()["num_kept_blocks"] == 2
    now[0] = 301.0  # the TTL ran out: plain LRU again
    store(mgr, toks(4, 4 * BS))
    assert mgr.lookup("s", marked + [7]) == []
