"""Compiling MLX-CUDA's tiled quantized kernels out of process (platform/tile_compile.py), the layers' dequantize
fallback while they compile (platform/quantized_rows.py) and the kernel cache's folder (platform/kernel_cache.py).
On the CPU nothing compiles; these tests check the plumbing: which row counts, what is reported, what reaches the
cache folder and in which order, which path a layer takes."""

import os
import shutil
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

import mlxhost.platform.backend as backend
from mlxhost.platform import kernel_cache, tile_compile
from mlxhost.platform.quantized_rows import ALL_TILED_ROWS, fold_quantized_rows, set_tiled_rows
from mlxhost.platform.tile_compile import (
    TileCompiler,
    make_staging,
    publish,
    quantized_shapes,
    tile_checkpoints,
    tile_groups,
)


def test_checkpoints_cover_every_tile_below_the_dequantize_threshold():
    assert tile_checkpoints([1, 2, 4, 8, 12, 16, 24, 32, 48, 64], 128) == [8, 12, 16, 24, 32, 48, 64, 127]
    assert tile_checkpoints(None, 128) == [8, 16, 32, 64, 127]
    assert tile_checkpoints([1, 2, 4], 20) == [8, 16, 19]
    assert tile_checkpoints([1, 2], 8) == []  # everything from 8 rows on dequantizes: nothing to compile


def _holder(bias=True):
    holder = nn.Module()
    holder.proj = nn.QuantizedLinear(64, 128, bias=bias, group_size=64, bits=4)
    holder.head = nn.QuantizedEmbedding(300, 64, group_size=64, bits=4)
    plain = (holder.proj, holder.head)
    fold_quantized_rows(holder)
    return holder, plain


def test_rows_over_the_tiled_limit_dequantize_until_the_limit_is_lifted(monkeypatch):
    holder, (proj, head) = _holder()
    calls = []
    real = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert set_tiled_rows(holder, 7) == 2
    for shape, dequantized in [((1, 1, 64), 0), ((4, 1, 64), 0), ((12, 1, 64), 1), ((1, 9, 64), 1), ((2, 3, 64), 0)]:
        calls.clear()
        x = mx.random.normal(shape)
        assert mx.allclose(holder.proj(x), proj(x), atol=1e-4).item()
        assert mx.allclose(holder.head.as_linear(x), head.as_linear(x), atol=1e-4).item()
        assert len(calls) == 2 * dequantized, shape
    set_tiled_rows(holder, 16)  # up to 16 rows ready: 12 rows take the quantized kernel again
    calls.clear()
    holder.proj(mx.random.normal((12, 1, 64)))
    assert calls == []
    holder.proj(mx.random.normal((20, 1, 64)))
    assert calls == [1]
    set_tiled_rows(holder, ALL_TILED_ROWS)
    calls.clear()
    holder.proj(mx.random.normal((100, 1, 64)))
    assert calls == []  # under DEQUANT_ROWS (128): the tiled kernel


def test_quantized_shapes_are_the_distinct_problems_of_the_folded_layers():
    holder, _ = _holder()
    holder.other = nn.QuantizedLinear(64, 128, bias=False, group_size=64, bits=4)  # same problem as proj
    fold_quantized_rows(holder)
    assert quantized_shapes(holder) == [[128, 64, 4, 64, "affine", "float32", True],
                                        [300, 64, 4, 64, "affine", "float32", True]]


