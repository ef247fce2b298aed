"""`mlxserve bench distributed` without servers: its shapes and the row it makes of one run."""

from mlxserve.bench.distributed import TABLE_COLUMNS, row, shapes
from mlxserve.bench.report import format_table


def test_qwen3_32b_shape():
    s = shapes()["qwen3-32b"]
    assert (s.hidden_size, s.num_hidden_layers, s.num_attention_heads, s.num_key_value_heads,
            s.intermediate_size, s.head_dim) == (5120, 64, 64, 8, 25600, 128)


def test_row_takes_first_and_last_level_and_the_long_prompt():
    level = lambda c, tok_s, errors=0: {"concurrency": c, "agg_tok_s": tok_s, "num_errors": errors}  # noqa: E731
    result = {"levels": [level(1, 50.0), level(16, 400.0, 1)],
              "long": {"ttft_p50_ms": 900.0, "mean_prompt_tokens": 4100.4, "num_errors": 0}}
    r = row("qwen3-8b", 2, "nccl", result)
    assert (r["agg_tok_s_c1"], r["agg_tok_s_cmax"], r["cmax"], r["ttft_long_ms"]) == (50.0, 400.0, 16, 900.0)
    assert r["long_prompt_tokens"] == 4100 and r["num_errors"] == 1
    assert row("qwen3-8b", 1, "nccl", result)["backend"] == "-"
    assert "qwen3-8b" in format_table([r], TABLE_COLUMNS)
