"""The prefix cache's physical work travels in the step plan: `schedule()` reaches nothing of the block store,
SSD hits are loaded by the plan when the runner's step starts, and a load that fails costs only its request a
recompute. On the tiny fixture model, greedy tokens checked against mlx-lm's own `generate_step`."""

from __future__ import annotations

from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request
from mlxhost.kv.cache_ops import LoadBlock
from mlxhost.kv.hashing import block_hashes, disk_key
from mlxhost.kv.store.kv_store import KVBlockStore
from mlxhost.kv.store.ssd_format import BLOCK_SUFFIX
from tests.engine.test_prefix_engine import BS, drain, greedy, loaded, make_core, one, reference, tokens  # noqa: F401

MODEL_KEY = "qwen3-fixture"


class GuardedStore(KVBlockStore):
    """A block store that fails the test if anything of it is reached while the scheduler schedules."""

    scheduling = False

    def __getattribute__(self, name):
        if GuardedStore.scheduling and not name.startswith("__"):
            raise AssertionError(f"schedule() reached the block store ({name})")
        return super().__getattribute__(name)


class GuardedCore(EngineCore):
    store_cls = GuardedStore


def guarded_core(loaded, **kw) -> tuple[EngineCore, list]:  # noqa: F811
    """A core whose every `schedule()` runs with the store guarded; returns it and the plans it made."""
    base = make_core(loaded, **kw)
    core = GuardedCore(loaded.model, loaded.tokenizer, base.config, max_model_len=4096, model_key=MODEL_KEY)
    base.close()
    schedule, plans = core.scheduler.schedule, []

    def guarded():
        GuardedStore.scheduling = True
        try:
            plans.append(schedule())
        finally:
            GuardedStore.scheduling = False
        return plans[-1]

    core.scheduler.schedule = guarded
    return core, plans


def stored_on_disk(loaded, ssd_dir, *prompts) -> None:  # noqa: F811
    core = make_core(loaded, ssd_cache_dir=str(ssd_dir))
    for prompt in prompts:
        one(core, prompt)
    core.close()  # the last step's blocks are written on shutdown


def test_schedule_reaches_no_store_and_ssd_hits_load_through_the_plan(loaded, reference, tmp_path):  # noqa: F811
    prompt = tokens(70, 2 * BS + 1)
    stored_on_disk(loaded, tmp_path, prompt)
    core, plans = guarded_core(loaded, ssd_cache_dir=str(tmp_path))
    assert isinstance(core.runner.store, GuardedStore)
    assert one(core, prompt) == {"ids": reference(prompt), "cached": 2 * BS}
    loads = [op for plan in plans for op in plan.cache_ops if isinstance(op, LoadBlock)]
    assert [op.block_hash for op in loads] == block_hashes(prompt, BS, model_key=MODEL_KEY)[:2]
    assert core.cache_stats()["ssd"]["hits"] == 2
    # The loads' step ran no prefill: the request started after them, from the loaded blocks.
    first = next(i for i, plan in enumerate(plans) if plan.cache_ops)
    assert not plans[first].prefill_chunks and plans[first + 1].prefill_chunks[0].start == 2 * BS
    core.close()


def test_a_failed_ssd_load_recomputes_that_request_only(loaded, reference, tmp_path):  # noqa: F811
    broken, intact = tokens(71, 2 * BS + 1), tokens(72, 2 * BS + 1)
    stored_on_disk(loaded, tmp_path, broken, intact)
    # The second block of `broken` is on disk (the index lists it) but unreadable.
    (tmp_path / (disk_key(block_hashes(broken, BS, model_key=MODEL_KEY)[1]) + BLOCK_SUFFIX)).write_bytes(b"garbage")
    core, plans = guarded_core(loaded, ssd_cache_dir=str(tmp_path))
    core.add_request(Request("broken", broken, greedy()))
    core.add_request(Request("intact", intact, greedy()))
    out = drain(core)
    # Identical to a run without any cache; the broken request computes from its first bad block on.
    assert out["broken"] == {"ids": reference(broken), "cached": BS}
    assert out["intact"] == {"ids": reference(intact), "cached": 2 * BS}
    assert core.scheduler.prefix.pool.num_used == 0
    # The recompute stored the block again: now a whole memory hit.
    assert one(core, broken) == {"ids": reference(broken), "cached": 2 * BS}
    core.close()
