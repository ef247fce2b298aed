"""`mlxhost bench engine --long-prompt`: one engine for every target, its warm-up waited for, each target's untimed
rounds before its timed one, every round with prompts of its own; gaps are counted only while the long prompt is in."""

from __future__ import annotations

import asyncio

import pytest

from mlxhost.bench import decode_gap
from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.scheduler import Scheduler
from mlxhost.memory.capacity import KVCapacity
from mlxhost.models.loader import load_model


def test_each_target_gets_its_untimed_rounds_then_one_timed_row_on_one_engine(qwen3_model_dir, monkeypatch):
    rounds, targets, engines = [], [], set()
    real_round, real_set = decode_gap.run_gap_round, decode_gap._set_target

    async def spy_round(engine, loaded, *args, tag="", **kwargs):
        engines.add(id(engine))
        rounds.append(tag)
        return await real_round(engine, loaded, *args, tag=tag, **kwargs)

    def spy_set(core, seconds):
        targets.append(seconds)
        real_set(core, seconds)
        assert core.scheduler.step_cost.max_decode_gap_s == seconds

    monkeypatch.setattr(decode_gap, "run_gap_round", spy_round)
    monkeypatch.setattr(decode_gap, "_set_target", spy_set)
    # 64-token chunks: the long prompt takes several steps, so every round sees gaps.
    config = EngineConfig(max_num_seqs=4, prefill_step_size=64)
    rows = asyncio.run(decode_gap.run_gap_bench(str(qwen3_model_dir), config, [0.0, 0.5], num_streams=2,
                                                stream_prompt_tokens=16, long_prompt_tokens=300, warm_rounds=1))
    assert rounds == ["t0w0-", "t0-", "t1w0-", "t1-"] and len(engines) == 1
    assert targets == [0.0, 0.5]
    assert [r["max_decode_gap_s"] for r in rows] == [0.0, 0.5]
    for row in rows:
        assert row["num_gaps"] > 0 and row["gap_max_s"] >= row["gap_p50_s"] > 0
        assert row["long_prompt_tokens"] > 250


def test_the_async_engine_says_while_its_background_warm_up_runs(qwen3_model_dir):
    from mlxhost.server.app import make_engine, resolve_max_model_len

    async def main():
        loaded = load_model(str(qwen3_model_dir))
        config = EngineConfig(max_num_seqs=2, warmup="background")
        engine = make_engine(loaded, config, resolve_max_model_len(loaded, config))
        engine.start(asyncio.get_running_loop())
        try:
            assert engine.warmup_running  # from the moment start() returns
            for _ in range(600):
                if not engine.warmup_running:
                    break
                await asyncio.sleep(0.05)
            assert not engine.warmup_running
        finally:
            engine.stop()
        off = make_engine(loaded, EngineConfig(max_num_seqs=2, warmup="off"), 512)
        off.start(asyncio.get_running_loop())
        try:
            assert not off.warmup_running
        finally:
            off.stop()

    asyncio.run(main())


@pytest.mark.parametrize("streams,long_prompt", [(8, 16384), (3, 500)])
def test_the_streams_and_the_long_prompt_are_all_admitted_under_the_kv_the_engine_holds(streams, long_prompt):
    # Eight 8B streams asking 100k tokens each on an 80 GB card (323,840 KV tokens): five waited for good, and
    # the round never started. The bench now asks for what lets every row in at once.
    capacity, stream_prompt = 323_840, 64
    max_tokens = decode_gap.stream_max_tokens(capacity, streams, stream_prompt, long_prompt, max_num_seqs=16)
    assert long_prompt + decode_gap.STREAM_MARGIN_TOKENS <= max_tokens <= decode_gap.MAX_STREAM_TOKENS
    sched = Scheduler(EngineConfig(max_num_seqs=16), max_model_len=200_000, kv_capacity=KVCapacity(capacity))
    for i in range(streams):
        sched.add_request(Request(f"s{i}", list(range(stream_prompt + 3)), SamplingParams(max_tokens=max_tokens),
                                  eos_token_ids=frozenset({0})))
    sched.add_request(Request("long", list(range(long_prompt + 20)), SamplingParams(max_tokens=1),
                              eos_token_ids=frozenset({0})))
    sched.schedule()
    assert len(sched.running) == streams + 1 and not sched.waiting
    assert decode_gap.stream_max_tokens(None, streams, stream_prompt, long_prompt) == decode_gap.MAX_STREAM_TOKENS


@pytest.mark.parametrize("capacity,max_num_seqs,prealloc,what", [
    (100_000, 64, 0, "fewer streams or a shorter prompt"),  # the KV holds too few tokens a row
    (323_840, 64, 40_000, "fewer streams or a shorter prompt"),  # --kv-prealloc rows longer than fit
    (323_840, 8, 0, "a larger --max-num-seqs"),  # eight streams and the long prompt need nine slots
])
def test_a_round_the_engine_cannot_hold_at_once_is_an_error_naming_what_to_change(capacity, max_num_seqs, prealloc,
                                                                                  what):
    with pytest.raises(ValueError, match=what):
        decode_gap.stream_max_tokens(capacity, 8, 64, 16384, max_num_seqs=max_num_seqs, kv_prealloc_tokens=prealloc)


def test_a_round_whose_streams_cannot_all_start_ends_with_an_error_instead_of_waiting(qwen3_model_dir, monkeypatch):
    from mlxhost.server.app import make_engine, resolve_max_model_len

    monkeypatch.setattr(decode_gap, "START_TIMEOUT_S", 3.0)

    async def main():
        loaded = load_model(str(qwen3_model_dir))
        config = EngineConfig(max_num_seqs=1, warmup="off")  # one slot: the second stream is never admitted
        engine = make_engine(loaded, config, resolve_max_model_len(loaded, config))
        engine.start(asyncio.get_running_loop())
        try:
            with pytest.raises(RuntimeError, match="only 1 of 2 streams had their first token within 3 s"):
                await decode_gap.run_gap_round(engine, loaded, 2, 16, 100, seed=0)
        finally:
            engine.stop()

    asyncio.run(main())
