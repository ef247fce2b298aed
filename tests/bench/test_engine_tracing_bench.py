"""`mlxhost bench engine --tracing`: the A/B runs each level untraced, traced, traced, untraced on one engine,
one row per mode, and the traced requests leave the server's spans in memory (no collector)."""

from __future__ import annotations

import asyncio

from mlxhost.bench.engine import run_engine_bench
from mlxhost.bench.serve import ServeBenchConfig
from mlxhost.config import EngineConfig

SPANS_PER_REQUEST = 6  # server, chat/text_completion, queue, prefix_cache.lookup, prefill, decode


def test_the_tracing_ab_labels_its_rows_and_traces_only_the_on_rows(qwen3_model_dir):
    cfg = ServeBenchConfig(url="http://in-process", model="tiny", concurrency=[2], prompt_tokens=16, max_tokens=4,
                           num_requests=2)
    result = asyncio.run(run_engine_bench(cfg, str(qwen3_model_dir), EngineConfig(max_num_seqs=4), tracing="ab"))
    rows = result["levels"]
    assert [(r["tracing"], r["concurrency"], r["num_requests"], r["num_errors"]) for r in rows] == \
        [("off", 2, 4, 0), ("on", 2, 4, 0)]  # two rounds of 2 requests each
    assert result["num_spans"] == (1 + 4) * SPANS_PER_REQUEST  # the traced warm-up and rounds: every span kept


def test_tracing_off_has_no_tracing_column_nor_spans(qwen3_model_dir):
    cfg = ServeBenchConfig(url="http://in-process", model="tiny", concurrency=[1], prompt_tokens=16, max_tokens=2,
                           num_requests=1)
    result = asyncio.run(run_engine_bench(cfg, str(qwen3_model_dir), EngineConfig(max_num_seqs=2)))
    assert "tracing" not in result["levels"][0] and "num_spans" not in result
