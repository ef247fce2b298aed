"""The warm-up's pieces, run first in a helper process, so the server's own warm-up steps compile nothing.

On MLX-CUDA a warm-up step on a machine with an empty kernel cache compiles kernels for seconds, and a request
that arrives meanwhile waits for that step (docs/BENCHMARKS.md, "Start-up on MLX-CUDA"). This process loads
the same model, builds an engine core with the server's settings (a small KV budget, no SSD tier, no
speculation) and runs the warm-up's pieces in the same order; each compile reaches the kernel cache through a
staging folder (platform/tile_compile.py), and after each piece a line `piece NAME SECONDS` lets the server run
that piece itself, which then only loads compiled kernels. Its quantized layers dequantize from 8 rows on, as
the server's do while their tiled kernels compile (the tile helper compiles those), so both need the same
kernels. Started by engine/warmup.py's make_warmup, on MLX-CUDA only.

It stops early, and the server runs the pieces left itself, where it cannot help: when the device holds less
free memory at its start than the server counted it would need (other processes, or the server's own load,
took it meanwhile), and at the first warm-up request that fails. On an H100 both happened under load at an
8B cold start: the helper's steps ran out of memory, MLX-CUDA's context was unusable after it, and the helper
failed every step for minutes while the server's warm-up waited for it.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from collections.abc import Callable

from mlxhost.engine.warmup import BackgroundWarmup
from mlxhost.engine.warmup_memory import KV_TOKENS, PREFIX_BYTES
from mlxhost.memory.device import read_memory
from mlxhost.models.torch_free import follow_parent
from mlxhost.platform.tile_compile import publish, start_staged


def main(argv: list[str] | None = None) -> int:
    follow_parent()  # the server kept torch out for this model: so does this process (it loads the same one)
    spec, cache, staging, linked = start_staged(argv)
    try:
        short = _memory_short(spec.get("needs_bytes"))
        if short:
            print(f"piece helper: {short}; the server runs the pieces", file=sys.stderr, flush=True)
            return 2
        # Here, not at the top: the core (and MLX) load only after start_staged pointed MLX's kernel cache.
        import mlx.core as mx

        from mlxhost.config import EngineConfig  # (these too, as above)
        from mlxhost.engine.core import EngineCore
        from mlxhost.models.loader import load_model
        from mlxhost.platform.quantized_rows import set_tiled_rows
        from mlxhost.platform.tile_compile import MIN_TILED_ROWS

        if spec.get("needs_bytes"):
            # MLX frees its cached buffers before it grows past what the server counted for this process (its
            # default, nearly all of the device, would let it take what the server's own steps need).
            mx.set_memory_limit(spec["needs_bytes"])
        started = time.perf_counter()
        loaded = load_model(spec["source"], remember=spec["config"].get("measurements_dir"))
        config = dataclasses.replace(EngineConfig(**spec["config"]), kv_budget_tokens=KV_TOKENS,
                                     cache_memory_bytes=PREFIX_BYTES, ssd_cache_dir=None, speculative="off",
                                     draft_model=None, memory_refresh_s=0.0)
        core = EngineCore(loaded.model, loaded.tokenizer, config, spec["max_model_len"], spec["buckets"])
        set_tiled_rows(loaded.model, MIN_TILED_ROWS - 1)
        warm = BackgroundWarmup(spec["max_batch"], spec["buckets"])

        def piece_done(name: str) -> None:  # its kernels go to the cache before the server hears of it
            publish(staging, cache, linked)
            print(f"piece {name} {time.perf_counter() - started:.3f}", flush=True)

        failed = run_pieces(core, warm, piece_done)
        if failed:
            print(f"piece helper: a warm-up request failed ({failed}); the server runs the pieces left",
                  file=sys.stderr, flush=True)
            return 3
        publish(staging, cache, linked)
        print("done", flush=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return 0


def _memory_short(needs: int | None) -> str | None:
    """Why the free memory cannot hold the helper (`needs` bytes, as the server counted them), or None."""
    if not needs:
        return None
    free = read_memory().available_now
    if free >= needs:
        return None
    return f"{free / 2**30:.2f} GiB are free and it needs {needs / 2**30:.2f} GiB"


def run_pieces(core, warm: BackgroundWarmup, piece_done: Callable[[str], None]) -> str | None:
    """Runs every piece on `core`, calling `piece_done(name)` as each ends. Returns None once all ran, else the
    error of the first request that failed: on MLX-CUDA an out-of-memory or illegal access can leave the context
    unusable, and every later step would fail too."""
    reported = 0
    while not warm.finished:
        wait = warm.between_steps(core)
        done = warm.report.pieces_done
        for name in done[reported:]:
            piece_done(name)
        reported = len(done)
        if wait:
            time.sleep(wait)
        elif core.has_work:
            for out in core.step():
                if out.error:
                    return out.error
    return None


if __name__ == "__main__":
    sys.exit(main())
