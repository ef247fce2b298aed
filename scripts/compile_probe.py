"""Which shapes make MLX-CUDA compile? Times the first and second forward of a random model for
several prefill lengths and decode batch sizes in one fresh process (run on the GPU machine)."""
import sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache, KVCache, BatchKVCache

model, tok = load(sys.argv[1])

def timed(label, fn):
    t = time.perf_counter(); out = fn(); mx.eval(out); dt = time.perf_counter() - t
    print(f"{label:40s} {dt*1000:10.1f} ms", flush=True)

for n in [16, 180, 181, 187, 200, 256, 300, 512, 16, 180, 333]:
    cache = make_prompt_cache(model)
    ids = mx.array([[i % 1000 + 5 for i in range(n)]])
    timed(f"prefill {n}", lambda: model(ids, cache=cache)[:, -1])
    timed(f"  decode after prefill {n}", lambda: model(mx.array([[7]]), cache=cache)[:, -1])
for b in [1, 2, 3, 4, 8, 16, 5]:
    caches = [make_prompt_cache(model) for _ in range(b)]
    for i, c in enumerate(caches):
        mx.eval(model(mx.array([[5] * (20 + i)]), cache=c))
    batch = [BatchKVCache.merge([caches[i][l] for i in range(b)]) for l in range(len(caches[0]))]
    timed(f"batched decode B={b}", lambda: model(mx.array([[7]] * b), cache=batch)[:, -1])
    timed(f"batched decode B={b} again", lambda: model(mx.array([[7]] * b), cache=batch)[:, -1])
