"""Compiles MLX-CUDA's tiled quantized-matmul kernels in a helper process, so no request waits for them.

MLX-CUDA 0.32 compiles its tiled quantized matmul (CUTLASS, through NVRTC) once per tile of rows: from 8
rows on (below, a precompiled matrix-vector kernel runs), one module for up to 16 rows, one up to 32, one
for more. Each takes tens of seconds, most of a warm-up with an empty kernel cache (docs/BENCHMARKS.md,
"Compile stalls on MLX-CUDA"). MLX holds a process-wide lock while it compiles, which stops every other
kernel lookup of the process: compiled on the engine thread or beside it, the server stalls for the whole
compile.

This process runs the model's quantized matmul shapes on its own at growing row counts; each compile lands in
the kernel cache on disk (platform/kernel_cache.py), and a line `ready ROWS SECONDS` tells the server that
every row count up to ROWS is compiled. NVRTC compiles on one CPU core, so each tile's row counts get a
process of their own and the three modules compile side by side; the server hears "ready" for the row
counts up to which every tile is done. Until then the server's quantized layers take dequantize + matmul for
those rows, which needs no run-time kernel (platform/quantized_rows.py); afterwards MLX loads the binary from
disk in milliseconds. MLX writes a cache file in place, so a process stopped mid-write would leave a truncated
binary that every later start fails to load: this process compiles into a staging folder that links to the
cache's files, and moves each new file into the cache whole, the kernel-name list before the binary (the
binary's presence is what MLX looks for).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Row counts below this take MLX-CUDA's precompiled matrix-vector kernel (quantized_rows._MIN_ROWS).
MIN_TILED_ROWS = 8


def tile_checkpoints(buckets: list[int] | None, limit: int) -> list[int]:
    """Row counts to compile at, ascending: each decode bucket from MIN_TILED_ROWS up to `limit` (where
    layers switch to dequantize + matmul anyway), the powers of two between (tiles come in powers of two,
    so every row count up to a checkpoint has its tile compiled once all checkpoints below it ran), and
    `limit` - 1, which covers every row count below `limit`."""
    rows = {b for b in buckets or () if MIN_TILED_ROWS <= b < limit}
    p = MIN_TILED_ROWS
    while p < limit:
        rows.add(p)
        p *= 2
    if limit > MIN_TILED_ROWS:
        rows.add(limit - 1)
    return sorted(rows)


def tiled_row_limit(model: Any, default: int = 256) -> int:
    """Rows from which the model's row-folding layers dequantize anyway (their smallest `dequant_rows`), or
    `default` where none does: the row counts worth compiling tiled kernels for lie below it."""
    from mlxhost.platform.quantized_rows import row_layers  # lazy: pulls in mlx

    limits = [m.dequant_rows for m in row_layers(model) if m.dequant_rows > 0]
    return min(limits, default=default)


def quantized_shapes(model: Any) -> list[list]:
    """The distinct matmul problems of the model's row-folding quantized layers (quantized_rows.py), as
    [out features, in features, bits, group size, mode, activation dtype, has biases]."""
    from mlxhost.platform.quantized_rows import row_layers  # lazy: pulls in mlx

    shapes = set()
    for layer in row_layers(model):
        out_features, packed = layer["weight"].shape
        mode = getattr(layer, "mode", "affine")
        # Affine scales have the activations' dtype; the float modes' are uint8 (bf16 activations then).
        dtype = str(layer["scales"].dtype).rsplit(".", 1)[-1] if mode == "affine" else "bfloat16"
        shapes.add((out_features, packed * 32 // layer.bits, layer.bits, layer.group_size, mode, dtype,
                    layer.get("biases") is not None))
    return [list(s) for s in sorted(shapes)]


def tile_groups(rows: list[int]) -> list[list[int]]:
    """`rows` (ascending checkpoints) split by the tile that compiles for them: up to 16, up to 32, more."""
    groups: dict[int, list[int]] = {}
    for r in rows:
        groups.setdefault(16 if r <= 16 else 32 if r <= 32 else 64, []).append(r)
    return [groups[tile] for tile in sorted(groups)]


class TileCompiler:
    """The helper processes seen from the server: `poll()` returns what they reported since the last call,
    without waiting. Reports: ("ready", rows, seconds) once every checkpoint up to `rows` is compiled,
    ("piece", name, seconds), ("done", 0, total seconds) once all are done, or ("failed", 0, 0.0) once one
    stopped early. The tile groups (tile_groups) compile in processes of their own; `module` runs instead of
    this one, in one process, with the same protocol (engine/warmup_helper.py)."""

    def __init__(self, shapes: list[list], rows: list[int], cache_dir: Path, python: str = sys.executable,
                 module: str = "mlxhost.platform.tile_compile", spec: dict | None = None) -> None:
        self.spec = spec if spec is not None else {"cache_dir": str(cache_dir), "rows": rows, "shapes": shapes}
        self.rows = rows
        self.module = module
        self._python = python
        self._procs: list[subprocess.Popen] = []
        self._reports: queue.SimpleQueue = queue.SimpleQueue()
        self._started = 0.0
        self._ready: set[int] = set()
        self._num_reported = 0  # checkpoints (self.rows[:n]) reported ready
        self._num_done = 0
        self._failed = False

    def start(self) -> None:
        self._started = time.perf_counter()
        specs = ([dict(self.spec, rows=group) for group in tile_groups(self.rows)] if "rows" in self.spec
                 else [self.spec])
        for spec in specs or [self.spec]:
            proc = subprocess.Popen([self._python, "-m", self.module, json.dumps(spec)],
                                    stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
            self._procs.append(proc)
            threading.Thread(target=self._read, args=(proc,), name="mlxhost-tile-compile", daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        done = None
        for line in proc.stdout:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "ready":
                self._reports.put(("ready", int(parts[1]), float(parts[2])))
            elif len(parts) > 2 and parts[0] == "piece":
                self._reports.put(("piece", " ".join(parts[1:-1]), float(parts[-1])))
            elif parts[:1] == ["done"]:
                done = time.perf_counter() - self._started
        # Reported once the process has ended, not at its last line: the memory it held (a second copy of the model,
        # for the piece helper) is free by then, and the server may hand it out again (engine/warmup_memory.py's KV loan).
        proc.wait()
        self._reports.put(("done", 0, done) if done is not None else ("failed", 0, 0.0))  # else: died or stopped

    def poll(self) -> list[tuple[str, int, float]]:
        """The processes' reports merged: "ready" for each checkpoint once it and every one below it are
        compiled, "done" after the last process's, "failed" after the first early stop."""
        out = []
        while True:
            try:
                kind, value, seconds = self._reports.get_nowait()
            except queue.Empty:
                return out
            if kind == "ready":
                self._ready.add(value)
                while self._num_reported < len(self.rows) and self.rows[self._num_reported] in self._ready:
                    out.append(("ready", self.rows[self._num_reported], seconds))
                    self._num_reported += 1
            elif kind == "done":
                self._num_done += 1
                if self._num_done == len(self._procs):
                    out.append((kind, value, seconds))
            elif kind == "failed":
                if not self._failed:
                    out.append((kind, value, seconds))
                self._failed = True
            else:
                out.append((kind, value, seconds))

    def close(self) -> None:
        """Stops the processes still running (their staging folders stay behind; the next run removes them)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()


# -- the helper process ------------------------------------------------------------------------------------


def _files(root: Path) -> set[Path]:
    """The cache's files, relative to it. Other processes' staging folders are not entered: one may be removed
    while this walks (a helper ending), which would fail a walk that descended into it."""
    found = set()
    for folder, dirs, names in os.walk(root, onerror=lambda _exc: None):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        base = Path(folder).relative_to(root)
        found.update(base / n for n in names if not n.startswith(".") and os.path.isfile(os.path.join(folder, n)))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def make_staging(cache: Path) -> tuple[Path, set[Path]]:
    """A staging folder inside the cache holding links to every cached file (copies where links fail), so
    MLX finds what is compiled already; stale staging folders of stopped runs are removed first."""
    for old in cache.glob(".staging-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    staging = cache / f".staging-{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    files = _files(cache)
    # Whole modules only: `publish` moves a module's binary last, and a file linked without it would be
    # rewritten in place, through the link, if this process compiled that module again.
    whole = {rel.with_suffix("") for rel in files if rel.suffix == ".ptx"}
    linked = {rel for rel in files if rel.with_suffix("") in whole}
    for rel in linked:
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(cache / rel, staging / rel)
        except OSError:
            shutil.copyfile(cache / rel, staging / rel)
    return staging, linked


def publish(staging: Path, cache: Path, linked: set[Path]) -> int:
    """Moves the files MLX wrote into staging since the last call into the cache, each by one rename;
    every binary (.ptx) after the other files of its module. Returns how many modules were published."""
    new = sorted(_files(staging) - linked, key=lambda rel: (rel.suffix == ".ptx", str(rel)))
    for rel in new:
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / rel, cache / rel)
    return sum(rel.suffix == ".ptx" for rel in new)


def start_staged(argv: list[str] | None) -> tuple[dict, Path, Path, set[Path]]:
    """A compiling helper process's start: its JSON spec and a staging folder MLX compiles into (the variable is
    set before MLX's first compile, which reads it). Returns the spec, the cache, the staging folder and the
    files it linked."""
    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    cache = Path(spec["cache_dir"])
    staging, linked = make_staging(cache)
    os.environ["MLX_PTX_CACHE_DIR"] = str(staging)
    return spec, cache, staging, linked


def main(argv: list[str] | None = None) -> int:
    spec, cache, staging, linked = start_staged(argv)
    import mlx.core as mx  # lazy: mlx only when used

    try:
        weights = []
        for out_features, in_features, bits, group_size, mode, dtype, has_biases in spec["shapes"]:
            dt = getattr(mx, dtype)
            groups = in_features // group_size
            scales = mx.ones((out_features, groups), dtype=dt if mode == "affine" else mx.uint8)
            biases = mx.zeros((out_features, groups), dtype=dt) if has_biases else None
            w = mx.zeros((out_features, in_features * bits // 32), dtype=mx.uint32)
            weights.append((w, scales, biases, in_features, bits, group_size, mode, dt))
        for rows in spec["rows"]:
            started = time.perf_counter()
            outs = [mx.quantized_matmul(mx.ones((rows, k), dtype=dt), w, scales, biases, transpose=True,
                                        group_size=g, bits=b, mode=m)
                    for w, scales, biases, k, b, g, m, dt in weights]
            mx.eval(outs)
            del outs
            publish(staging, cache, linked)
            print(f"ready {rows} {time.perf_counter() - started:.3f}", flush=True)
        print("done", flush=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
