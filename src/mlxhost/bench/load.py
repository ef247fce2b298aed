"""`mlxhost bench load`: the weight-loading strategies of models/loader.py, cold and warm page cache.

Every load runs in a fresh child process, so its peak RSS is its own and nothing it loaded lingers in
MLX's allocator. Before each run the parent puts the weight files' pages in the state asked for:
- cold: os.posix_fadvise(POSIX_FADV_DONTNEED) on each file (after fsync: dirty pages cannot be dropped).
  No root needed; it drops clean pages no other process has mapped. Linux only: macOS has no
  posix_fadvise (there `sudo purge` empties the whole cache and the cold runs are skipped here).
- warm: each file read through once.
Either way the share of pages resident just before the child starts is measured with mincore(2) and
reported, so a "warm" 16 GB model that no longer fits next to its own copy in RAM shows as such.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import default_json_path
from mlxhost.models.loader import LOAD_STRATEGIES, load_model, weight_files

_COLUMNS = [
    ("model", "model", ""), ("weights_gb", "weights GB", ".2f"), ("strategy", "strategy", ""),
    ("cache", "cache", ""), ("resident_pct", "resident %", ".0f"), ("weights_s", "weights s", ".2f"),
    ("tokenizer_s", "tokenizer s", ".2f"), ("forward_s", "1st forward s", ".2f"), ("peak_rss_gb", "peak RSS GB", ".2f"),
    ("base_rss_gb", "RSS before GB", ".2f"), ("disk_read_gb", "disk read GB", ".2f"),
]
_READ_CHUNK = 16 << 20


# ---------------------------------------------------------------------------------------------------
# Page cache state


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def page_cache_fraction(paths: list[Path]) -> float | None:
    """Share of the files' pages in the page cache (mincore on a read-only mapping); None if unknown."""
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return None
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        with open(path, "rb") as f:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in vec)
            finally:
                libc.munmap(addr, size)
        total += pages
    return resident / total if total else None


def evict_page_cache(paths: list[Path]) -> bool:
    """Drops the files' clean pages from the page cache; False where the OS has no posix_fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def warm_page_cache(paths: list[Path]) -> None:
    buf = bytearray(_READ_CHUNK)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# ---------------------------------------------------------------------------------------------------
# One load, in a child process


def _child(model: str, strategy: str, forward: bool) -> dict:
    """Runs in the child: imports, then the load (timed), then optionally one forward pass."""
    start = time.perf_counter()
    import mlx.core as mx  # lazy: mlx only when used
    import mlx_lm  # noqa: F401  (imported here so load_s does not pay for it)  # lazy: mlx_lm only when used

    import_s = time.perf_counter() - start
    base_rss = _status_kib("VmRSS")
    read_before = _storage_read_bytes()
    start = time.perf_counter()
    loaded = load_model(model, strategy)
    load_s = time.perf_counter() - start  # weights + tokenizer + the torn-file check
    read_after = _storage_read_bytes()
    peak_after_load = _peak_rss_bytes()
    forward_s = None
    if forward:
        start = time.perf_counter()
        mx.eval(loaded.model(mx.array([[1]])))
        forward_s = time.perf_counter() - start
    return {"import_s": import_s, "load_s": load_s, "weights_s": loaded.timings.get("weights", load_s),
            "tokenizer_s": loaded.timings.get("tokenizer"), "forward_s": forward_s,
            "peak_rss_bytes": peak_after_load, "peak_rss_after_forward_bytes": _peak_rss_bytes(),
            "base_rss_bytes": base_rss * 1024 if base_rss is not None else None,
            "mlx_peak_bytes": mx.get_peak_memory(),
            "disk_read_bytes": read_after - read_before if read_before is not None else None}


def _storage_read_bytes() -> int | None:
    """Bytes this process made the kernel fetch from storage (page-cache hits excluded): what says a
    cold run really was cold. Page-fault counts do not: read-ahead and fault-around hide them."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _peak_rss_bytes() -> int:
    import resource  # resource: POSIX only

    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    # No /proc (macOS): ru_maxrss, in bytes there (in KiB on Linux).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run_child(model: str, strategy: str, forward: bool, timeout: float | None = None) -> dict:
    cmd = [sys.executable, "-m", "mlxhost.bench.load", model, strategy] + (["--forward"] if forward else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"load child failed ({strategy}, {model}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------
# The bench


def run_load_bench(args: argparse.Namespace) -> dict:
    strategies = args.strategies or list(LOAD_STRATEGIES)
    caches = args.cache or ["cold", "warm"]
    rows = []
    for model in args.models:
        files = weight_files(Path(model))
        if not files:
            raise SystemExit(f"{model}: no model*.safetensors")
        weight_bytes = sum(p.stat().st_size for p in files)
        for cache in caches:
            for strategy in strategies:
                runs, resident = [], []
                for _ in range(args.repeats):
                    if cache == "cold":
                        if not evict_page_cache(files):
                            print("cold runs skipped: no posix_fadvise here (macOS: sudo purge, then --cache warm)",
                                  file=sys.stderr)
                            break
                    else:
                        warm_page_cache(files)
                    resident.append(page_cache_fraction(files))
                    runs.append(run_child(model, strategy, args.forward, args.timeout))
                if not runs:
                    continue
                rows.append(_row(model, weight_bytes, strategy, cache, runs, resident))
                print(format_table(rows[-1:], _COLUMNS), flush=True)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    return {"config": config, "rows": rows}


def _row(model: str, weight_bytes: int, strategy: str, cache: str, runs: list[dict],
         resident: list[float | None]) -> dict:
    def med(key):
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    known = [r for r in resident if r is not None]
    return {"model": Path(model).name, "path": str(model), "weights_gb": weight_bytes / 1e9,
            "strategy": strategy, "cache": cache, "repeats": len(runs),
            "resident_pct": 100 * statistics.median(known) if known else None,
            "weights_s": med("weights_s"), "tokenizer_s": med("tokenizer_s"), "load_s": med("load_s"),
            "forward_s": med("forward_s"), "import_s": med("import_s"),
            "peak_rss_gb": max(r["peak_rss_bytes"] for r in runs) / 1e9,
            "base_rss_gb": (med("base_rss_bytes") or 0) / 1e9 or None,
            "mlx_peak_gb": max(r["mlx_peak_bytes"] for r in runs) / 1e9,
            "disk_read_gb": (med("disk_read_bytes") / 1e9) if med("disk_read_bytes") is not None else None,
            "runs": runs}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", help="model folders (safetensors)")
    parser.add_argument("--strategies", nargs="+", choices=LOAD_STRATEGIES, default=None,
                        help="weight-loading strategies to time (default: all)")
    parser.add_argument("--cache", nargs="+", choices=["cold", "warm"], default=None,
                        help="page-cache states to load from: cold (the files evicted first) or warm (default: both)")
    parser.add_argument("--repeats", type=int, default=1, help="loads per cell (the median is shown)")
    parser.add_argument("--forward", action=argparse.BooleanOptionalAction, default=True,
                        help="time one forward pass after the load (slow for big models on CPU)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per child load (default: no limit)")
    parser.add_argument("--output-json", default=None,
                        help="result file (default: bench-results/serve-load-<time>.json)")


def run(args: argparse.Namespace) -> int:
    result = run_load_bench(args)
    print(format_table(result["rows"], _COLUMNS))
    path = write_json(args.output_json or default_json_path("load"), result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    # The child: `python -m mlxhost.bench.load MODEL STRATEGY [--forward]`, one JSON line on stdout.
    _args = sys.argv[1:]
    print(json.dumps(_child(_args[0], _args[1], "--forward" in _args[2:])))
