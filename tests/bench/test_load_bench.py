"""`mlxhost bench load` on the tiny fixture: every cell runs in a child process and lands in the JSON.

Timing values are only checked for being >= 0: wall-clock numbers vary by machine.
"""

import json
import subprocess
import sys

import pytest

from mlxhost.bench.load import evict_page_cache, page_cache_fraction, warm_page_cache
from mlxhost.server.cli import main


def test_bench_writes_every_cell(qwen3_model_dir, tmp_path, capsys):
    out = tmp_path / "load.json"
    rc = main(["bench", "load", str(qwen3_model_dir), "--strategies", "mlx-lm", "mmap",
               "--cache", "cold", "warm", "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    cells = {(r["strategy"], r["cache"]) for r in result["rows"]}
    if sys.platform == "linux":
        assert cells == {("mlx-lm", "cold"), ("mlx-lm", "warm"), ("mmap", "cold"), ("mmap", "warm")}
    for row in result["rows"]:
        assert row["model"] == qwen3_model_dir.name and row["weights_gb"] > 0
        assert row["weights_s"] >= 0 and row["tokenizer_s"] >= 0 and row["forward_s"] >= 0
        assert row["load_s"] >= row["weights_s"]
        # The child loaded the weights: its peak RSS exceeds what it had before the load.
        assert row["peak_rss_gb"] > row["base_rss_gb"] > 0
        assert 0 <= row["resident_pct"] <= 100
        if row["cache"] == "warm":
            assert row["resident_pct"] == 100
    assert "mmap" in capsys.readouterr().out


@pytest.mark.skipif(sys.platform != "linux", reason="posix_fadvise and /proc are Linux-only")
def test_evict_and_warm_move_the_page_cache(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"\x01" * (4 << 20))
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout
    if "tmpfs" in fs:
        pytest.skip("tmpfs pages cannot be evicted")
    warm_page_cache([path])
    assert page_cache_fraction([path]) == 1.0
    assert evict_page_cache([path])
    assert page_cache_fraction([path]) < 0.5
