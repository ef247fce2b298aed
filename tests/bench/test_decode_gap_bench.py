"""`mlxhost bench engine --long-prompt`: one timed round per target after its untimed ones, each with prompts of
its own, on an engine without its own warm-up; the gaps are counted only while the long prompt is in."""

from __future__ import annotations

import asyncio

from mlxhost.bench import decode_gap
from mlxhost.config import EngineConfig


def test_each_target_gets_its_untimed_rounds_then_one_timed_row(qwen3_model_dir, monkeypatch):
    seen = []
    real = decode_gap.run_gap_round

    async def spy(loaded, config, *args, tag="", **kwargs):
        seen.append((config.max_decode_gap_s, config.warmup, tag))
        return await real(loaded, config, *args, tag=tag, **kwargs)

    monkeypatch.setattr(decode_gap, "run_gap_round", spy)
    rows = asyncio.run(decode_gap.run_gap_bench(str(qwen3_model_dir), EngineConfig(max_num_seqs=4, warmup="auto"),
                                                [0.0, 0.5], num_streams=2, stream_prompt_tokens=16,
                                                long_prompt_tokens=300, warm_rounds=1))
    assert seen == [(0.0, "off", "warm0-"), (0.0, "off", ""), (0.5, "off", "warm0-"), (0.5, "off", "")]
    assert [r["max_decode_gap_s"] for r in rows] == [0.0, 0.5]
    for row in rows:
        assert row["num_gaps"] > 0 and row["gap_max_s"] >= row["gap_p50_s"] > 0
        assert row["long_prompt_tokens"] > 250
