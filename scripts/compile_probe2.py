"""Chunked prefill (queries after a cached prefix) on MLX-CUDA: first-use cost per (cached, new) pair."""
import sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

model, tok = load(sys.argv[1])
def timed(label, fn):
    t = time.perf_counter(); mx.eval(fn()); print(f"{label:40s} {(time.perf_counter()-t)*1000:10.1f} ms", flush=True)
for first, second in [(16, 16), (128, 52), (128, 52), (21, 160), (256, 100), (300, 1), (64, 2), (64, 3)]:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5] * first]), cache=cache))
    timed(f"prefill {second} after {first}", lambda: model(mx.array([[6] * second]), cache=cache)[:, -1])
