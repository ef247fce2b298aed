"""`mlxhost bench batch`'s pieces on the tiny fixture model, no subprocess: the batch it submits is valid for the
Batch API and runs to the end, and its table has a row per phase."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from mlxhost.bench.batch import COLUMNS, batch_lines, batch_state, interactive_row, start_batch, wait_for
from mlxhost.bench.report import format_table
from mlxhost.config import EngineConfig, ServerConfig
from mlxhost.server.app import build_app


def test_the_lines_have_prompts_of_their_own():
    lines = [json.loads(line) for line in batch_lines("bench", 3, 32, 4, seed=0).decode().splitlines()]
    assert [line["custom_id"] for line in lines] == ["line-0", "line-1", "line-2"]
    assert {line["url"] for line in lines} == {"/v1/completions"}
    # The line's index leads its prompt (bench serve's make_prompt): no two share a first block.
    assert [line["body"]["prompt"].split(":")[0] for line in lines] == [f"Request batch.{i}" for i in range(3)]
    assert all(line["body"]["max_tokens"] == 4 and line["body"]["model"] == "bench" for line in lines)


def test_the_batch_it_submits_runs_to_the_end(qwen3_model_dir, tmp_path):
    config = ServerConfig(model=str(qwen3_model_dir), served_model_name="bench", batch_dir=str(tmp_path),
                          engine=EngineConfig(max_num_seqs=4))
    with TestClient(build_app(config), base_url="http://127.0.0.1") as client:  # a loopback Host
        batch_id = start_batch(client, batch_lines("bench", 3, 32, 4, seed=0))
        status, num_done = wait_for(client, batch_id, lambda s, n: s == "completed", timeout_s=120)
        assert (status, num_done) == ("completed", 3) and batch_state(client, batch_id) == ("completed", 3)


def test_a_row_per_phase():
    level = {"num_requests": 4, "ttft_p50_ms": 8.0, "ttft_p99_ms": 9.0, "num_errors": 0, "agg_tok_s": 1.0}
    rows = [interactive_row("idle", level, None), interactive_row("during batch", level, 2)]
    assert "agg_tok_s" not in rows[0] and rows[1]["batch_lines_done"] == 2
    assert [line.split()[0] for line in format_table(rows, COLUMNS).splitlines()[2:]] == ["idle", "during"]
