"""Desktop mode under pressure, with fake readings and no model: budget nobody holds goes first, then
the prefix cache's blocks (LRU first, down to the new share), then the KV that new admissions get;
running requests are never touched; the caches regrow when the pressure passes; dedicated mode does
not follow."""

from __future__ import annotations

from dataclasses import replace

from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.scheduler import Scheduler
from mlxhost.kv.prefix_cache import PrefixCacheManager
from mlxhost.memory.budget import BudgetConfig, compute_budget
from mlxhost.memory.capacity import KVCapacity
from mlxhost.memory.device import MemoryReadings
from mlxhost.memory.pressure import MemoryGovernor, limits_for

MIB = 1 << 20
GIB = 1 << 30
BS = 4
PER_TOKEN = 1 * MIB  # KV bytes per token: 1 MiB, so a block is 4 MiB
BLOCK = BS * PER_TOKEN


def readings(available: int) -> MemoryReadings:
    return MemoryReadings(total_ram=16 * GIB, available_ram=available, process_rss=1 * GIB,
                          working_set_hint=None, backend="cpu")


START = readings(4 * GIB)  # ceiling = 4 + 1 - 1 (reserve) = 4 GiB


def make(mode: str = "desktop", kv_override=None):
    cfg = BudgetConfig(mode=mode, vision_cache_bytes=0, memory_utilization=0.25)
    budget = compute_budget(START, 1 * GIB, 1 * GIB, cfg)  # rest 2 GiB: prefix 512 MiB, KV 1.5 GiB
    prefix = PrefixCacheManager(budget.prefix_cache // BLOCK, BS, "m")
    capacity = KVCapacity(limits_for(budget, PER_TOKEN, BLOCK, kv_override).kv_tokens)
    sched = Scheduler(EngineConfig(max_num_seqs=8, block_size=BS), 10_000, prefix, capacity)
    # No runner stores blocks here, and the requests share their first tokens: a newcomer would wait for the
    # running request's blocks for ever. These tests are about memory, not about sharing a prefill.
    sched.wait_for_inflight = False
    clock = [0.0]
    gov = MemoryGovernor(budget, PER_TOKEN, prefix, sched, block_bytes=BLOCK, kv_tokens_override=kv_override,
                         capacity=capacity, refresh_s=2.0, read=lambda: START, clock=lambda: clock[0])
    return budget, prefix, sched, gov, clock


def fill(prefix: PrefixCacheManager, num_blocks: int) -> list[tuple[int, ...]]:
    """Caches `num_blocks` one-block prompts, oldest first; returns their tokens."""
    prompts = []
    for i in range(num_blocks):
        tokens = tuple(range(i * BS, (i + 1) * BS))
        assert prefix.plan_store(tokens)
        prefix.finish_stores()
        prompts.append(tokens)
    return prompts


def cached(prefix: PrefixCacheManager, tokens) -> bool:
    return prefix.pool.cached.get(next(iter(prefix_hashes(prefix, tokens)))) is not None


def prefix_hashes(prefix, tokens):
    from mlxhost.kv.hashing import block_hashes

    return block_hashes(list(tokens), BS, model_key=prefix.model_key)


def request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(1000, 1000 + prompt_len)), SamplingParams(max_tokens=max_tokens))


def commit(sched: Scheduler, rid: str, num_tokens: int) -> Request:
    """Admits a running request that commits `num_tokens` of KV (prompt 36 + the rest as max_tokens)."""
    r = request(rid, 36, num_tokens - 36)
    sched.add_request(r)
    sched.schedule()
    assert rid in sched.running
    return r


def test_idle_budget_goes_first_and_costs_nothing():
    budget, prefix, sched, gov, _ = make()
    assert (prefix.pool.num_blocks, sched.kv_capacity_tokens) == (128, 1536)
    prompts = fill(prefix, 64)  # half the prefix share holds blocks
    commit(sched, "running", 200)
    # Another app takes 1 GiB of a roomy machine: idle KV headroom absorbs it, the cache is untouched.
    assert gov.refresh(readings(3 * GIB))
    assert gov.live.kv == budget.kv - GIB and gov.live.prefix_cache == budget.prefix_cache
    assert sched.kv_capacity_tokens == 512 and prefix.max_cached_blocks == 128
    # A bigger drop: all idle KV (1336 MiB above the 200 committed tokens), then 128 MiB of the
    # cache's empty room; its 64 blocks stay, but it may grow to 96 only.
    assert gov.refresh(readings(4 * GIB - 1336 * MIB - 128 * MIB))
    assert sched.kv_capacity_tokens == 200 and prefix.max_cached_blocks == 96
    assert prefix.pool.num_cached == 64 and all(cached(prefix, t) for t in prompts)


