"""Every engine core implements engine/contract.py's Core for real: the text core, a distributed server's rank-0
core (one rank), an encoder's and an audio model's, each built from a tiny fixture. The text cores are built by
the assembler (engine/assemble.py), as a server builds them."""

from __future__ import annotations

import functools

import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.assemble import assemble_core
from mlxhost.engine.contract import Core, CoreStats
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model

CONFIG = EngineConfig(max_num_seqs=4, block_size=16, prefill_step_size=32, memory_mode="dedicated", warmup="off")
CORES = ["engine", "distributed", "encoder", "audio"]


class _SoloChannel:
    """Rank 0 of a world of one: a broadcast reaches nobody, a gather hears only itself."""

    rank, size = 0, 1

    def broadcast(self, obj=None):
        return obj

    def broadcast_last(self, obj) -> None:
        pass

    def gather(self, obj):
        return [obj]


class _Supervisor:
    def __init__(self) -> None:
        self.steps = 0
        self.closed = False

    def step_started(self, what: str) -> None:
        self.steps += 1

    def step_done(self) -> None:
        pass

    def dead_rank(self, wait_s: float = 0.0):
        return None

    def fatal(self, reason: str) -> None:
        raise AssertionError(reason)

    def closing(self) -> None:
        self.closed = True


def _build(kind: str, qwen3_model_dir, tmp_path_factory):
    """(core, whether it runs generation requests)."""
    if kind in ("engine", "distributed"):
        loaded = load_model(str(qwen3_model_dir))
        make = None
        if kind == "distributed":
            from mlxhost.distributed.config import DistributedConfig
            from mlxhost.distributed.engine import DistributedEngineCore, RankContext

            ctx = RankContext(DistributedConfig(tensor_parallel=1), _SoloChannel(), seed=0, supervisor=_Supervisor())
            make = functools.partial(DistributedEngineCore, ctx=ctx)
        built = assemble_core(loaded.model, loaded.tokenizer, CONFIG, 256, model_key="contract", make_core=make)
        assert built.warmup is None  # --warmup off
        return built.core, True
    if kind == "encoder":
        from mlxhost.engine.encoder import EncoderCore
        from mlxhost.testing.encoder_demo import build_encoder_folder

        loaded = load_model(str(build_encoder_folder(tmp_path_factory.mktemp("encoder"))))
        return EncoderCore(loaded.model, CONFIG), False
    from mlxhost.audio.engine import AudioCore
    from mlxhost.testing.audio_fixtures import build_tiny_whisper

    loaded = load_model(str(build_tiny_whisper(tmp_path_factory.mktemp("whisper"))))
    return AudioCore(loaded.model, CONFIG), False


def _request(rid: str, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(3, 40)), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("kind", CORES)
def test_every_core_implements_the_contract(kind, qwen3_model_dir, tmp_path_factory):
    core, generates = _build(kind, qwen3_model_dir, tmp_path_factory)
    assert isinstance(core, Core)
    assert not core.has_work and core.step() == []
    stats = core.stats()
    assert isinstance(stats, CoreStats) and (stats.num_running, stats.num_waiting) == (0, 0)
    status = core.status()
    assert status["num_running"] == 0 and isinstance(status["prefix_cache"], dict)
    assert core.adapters() == {}  # none loaded (or none it could take)
    if generates:
        core.add(_request("gone", max_tokens=50))
        assert core.has_work and core.stats().num_waiting + core.stats().num_running == 1
        core.step()
        assert core.stats().num_running == 1 and core.stats().last_step is not None
        assert [r["id"] for r in core.status()["requests"]] == ["gone"]
        core.abort("gone")
        assert core.stats().num_running == 0
        assert core.step() == []  # the step that frees its rows says nothing of it
        assert not core.has_work
        core.add(_request("kept"))
        outputs = []
        while core.has_work:
            outputs += core.step()
        assert outputs[-1].request_id == "kept" and outputs[-1].finished
        assert sum(len(o.new_token_ids) for o in outputs) == 4
        assert core.stats().last_step.num_decoding >= 0 and core.stats().kv_capacity_tokens
        assert core.status()["prefix_cache"]["enabled"] and core.stats().prefix_cached_blocks > 0
    else:
        with pytest.raises(ValueError, match="cannot generate text"):
            core.add(_request("refused"))
        core.abort("refused")  # nothing held: a no-op, as for a request that already ended
        assert not core.has_work and core.stats() == CoreStats()
    core.on_idle()
    cleared = core.clear_cache()
    assert isinstance(cleared, int) and cleared >= 0
    if generates:
        assert cleared > 0 and core.stats().prefix_cached_blocks == 0
    core.close()


@pytest.mark.parametrize("kind", CORES)
def test_the_engine_loop_drives_every_core_through_the_contract(kind, qwen3_model_dir, tmp_path_factory):
    import asyncio

    from mlxhost.engine.loop import Assembled, AsyncEngine

    core, generates = _build(kind, qwen3_model_dir, tmp_path_factory)
    engine = AsyncEngine(lambda: Assembled(core), max_num_waiting=4)

    async def main():
        engine.start(asyncio.get_running_loop())
        assert engine.snapshot.cache_stats == engine.snapshot.status["prefix_cache"]
        outputs = [o async for o in engine.generate(_request("r"))]
        assert outputs[-1].finished
        if generates:
            assert outputs[-1].error is None and sum(len(o.new_token_ids) for o in outputs) == 4
            assert engine.stats.last_step is not None and engine.kv_capacity_tokens
        else:
            assert "cannot generate text" in outputs[-1].error  # the core's refusal, as the request's error
        assert await engine.call(lambda c: c.adapters()) == {}

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_the_assembler_loads_the_adapters_and_hands_the_warmup_over(qwen3_model_dir, tmp_path):
    import dataclasses

    from mlxhost.config import LoraSpec
    from mlxhost.engine.warmup import BackgroundWarmup
    from mlxhost.testing.lora_fixtures import random_adapter

    loaded = load_model(str(qwen3_model_dir))
    folder = random_adapter(qwen3_model_dir, tmp_path / "adapter", rank=4, keys=("mlp.down_proj",))
    config = dataclasses.replace(CONFIG, warmup="background")
    built = assemble_core(loaded.model, loaded.tokenizer, config, 256, loras=(LoraSpec("ada", str(folder)),))
    try:
        assert [aid.split("@")[0] for aid in built.core.adapters()] == ["ada"]
        # Handed to the engine loop, which runs it between requests: nothing of it has run yet.
        assert isinstance(built.warmup, BackgroundWarmup) and not built.warmup.finished
        assert not built.core.has_work and built.warmup.report.num_steps == 0
    finally:
        built.warmup.close()
    ran = assemble_core(loaded.model, loaded.tokenizer, dataclasses.replace(CONFIG, warmup="on"), 256)
    assert ran.warmup is None and not ran.core.has_work  # run to its end before serving
    assert ran.core.stats().prefix_cached_blocks == 0  # and its blocks dropped
