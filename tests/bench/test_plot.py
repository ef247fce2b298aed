"""`mlxhost bench plot` / `bench serve --plot`: a PNG of the expected size from fixture results."""

import json
import struct

import pytest

pytest.importorskip("matplotlib")

from mlxhost.bench import plot  # noqa: E402
from mlxhost.server import cli  # noqa: E402


def _result(label: str, scale: float) -> dict:
    levels = [{"label": label, "concurrency": c, "agg_tok_s": 40.0 * c * scale, "ttft_p50_ms": 30.0 * c,
               "decode_tok_s_per_req": 40.0 * scale} for c in (1, 2, 4, 8)]
    return {"config": {"label": label}, "levels": levels}


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR: width, height


def test_plot_command_writes_a_png_of_the_expected_size(tmp_path):
    files = []
    for label, scale in (("mlxhost", 1.0), ("mlx_lm.server", 0.6)):
        files.append(tmp_path / f"{label}.json")
        files[-1].write_text(json.dumps(_result(label, scale)))
    out = tmp_path / "chart.png"
    assert cli.main(["bench", "plot", *map(str, files), "-o", str(out), "--title", "tiny"]) == 0
    width, height = plot.FIGSIZE[0] * plot.DPI, plot.FIGSIZE[1] * plot.DPI
    assert _png_size(out) == (len(plot.METRICS) * width, height)


def test_default_output_is_next_to_the_json(tmp_path):
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"levels": [{"concurrency": 1, "agg_tok_s": 10.0}]}))
    assert cli.main(["bench", "plot", str(f)]) == 0
    assert _png_size(tmp_path / "run.png") == (plot.FIGSIZE[0] * plot.DPI, plot.FIGSIZE[1] * plot.DPI)


def test_not_a_result_file_is_a_clear_error(tmp_path, capsys):
    f = tmp_path / "x.json"
    f.write_text("{}")
    assert cli.main(["bench", "plot", str(f)]) == 2
    assert "not a `bench serve` result" in capsys.readouterr().err


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(plot.PlotUnavailableError, match=r"mlxhost\[plot\]"):
        plot.plot_series([("a", _result("a", 1.0)["levels"])], tmp_path / "x.png")


def test_prefix_chart_with_and_without_the_ssd_bars(tmp_path):
    rows = [{"block_size": 256, "prefix_tokens": p, "ttft_cold_ms": p / 2, "ttft_hit_ms": 5.0, "ttft_ssd_ms": 9.0}
            for p in (512, 4096)]
    size = (plot.FIGSIZE[0] * plot.DPI, plot.FIGSIZE[1] * plot.DPI)
    assert _png_size(plot.plot_prefix(rows, tmp_path / "ssd.png")) == size
    for row in rows:
        del row["ttft_ssd_ms"]
    assert _png_size(plot.plot_prefix(rows, tmp_path / "plain.png", title="prefix")) == size
    with pytest.raises(ValueError):
        plot.plot_prefix([], tmp_path / "none.png")


def test_memory_chart_is_two_panels(tmp_path):
    steps = range(600)
    timeline = {"off": {"kv_prealloc_tokens": 0, "active": [(1 + s // 256) << 20 for s in steps],
                        "rss": [(100 + s // 256) << 20 for s in steps]},
                "on": {"kv_prealloc_tokens": 640, "active": [3 << 20] * 600, "rss": [101 << 20] * 600}}
    out = plot.plot_memory(timeline, tmp_path / "memory.png")
    assert _png_size(out) == (2 * plot.FIGSIZE[0] * plot.DPI, plot.FIGSIZE[1] * plot.DPI)


def test_a_compare_file_is_one_series_per_server(tmp_path):
    f = tmp_path / "compare.json"
    levels = _result("mlxhost", 1.0)["levels"] + _result("mlx_lm", 0.6)["levels"]
    f.write_text(json.dumps({"model": "m", "levels": levels, "ratios": []}))
    series = plot.load_series([f])
    assert [label for label, _ in series] == ["mlxhost", "mlx_lm"] and all(len(lv) == 4 for _, lv in series)
    assert cli.main(["bench", "plot", str(f)]) == 0 and _png_size(tmp_path / "compare.png")[0] > 0


def test_plot_command_charts_prefix_and_memory_results(tmp_path):
    prefix = tmp_path / "prefix.json"
    prefix.write_text(json.dumps({"rows": [{"block_size": 256, "prefix_tokens": 512, "ttft_cold_ms": 300.0,
                                            "ttft_hit_ms": 20.0}], "decode": {}}))
    assert cli.main(["bench", "plot", str(prefix), "--title", "prefix"]) == 0
    assert _png_size(tmp_path / "prefix.png") == (plot.FIGSIZE[0] * plot.DPI, plot.FIGSIZE[1] * plot.DPI)
    memory = tmp_path / "memory.json"
    memory.write_text(json.dumps({"timeline": {"off": {"kv_prealloc_tokens": 0, "active": [1, 2, 3, 3],
                                                       "rss": [5, 6, 7, 7]}}, "burst": []}))
    assert cli.main(["bench", "plot", str(memory), "-o", str(tmp_path / "m.png")]) == 0
    assert _png_size(tmp_path / "m.png")[0] == 2 * plot.FIGSIZE[0] * plot.DPI
    assert cli.main(["bench", "plot", str(memory), str(prefix)]) == 2  # charted alone