def test_under_real_pressure_prefix_blocks_go_first_lru_first():
    budget, prefix, sched, gov, _ = make()
    prompts = fill(prefix, 128)
    commit(sched, "running", 1536)  # every KV token committed, the cache full: nothing idle
    # Another app takes 256 MiB: the prefix cache halves, KV is untouched.
    assert gov.refresh(readings(4 * GIB - 256 * MIB))
    assert gov.live.prefix_cache == budget.prefix_cache - 256 * MIB and gov.live.kv == budget.kv
    assert prefix.pool.num_cached == 64 and prefix.max_cached_blocks == 64
    assert not cached(prefix, prompts[0]) and not cached(prefix, prompts[63])  # least recently used went
    assert cached(prefix, prompts[64]) and cached(prefix, prompts[-1])
    assert sched.kv_capacity_tokens == 1536
    # New stores stay under the cap: each evicts the LRU block instead of growing the cache.
    fill_more = tuple(range(10_000, 10_000 + BS))
    assert prefix.plan_store(fill_more)
    prefix.finish_stores()
    assert prefix.pool.num_cached == 64 and not cached(prefix, prompts[64]) and cached(prefix, fill_more)


def test_big_drop_empties_the_prefix_cache_then_lowers_kv_for_new_admissions_only():
    _, prefix, sched, gov, _ = make()
    fill(prefix, 128)
    running = commit(sched, "running", 700)
    # 1.5 GiB gone: idle KV (836 MiB), then the whole prefix cache (512 MiB), then 188 MiB of committed KV.
    gov.refresh(readings(4 * GIB - 1536 * MIB))
    assert gov.live.prefix_cache == 0 and prefix.pool.num_cached == 0
    assert sched.kv_capacity_tokens == 512
    assert sched.running == {"running": running}  # never killed
    sched.add_request(request("new", 100, 600))
    sched.schedule()
    assert sched.num_running == 1 and sched.num_waiting == 1  # 2 x 700 > 512: the newcomer waits
    # Memory comes back: KV and the prefix cache regrow to their start-up sizes.
    gov.refresh(START)
    assert sched.kv_capacity_tokens == 1536 and prefix.max_cached_blocks == 128
    sched.schedule()
    assert sched.num_running == 2  # 2 x 700 <= 1536
    assert len(fill(prefix, 128)) == 128 and prefix.pool.num_cached == 128


def test_blocks_held_by_running_requests_stay_the_cap_is_soft():
    _, prefix, sched, gov, _ = make()
    (tokens,) = fill(prefix, 1)
    commit(sched, "running", 1536)
    held = prefix.lookup("r", list(tokens) + [7])  # a running request attached the block
    assert len(held.block_ids) == 1
    gov.refresh(readings(3 * GIB))
    assert prefix.max_cached_blocks == 0
    assert prefix.pool.num_cached == 1  # still referenced: kept until the request releases it
    assert not prefix.plan_store(tuple(range(500, 500 + BS)))  # but nothing new is stored
    held.release()
    assert prefix.pool.num_cached == 0  # released past the cap: given back at once


def test_refresh_is_periodic_and_ignores_noise():
    _, prefix, sched, gov, clock = make()
    seen = []
    gov._read = lambda: seen.append(1) or readings(4 * GIB - 512 * MIB)
    assert not gov.maybe_refresh() and not seen  # not yet due
    clock[0] = 2.0
    assert gov.maybe_refresh() and len(seen) == 1
    assert not gov.maybe_refresh() and len(seen) == 1  # due again only 2 s later
    assert not gov.refresh(readings(4 * GIB - 512 * MIB - 10 * MIB))  # 10 MiB: noise
    assert gov.live.kv == gov.startup.kv - 512 * MIB  # nothing committed: idle KV gave it
    assert gov.status()["num_refreshes"] == 2 and gov.status()["num_changes"] == 1