def test_staging_links_the_cache_and_publishes_new_files_binary_last(tmp_path, monkeypatch):
    cache = tmp_path / "kernels"
    (cache / "deep").mkdir(parents=True)
    (cache / "old.ptx").write_bytes(b"old")
    (cache / "deep" / "older.txt").write_text("names")
    (cache / "deep" / "older.ptx").write_text("binary")
    (cache / "half.txt").write_text("a module whose binary is not published yet: not linked")
    (cache / ".staging-999999999").mkdir()  # a stopped run's: removed
    running = cache / f".staging-{os.getppid()}"  # a running helper's: not entered (it may vanish meanwhile)
    running.mkdir()
    (running / "theirs.ptx").write_text("theirs")
    staging, linked = make_staging(cache)
    assert not (cache / ".staging-999999999").exists() and running.exists()
    assert linked == {Path("old.ptx"), Path("deep/older.txt"), Path("deep/older.ptx")}
    assert (staging / "old.ptx").read_bytes() == b"old" and (staging / "deep" / "older.txt").read_text() == "names"
    for name in ("new.ptx", "new.txt", "new.cu"):  # as MLX writes one module: binary, names, source
        (staging / name).write_text(name)
    moved = []
    real = os.replace
    monkeypatch.setattr(tile_compile.os, "replace", lambda a, b: moved.append(Path(b).name) or real(a, b))
    assert publish(staging, cache, linked) == 1
    assert moved[-1] == "new.ptx" and sorted(moved) == ["new.cu", "new.ptx", "new.txt"]
    assert (cache / "new.ptx").read_text() == "new.ptx" and not (staging / "new.ptx").exists()
    assert publish(staging, cache, linked) == 0  # nothing new since
    assert (cache / "old.ptx").read_bytes() == b"old"


def test_the_helper_process_reports_each_checkpoint_then_done(tmp_path):
    holder, _ = _holder()
    compiler = TileCompiler(quantized_shapes(holder), [8, 16, 127], tmp_path)
    compiler.start()
    reports = []
    deadline = time.monotonic() + 120  # a bound for a stuck process, not a timing assertion
    while not reports or reports[-1][0] not in ("done", "failed"):
        assert time.monotonic() < deadline, reports
        reports += compiler.poll()
        time.sleep(0.05)
    compiler.close()
    assert [(kind, rows) for kind, rows, _ in reports] == [("ready", 8), ("ready", 16), ("ready", 127), ("done", 0)]
    assert not any(p.name.startswith(".staging-") for p in tmp_path.iterdir())  # its staging folder is gone


def test_a_helper_that_dies_is_reported_failed(tmp_path):
    compiler = TileCompiler([[128, 64, 4, 64, "affine", "no_such_dtype", True]], [8], tmp_path)
    compiler.start()
    reports = []
    deadline = time.monotonic() + 120
    while not reports:
        assert time.monotonic() < deadline
        reports += compiler.poll()
        time.sleep(0.05)
    compiler.close()
    assert reports == [("failed", 0, 0.0)]


def test_the_kernel_cache_goes_to_the_user_cache_on_cuda_only(tmp_path, monkeypatch):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    monkeypatch.setattr(backend, "is_cuda", lambda: False)
    assert kernel_cache.use_persistent_kernel_cache(env) is None and "MLX_PTX_CACHE_DIR" not in env
    monkeypatch.setattr(backend, "is_cuda", lambda: True)
    path = kernel_cache.use_persistent_kernel_cache(env)
    assert path.is_dir() and path.parent == tmp_path / "mlxhost" / "mlx-kernels"
    assert path.name.startswith(mx.__version__ + "-")  # one folder per MLX version and GPU architecture
    assert env["MLX_PTX_CACHE_DIR"] == str(path)
    named = {"MLX_PTX_CACHE_DIR": str(tmp_path / "mine")}
    assert kernel_cache.use_persistent_kernel_cache(named) == tmp_path / "mine"  # the user's folder wins
    (path / "a.ptx").write_bytes(b"")
    (path / ".staging-1").mkdir()
    (path / ".staging-1" / "b.ptx").write_bytes(b"")
    assert kernel_cache.count_modules(path) == 1


def test_tile_groups_split_checkpoints_by_their_tile():
    assert tile_groups([8, 12, 16, 24, 32, 48, 64, 127]) == [[8, 12, 16], [24, 32], [48, 64, 127]]
    assert tile_groups([8, 127]) == [[8], [127]] and tile_groups([]) == []


