"""`mlxserve bench decode` on the tiny fixture model: every layer of the stack gets its row, the core loop
on a thread of its own among them, with a rate and a ratio to mlx-lm's `generate_step`."""

from __future__ import annotations

import json

from mlxserve.bench.decode import add_arguments, run


def test_every_path_gets_a_row(qwen3_model_dir, tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "decode.json"
    args = parser.parse_args(["--model", str(qwen3_model_dir), "--max-tokens", "8", "--prompt-tokens", "16",
                              "--repeat", "1", "--output-json", str(out)])
    assert run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["path"] for r in rows] == ["mlx-lm generate_step", "engine core loop", "engine core loop (own thread)",
                                         "async engine (engine thread + asyncio)"]
    assert all(r["tok_s"] > 0 and r["ratio"] > 0 and r["step_p50_ms"] > 0 for r in rows)
    assert "engine core loop (own thread)" in capsys.readouterr().out
