"""The warm-up's pieces, run first in a helper process, so the server's own warm-up steps compile nothing.

On MLX-CUDA a warm-up step on a machine with an empty kernel cache compiles kernels for seconds, and a request
that arrives meanwhile waits for that step (docs/BENCHMARKS.md, "Start-up on MLX-CUDA"). This process loads
the same model, builds an engine core with the server's settings (a small KV budget, no SSD tier, no
speculation) and runs the warm-up's pieces in the same order; each compile reaches the kernel cache through a
staging folder (platform/tile_compile.py), and after each piece a line `piece NAME SECONDS` lets the server run
that piece itself, which then only loads compiled kernels. Its quantized layers dequantize from 8 rows on, as
the server's do while their tiled kernels compile (the tile helper compiles those), so both need the same
kernels. Started by engine/warmup.py's make_warmup, on MLX-CUDA only.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time

from mlxhost.engine.warmup import KV_TOKENS, PREFIX_BYTES, BackgroundWarmup
from mlxhost.models.torch_free import follow_parent
from mlxhost.platform.tile_compile import publish, start_staged


def main(argv: list[str] | None = None) -> int:
    follow_parent()  # the server kept torch out for this model: so does this process (it loads the same one)
    spec, cache, staging, linked = start_staged(argv)
    try:
        # Here, not at the top: the core (and MLX) load only after start_staged pointed MLX's kernel cache.
        from mlxhost.config import EngineConfig
        from mlxhost.engine.core import EngineCore
        from mlxhost.models.loader import load_model
        from mlxhost.platform.quantized_rows import set_tiled_rows
        from mlxhost.platform.tile_compile import MIN_TILED_ROWS

        started = time.perf_counter()
        loaded = load_model(spec["source"])
        config = dataclasses.replace(EngineConfig(**spec["config"]), kv_budget_tokens=KV_TOKENS,
                                     cache_memory_bytes=PREFIX_BYTES, ssd_cache_dir=None, speculative="off",
                                     draft_model=None, memory_refresh_s=0.0)
        core = EngineCore(loaded.model, loaded.tokenizer, config, spec["max_model_len"], spec["buckets"])
        set_tiled_rows(loaded.model, MIN_TILED_ROWS - 1)
        warm = BackgroundWarmup(spec["max_batch"], spec["buckets"])
        reported = 0
        while not warm.finished:
            wait = warm.between_steps(core)
            done = warm.report.pieces_done
            if len(done) > reported:  # a piece ended: its kernels go to the cache before the server hears of it
                publish(staging, cache, linked)
                for name in done[reported:]:
                    print(f"piece {name} {time.perf_counter() - started:.3f}", flush=True)
                reported = len(done)
            if wait:
                time.sleep(wait)
            elif core.has_work:
                core.step()
        publish(staging, cache, linked)
        print("done", flush=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