def test_reports_of_the_tile_processes_merge_into_ready_prefixes(tmp_path):
    """Each tile group compiles in its own process; a later group that finishes first waits for the ones below."""
    compiler = TileCompiler([], [8, 16, 24, 32, 64], tmp_path)
    compiler._procs = [None, None, None]  # three groups: (8, 16), (24, 32), (64)
    for report in [("ready", 64, 1.0), ("ready", 24, 2.0), ("ready", 8, 3.0), ("done", 0, 3.0)]:
        compiler._reports.put(report)
    assert compiler.poll() == [("ready", 8, 3.0)]
    for report in [("ready", 32, 4.0), ("done", 0, 4.0), ("ready", 16, 5.0), ("done", 0, 5.0)]:
        compiler._reports.put(report)
    assert compiler.poll() == [("ready", 16, 5.0), ("ready", 24, 5.0), ("ready", 32, 5.0), ("ready", 64, 5.0),
                               ("done", 0, 5.0)]
    compiler._reports.put(("failed", 0, 0.0))
    compiler._reports.put(("failed", 0, 0.0))
    assert compiler.poll() == [("failed", 0, 0.0)]  # once


# A stand-in for the compiling process: reports each row of its group ready, then done; "fail_at" stops it
# early (no "done") when its group holds that row.
_FAKE_HELPER = """
import json, sys
spec = json.loads(sys.argv[1])
for rows in spec["rows"]:
    if rows == spec.get("fail_at"):
        sys.exit(1)
    print("ready", rows, 0.5, flush=True)
print("done", flush=True)
"""


def _run_helpers(tmp_path, monkeypatch, **extra) -> tuple[TileCompiler, list]:
    (tmp_path / "fake_tile_helper.py").write_text(_FAKE_HELPER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    rows = [8, 12, 16, 24, 32, 48, 64, 127]
    compiler = TileCompiler([], rows, tmp_path, module="fake_tile_helper",
                            spec={"cache_dir": str(tmp_path), "rows": rows, "shapes": [], **extra})
    compiler.start()
    reports, deadline = [], time.monotonic() + 120  # a bound on a hang, not a timing assertion
    try:
        while not any(kind in ("done", "failed") for kind, _, _ in reports) and time.monotonic() < deadline:
            reports += compiler.poll()
            time.sleep(0.05)
        for proc in compiler._procs:
            proc.wait(timeout=60)
        reports += compiler.poll()
    finally:
        compiler.close()
    return compiler, reports


def test_each_tile_group_compiles_in_a_process_of_its_own(tmp_path, monkeypatch):
    compiler, reports = _run_helpers(tmp_path, monkeypatch)
    assert len(compiler._procs) == len(tile_groups(compiler.rows)) == 3
    assert [rows for kind, rows, _ in reports if kind == "ready"] == compiler.rows  # in order, each once
    assert [kind for kind, _, _ in reports].count("done") == 1 and reports[-1][0] == "done"


def test_a_group_that_stops_early_fails_once_and_holds_back_the_rows_above(tmp_path, monkeypatch):
    compiler, reports = _run_helpers(tmp_path, monkeypatch, fail_at=24)
    assert [kind for kind, _, _ in reports].count("failed") == 1
    assert "done" not in [kind for kind, _, _ in reports]
    # 48-127 compiled in their own process, but a row counts as ready only with every row below it.
    assert [rows for kind, rows, _ in reports if kind == "ready"] == [8, 12, 16]


def test_listing_the_cache_survives_a_staging_folder_removed_meanwhile(tmp_path):
    """A helper that ends removes its staging folder (links to the whole cache) while another helper starting
    lists the cache: the listing must neither enter it nor fail."""
    import threading

    from mlxhost.platform.tile_compile import _files

    (tmp_path / "a.ptx").write_text("a")
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            folder = tmp_path / ".staging-1"
            for i in range(20):
                (folder / f"d{i}").mkdir(parents=True, exist_ok=True)
                (folder / f"d{i}" / "x.ptx").write_text("x")
            shutil.rmtree(folder, ignore_errors=True)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(300):
            assert _files(tmp_path) == {Path("a.ptx")}
    finally:
        stop.set()
        thread.join()
