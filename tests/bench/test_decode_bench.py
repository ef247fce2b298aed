"""`mlxhost bench decode` on the tiny fixture model: every layer of the stack gets its row, the core loop
on a thread of its own among them, with a rate and a ratio to mlx-lm's `generate_step`."""

from __future__ import annotations

import json

from mlxhost.bench.decode import add_arguments, run
from tests.bench.test_serve_bench import fake_server  # noqa: F401  (a fake SSE server on 127.0.0.1, as a fixture)


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


def test_served_rows_interleave_with_the_reference(qwen3_model_dir, fake_server, tmp_path, capsys):  # noqa: F811
    """`--url`: each round times the reference and one stream from the server (a fake SSE server here: its
    5 content events carry 6 tokens) back to back, raw first in even rounds and served first in odd ones,
    and the JSON keeps every round's served/raw ratio and order."""
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    url, received = fake_server
    received.clear()
    out = tmp_path / "decode.json"
    args = parser.parse_args(["--model", str(qwen3_model_dir), "--max-tokens", "16", "--prompt-tokens", "16",
                              "--repeat", "3", "--paths", "raw", "--url", url, "--served-model", "m",
                              "--output-json", str(out)])
    assert run(args) == 0
    result = json.loads(out.read_text())
    raw, served_path = "mlx-lm generate_step", "served over HTTP (served)"
    assert [r["path"] for r in result["rows"]] == [raw, served_path, served_path, raw, raw, served_path]
    served = result["served"]
    assert served["round_orders"] == [["raw", "served"], ["served", "raw"], ["raw", "served"]]
    assert len(served["round_ratios"]) == 3 and all(x > 0 for x in served["round_ratios"])
    # Each round sends a short untimed request right before the timed one, which asks for --max-tokens.
    assert [b["max_tokens"] for b in received] == [8, 16] * 3 and {b["model"] for b in received} == {"m"}
    assert "per round" in capsys.readouterr().out


def test_unknown_paths_are_refused(tmp_path):
    import argparse

    import pytest

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="--paths takes some of raw, core, thread, async; got warp"):
        run(parser.parse_args(["--paths", "raw,warp", "--output-json", str(tmp_path / "x.json")]))


def test_host_table_has_a_row_per_requested_path(qwen3_model_dir, tmp_path, capsys, monkeypatch):
    """`--host-table`: raw shows only its step time; the core, thread and async paths each get every phase's
    median over their decode steps (the async path's read from its engine thread's step trace), a step and
    the consumer's gap. A step trace the caller set up is left as it was."""
    import argparse
    import os

    from mlxhost.engine.loop import STEP_TRACE_ENV

    monkeypatch.delenv(STEP_TRACE_ENV, raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "decode.json"
    args = parser.parse_args(["--model", str(qwen3_model_dir), "--max-tokens", "8", "--prompt-tokens", "16",
                              "--repeat", "1", "--paths", "raw,core,thread,async", "--host-table",
                              "--output-json", str(out)])
    assert run(args) == 0
    table = {r["path"]: r for r in json.loads(out.read_text())["host_table"]}
    assert list(table) == ["raw", "core", "thread", "async"]
    assert table["raw"]["step_us"] > 0 and table["raw"]["schedule_us"] is None
    for path in ("core", "thread", "async"):
        row = table[path]
        assert row["num_steps"] > 0, path
        # Every phase has its median (the async path's read from a trace written to the microsecond, where a
        # fast host's shortest phases may read 0).
        assert all(row[f"{p}_us"] >= 0 for p in ("schedule", "runner", "sample", "launch", "readback", "detok",
                                                  "update", "output")), row
        assert row["step_us"] > 0 and row["gap_us"] > 0, row
        assert row["handoff_us"] is not None
    assert STEP_TRACE_ENV not in os.environ
    assert "host time per decode step" in capsys.readouterr().out


def test_host_table_covers_only_the_paths_asked_for(qwen3_model_dir, tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "decode.json"
    args = parser.parse_args(["--model", str(qwen3_model_dir), "--max-tokens", "8", "--prompt-tokens", "16",
                              "--repeat", "1", "--paths", "raw,core", "--host-table", "--output-json", str(out)])
    assert run(args) == 0
    assert [r["path"] for r in json.loads(out.read_text())["host_table"]] == ["raw", "core"]
