"""`mlxserve bench prefix --shape` on a tiny sliding-window fixture: a multi-turn row with its hit, the
restore time reported beside it, and the same after a restart from the SSD tier."""

import json

from mlxserve.cli import make_parser


def test_prefix_bench_on_a_shape(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    args = make_parser().parse_args([
        "bench", "prefix", "--shape", "gemma3_text", "--prefix-tokens", "300", "--suffix-tokens", "8",
        "--answer-tokens", "4", "--block-size", "64", "--repeats", "1", "--decode-tokens", "4", "--ssd",
        "--output-json", str(out),
    ])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "built gemma3_text" in printed and "restore" in printed
    (row,) = json.loads(out.read_text())["rows"]
    assert row["hit_tokens"] == 256  # turn 1 (308 prompt tokens + its answer) minus the partial block
    assert row["restore_hit_ms"] > 0 and row["restore_ssd_ms"] > 0 and row["ssd_read_ms"] > 0
