"""`mlxhost bench distributed` without servers: its shapes, layouts, log reading and the row of one run."""

import argparse

import pytest

from mlxhost.bench.distributed import parse_layout, row, shapes, step_stats, table_columns
from mlxhost.bench.report import format_table


def test_qwen3_32b_shape():
    s = shapes()["qwen3-32b"]
    assert (s.hidden_size, s.num_hidden_layers, s.num_attention_heads, s.num_key_value_heads,
            s.intermediate_size, s.head_dim) == (5120, 64, 64, 8, 25600, 128)


def test_layouts():
    assert parse_layout("1") == (1, 1)
    assert parse_layout("tp2") == (2, 1)
    assert parse_layout("pp4") == (1, 4)
    for bad in ("2", "dp2", "tp", "tp0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_layout(bad)


def test_step_stats_read_warm_up_and_slow_steps():
    log = ("INFO warm-up finished 8.4 s after it started (tiled-kernel helper: done, piece helper: done)\n"
           "WARNING slow engine step: 1.52 s with 16 running\nWARNING slow engine step: 3.10 s with 2 running\n")
    assert step_stats(log) == {"num_slow_steps": 2, "max_slow_step_s": 3.1, "warmup_s": 8.4}
    assert step_stats("") == {"num_slow_steps": 0, "max_slow_step_s": None, "warmup_s": None}


def test_row_has_each_level_and_compares_greedy_output():
    level = lambda c, tok_s, errors=0: {"concurrency": c, "agg_tok_s": tok_s, "num_errors": errors}  # noqa: E731
    result = {"ready_s": 40.0, "greedy": ["a", "b"], "levels": [level(1, 50.0), level(16, 400.0, 1)],
              "steps": {"num_slow_steps": 0, "warmup_s": 9.0}}
    r = row("qwen3-8b", "tp2", result, reference=["a", "b"])
    assert (r["c1_tok_s"], r["c16_tok_s"], r["num_errors"], r["greedy_same"]) == (50.0, 400.0, 1, True)
    assert row("qwen3-8b", "tp2", result, reference=["a", "c"])["greedy_same"] is False
    assert row("qwen3-8b", "1", result, reference=["a", "b"])["greedy_same"] is None
    assert "qwen3-8b" in format_table([r], table_columns([1, 16]))
