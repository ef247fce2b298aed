"""tools/pool_serve.py: the compare step's serve results pooled over each server's starts (tokens over
wall seconds summed across starts), with mlxhost's pooled aggregate over each other server's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "pool_serve.py"


@pytest.fixture(scope="module")
def pool_serve():
    spec = importlib.util.spec_from_file_location("pool_serve", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(out: Path, name: str, levels: list[tuple[int, int, float, int]]) -> None:
    """levels: (concurrency, completion tokens, wall seconds, errors), as `bench serve` writes them."""
    keys = ("concurrency", "num_completion_tokens", "wall_s", "num_errors")
    (out / name).write_text(json.dumps({"levels": [dict(zip(keys, level)) for level in levels]}))


def test_starts_pool_per_server_and_level(pool_serve, tmp_path, capsys):
    _write(tmp_path, "serve-mlxhost-qwen3-0.6b.json", [(1, 256, 2.0, 0), (16, 4096, 4.0, 0)])
    _write(tmp_path, "serve-mlxhost-qwen3-0.6b-2.json", [(1, 256, 1.0, 0), (16, 4096, 6.0, 1)])
    _write(tmp_path, "serve-vllm_mlx-qwen3-0.6b.json", [(1, 300, 3.0, 0)])  # cut after its first level
    _write(tmp_path, "serve-mlxhost-qwen3-8b.json", [(1, 1, 100.0, 0)])  # another shape: not pooled

    assert pool_serve.main([str(tmp_path), "qwen3-0.6b"]) == 0
    result = json.loads((tmp_path / "pooled-qwen3-0.6b.json").read_text())
    assert result["files"] == {"mlxhost": ["serve-mlxhost-qwen3-0.6b.json", "serve-mlxhost-qwen3-0.6b-2.json"],
                               "vllm_mlx": ["serve-vllm_mlx-qwen3-0.6b.json"]}
    rows = {(r["server"], r["concurrency"]): r for r in result["levels"]}
    assert set(rows) == {("mlxhost", 1), ("vllm_mlx", 1), ("mlxhost", 16)}

    m1 = rows["mlxhost", 1]
    assert m1["num_starts"] == 2 and m1["num_completion_tokens"] == 512 and m1["wall_s"] == 3.0
    assert m1["agg_tok_s"] == pytest.approx(512 / 3)  # not the mean of the starts' 128 and 256
    assert m1["start_agg_tok_s"] == [128.0, 256.0] and m1["mlxhost_ratio"] is None
    assert rows["vllm_mlx", 1]["agg_tok_s"] == pytest.approx(100.0)
    assert rows["vllm_mlx", 1]["mlxhost_ratio"] == pytest.approx(512 / 3 / 100)
    assert rows["mlxhost", 16]["agg_tok_s"] == pytest.approx(819.2) and rows["mlxhost", 16]["num_errors"] == 1

    table = capsys.readouterr().out
    assert "| vllm_mlx | 1 | 1 | 300 | 3.00 | 100.0 | 100.0 | 0 | 1.707x | - | - | - |" in table


def test_ttft_percentiles_pool_every_request_and_the_first_wave(pool_serve, tmp_path, capsys):
    def level(ttfts):  # c=2: the first two requests are the opening wave; a failed request has no TTFT
        return {"concurrency": 2, "num_completion_tokens": 10, "wall_s": 1.0, "num_errors": 0,
                "requests": [{"ttft_s": t} for t in ttfts]}

    (tmp_path / "serve-mlxhost-k.json").write_text(json.dumps({"levels": [level([1.0, 3.0, 0.1, 0.1])]}))
    (tmp_path / "serve-mlxhost-k-2.json").write_text(json.dumps({"levels": [level([2.0, None, 0.1, 0.2])]}))
    assert pool_serve.main([str(tmp_path), "k"]) == 0
    (row,) = json.loads((tmp_path / "pooled-k.json").read_text())["levels"]
    assert row["first_wave_ttft_p50_ms"] == pytest.approx(2000.0)  # of 1.0, 3.0 and 2.0 s
    assert row["ttft_p50_ms"] == pytest.approx(200.0)  # of all seven: 0.1 0.1 0.1 0.2 1 2 3
    assert row["ttft_p99_ms"] == pytest.approx(2940.0)  # numpy's interpolation between 2 and 3 s
    assert "| mlxhost | 2 | 2 | 20 | 2.00 | 10.0 | 10.0, 10.0 | 0 |  | 200 | 2940 | 2000 |" in capsys.readouterr().out


def test_no_results_is_not_an_error(pool_serve, tmp_path, capsys):
    assert pool_serve.main([str(tmp_path), "qwen3-0.6b"]) == 0
    assert "no serve-*-qwen3-0.6b.json" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
