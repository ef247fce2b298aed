"""One forward of a random 4-bit model, timed alone for several (rows, positions) shapes: what a speculative
verify of one row (1 x 5) costs against a plain step (1 x 1) and against more rows (docs/BENCHMARKS.md, "The
ceiling with a peaked target").

    python tools/forward_probe.py [SHAPE]    (default qwen3-8b; tiny runs on a CPU)

The model is loaded as the server loads it (`models.loader.load_model`: on MLX-CUDA its quantized layers fold
rows), a 128-token prompt fills a prompt cache, then each forward runs on it, is evaluated (synchronous, warm:
five untimed first) and trimmed back. Also printed: the host's time to build each forward's graph alone.
"""

import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxhost.bench import speculative as spec_bench
from mlxhost.models.loader import load_model

SHAPES = [(1, 1), (1, 2), (1, 5), (5, 1), (8, 1), (16, 1), (16, 5)]


def time_forward(model, rows: int, positions: int, n: int = 40) -> tuple[float, float]:
    """(ms per synchronous forward, ms of it building the graph)."""
    cache = make_prompt_cache(model)
    model(mx.array([[i % 1000 + 5 for i in range(128)]] * rows), cache=cache)
    mx.eval([c.state for c in cache])
    x = mx.array([[7] * positions] * rows)

    def forward(evaluate: bool):
        out = model(x, cache=cache)
        if evaluate:
            mx.eval(out)
        for c in cache:
            c.trim(positions)
        return out

    for _ in range(5):
        forward(True)
    start = time.perf_counter()
    for _ in range(n):
        forward(True)
    synchronous = (time.perf_counter() - start) / n * 1000
    start = time.perf_counter()
    for _ in range(n):
        out = forward(False)
    building = (time.perf_counter() - start) / n * 1000
    mx.eval(out)
    return synchronous, building


def main() -> int:
    shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b"
    with tempfile.TemporaryDirectory() as tmp:
        target, _ = spec_bench.build_models(shape, None if shape == "tiny" else 4, [], Path(tmp), peaked=True)
        model = load_model(str(target)).model
        for rows, positions in SHAPES:
            synchronous, building = time_forward(model, rows, positions)
            print(f"rows {rows:2d} x positions {positions}: {synchronous:6.2f} ms a forward, {building:5.2f} ms of it "
                  "building the graph", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