def test_explicit_kv_budget_stays_fixed():
    _, prefix, sched, gov, _ = make(kv_override=600)
    gov.refresh(readings(2 * GIB))
    assert sched.kv_capacity_tokens == 600 and prefix.max_cached_blocks == 0


def test_dedicated_mode_does_not_follow_free_memory():
    budget, prefix, sched, gov, clock = make(mode="dedicated")
    clock[0] = 100.0
    assert gov.refresh_s == 0 and not gov.maybe_refresh()
    assert not gov.refresh(readings(1 * GIB))
    assert replace(gov.live, free_for_others=0) == replace(budget, free_for_others=0)
    assert sched.kv_capacity_tokens == budget.kv // PER_TOKEN


def test_the_vision_cache_gives_back_what_the_budget_takes():
    import mlx.core as mx

    from mlxhost.multimodal.vision_cache import VisionCache, VisionCacheEntry

    cfg = BudgetConfig(vision_cache_bytes=256 * MIB)
    budget = compute_budget(START, 1 * GIB, 1 * GIB, cfg)
    gov = MemoryGovernor(budget, PER_TOKEN, None, None, block_bytes=BLOCK, refresh_s=2.0, read=lambda: START)
    gov.vision_cache = VisionCache(budget.vision_cache)
    for key in "abcd":  # 64 MiB each: the cache is full
        gov.vision_cache.put(key, VisionCacheEntry({"features": mx.zeros((16 * MIB,), dtype=mx.float32)}))
    # Everything but weights and activations is needed elsewhere: KV goes first, then the vision cache.
    gov.refresh(readings(4 * GIB - 2 * GIB))
    assert gov.live.vision_cache < budget.vision_cache
    assert gov.vision_cache.max_bytes == gov.live.vision_cache
    assert gov.vision_cache.num_bytes <= gov.live.vision_cache


def test_snapshots_keep_their_share_of_the_prefix_memory_as_it_shrinks():
    from mlxhost.kv.store.snapshots import SnapshotStore

    budget, prefix, sched, gov, _ = make()
    snapshots = SnapshotStore(budget.prefix_cache // 4)  # the start-up share (kv/store/setup.py)
    gov.attach_snapshots(snapshots)
    assert gov.limits.prefix_blocks == (budget.prefix_cache - snapshots.max_bytes) // BLOCK
    for i in range(8):  # 16 MiB each: the 128 MiB share is full
        snapshots.put(bytes([i]), object(), 16 * MIB)
    snapshots.pin("resuming", bytes([0]))  # the oldest, but a request is about to resume from it
    commit(sched, "running", 1536)
    # Another app takes 256 MiB: the prefix memory halves, and the snapshots with it.
    assert gov.refresh(readings(4 * GIB - 256 * MIB))
    assert snapshots.max_bytes == gov.live.prefix_cache // 4 == 64 * MIB
    assert snapshots.nbytes <= 64 * MIB and bytes([0]) in snapshots and bytes([7]) in snapshots
    assert bytes([1]) not in snapshots  # least recently used went first
    assert gov.limits.prefix_blocks == (gov.live.prefix_cache - 64 * MIB) // BLOCK
    # The pressure passes: the share grows back.
    assert gov.refresh(START)
    assert snapshots.max_bytes == budget.prefix_cache // 4


def test_on_cuda_desktop_mode_keeps_the_start_up_budget(monkeypatch):
    """Free device memory on MLX-CUDA includes CUDA's pool of MLX's freed buffers: not followed there."""
    import mlxhost.engine.core as core_module

    config = EngineConfig(memory_refresh_s=2.0)
    monkeypatch.setattr(core_module, "is_cuda", lambda: True)
    assert core_module._memory_refresh_s(config, "desktop") == 0.0
    monkeypatch.setattr(core_module, "is_cuda", lambda: False)
    assert core_module._memory_refresh_s(config, "desktop") == 2.0
