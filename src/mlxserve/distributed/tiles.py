"""Tiled quantized kernels on the ranks of a split model (MLX-CUDA): compiled in helper processes while
the ranks warm up and serve, switched on by every rank at the same step.

A rank's first forward at a new row count otherwise compiles the tiled 4-bit kernels inside the step
(2x H200, random 4-bit Qwen3-8B shape, TP=2: warm-up steps of 50.9 s and ~30 s, ready after 114 s; one
rank: 15 s, its helpers compiling meanwhile). As on one rank (engine/warmup.py), rows from 8 on
dequantize until the helpers report their tiles ready. Only rank 0 runs helpers: the ranks' quantized
matmuls have the same shapes (tensor parallel: equal shards; pipeline: whole layers), and every rank
reads rank 0's kernel cache. Rank 0 decides when the row limit moves and the step plan carries it, so
all ranks run each step through the same kernels: the LM head, computed whole on every rank, must give
every rank the same logits, or they would sample apart.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class TileSync:
    """`rows`: the row limit of the tiled kernels now (None: never set, the layers' own). Rank 0 calls
    `lead()` each step (polls the helpers, returns the limit for the plan); every rank calls `apply()`
    with the plan's limit before it runs the step."""

    def __init__(self, model: Any, compiler: Any = None, rows: int | None = None) -> None:
        self.model = model
        self.compiler = compiler
        self.rows = rows
        self._applied: int | None = None

    def lead(self) -> int | None:
        if self.compiler is None:
            return self.rows
        from mlxserve.platform.quantized_rows import ALL_TILED_ROWS

        for kind, rows, seconds in self.compiler.poll():
            if kind == "ready":
                self.rows = rows
                log.info("tiled quantized kernels ready up to %d rows (%.1f s in the helper processes): every "
                         "rank takes them from the next step", rows, seconds)
            elif kind == "done":
                self.rows = ALL_TILED_ROWS
                log.info("the helper processes compiled the tiled quantized kernels in %.1f s", seconds)
                self.close()
                break
            elif kind == "failed":
                log.warning("a tiled-kernel helper process stopped: rows above %s keep dequantizing (correct, "
                            "slower at 8-127 rows)", self.rows)
                self.close()
                break
        return self.rows

    def apply(self, rows: int | None) -> None:
        if rows is None or rows == self._applied:
            return
        from mlxserve.platform.quantized_rows import set_tiled_rows

        set_tiled_rows(self.model, rows)
        self._applied = rows

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
            self.compiler = None


def start_tiles(model: Any, buckets: list[int] | None) -> TileSync:
    """Rank 0's helpers for the model's tiled kernels, where MLX-CUDA runs row-folding quantized layers;
    elsewhere (or with none to compile) a TileSync that never changes anything."""
    from mlxserve.platform.backend import is_cuda

    if not is_cuda():
        return TileSync(model)
    from mlxserve.platform.kernel_cache import kernel_dir
    from mlxserve.platform.tile_compile import (MIN_TILED_ROWS, TileCompiler, quantized_shapes, tile_checkpoints,
                                               tiled_row_limit)

    shapes = quantized_shapes(model)
    rows = tile_checkpoints(buckets, tiled_row_limit(model))
    if not shapes or not rows:
        return TileSync(model)
    compiler = TileCompiler(shapes, rows, kernel_dir())
    compiler.start()
    log.info("tiled quantized kernels for %d matmul shapes at rows %s compile in helper processes; until each is "
             "ready, every rank dequantizes those rows", len(shapes), rows)
    return TileSync(model, compiler, MIN_TILED_ROWS - 1)
