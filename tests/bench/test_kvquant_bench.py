"""`mlxhost bench kvquant` at a very small size on the tiny fixture (float32 KV, head_dim 32): the table is
printed, the JSON written, and the capacity follows the bytes per token (float32 KV: 1024 bytes a token,
8-bit 320, 4-bit 192 with group 32), measured and by admission."""

import json

from mlxhost.server.cli import make_parser


def test_kvquant_bench_small(qwen3_model_dir, tmp_path, capsys):
    out = tmp_path / "kvquant.json"
    args = make_parser().parse_args([
        "bench", "kvquant", "--model", str(qwen3_model_dir), "--kv-group-size", "32", "--concurrency", "4",
        "--prompt-tokens", "16", "--max-tokens", "8", "--context-tokens", "300", "--num-contexts", "2",
        "--kv-memory-gb", "1", "--output-json", str(out),
    ])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "contexts (admission)" in printed and "4-bit" in printed
    assert "8-bit: 2/2 layers quantized, quantized attention" in printed  # the CPU runs the quantized kernels
    rows = {r["kv"]: r for r in json.loads(out.read_text())["rows"]}
    assert [rows[k]["bytes_per_token"] for k in ("float", "8-bit", "4-bit")] == [1024, 320, 192]
    assert all(r["num_tokens"] == 4 * 8 and r["agg_tok_s"] > 0 for r in rows.values())
    assert rows["float"]["same_as_float"] == 1.0
    assert [rows[k]["attention"] for k in ("float", "8-bit", "4-bit")] == [None] + ["quantized attention"] * 2
    assert rows["float"]["contexts_admitted"] == (1 << 30) // (1024 * 300)
    assert rows["8-bit"]["capacity_vs_float"] >= 3.0 and rows["4-bit"]["capacity_vs_float"] >= 5.0
    # Measured: the batch really holds fewer bytes per context (2 x 300 tokens, buffers in 256-token steps).
    assert rows["float"]["measured_mib_per_context"] > 2.5 * rows["8-bit"]["measured_mib_per_context"] > 0
    assert rows["8-bit"]["measured_mib_per_context"] > rows["4-bit"]["measured_mib_per_context"] > 0
