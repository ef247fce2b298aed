"""Where a prefix hit's time goes on MLX-CUDA (issue #14 diagnosis), with mlx-lm alone: a 4k prompt's
prefill in 512-token chunks (the cold request), then a ~97-token suffix after it (what a hit still
computes) as one forward and as the suffix plus its last token apart, at a seen and at new lengths, and
a decode step; each split into building the lazy graph (host) and running it. Run it with
MLX_CUDA_USE_CUDNN_SDPA=0 and without. usage: python3 scripts/cuda_forward_probe.py [SHAPE] (gemma3-4b)"""
import os
import sys
import tempfile
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxserve.models.families import build_family_folder


def timed(fn):
    """(host ms building the graph, total ms until it ran)."""
    mx.synchronize()
    t = time.perf_counter()
    out = fn()
    built = time.perf_counter()
    mx.eval(out)
    mx.synchronize()
    return (built - t) * 1000, (time.perf_counter() - t) * 1000


def main():
    shape = sys.argv[1] if len(sys.argv) > 1 else "gemma3-4b"
    with tempfile.TemporaryDirectory() as folder:
        model, _ = load(str(build_family_folder(folder, shape)))
    print(shape, "MLX_CUDA_USE_CUDNN_SDPA =", os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "(default)"))
    rnd = lambda n: mx.random.randint(3, 1000, (1, n))  # noqa: E731

    def prefill(n, chunk=512):
        cache = make_prompt_cache(model)
        x = rnd(n)
        for i in range(0, n - 1, chunk):
            model(x[:, i:min(i + chunk, n - 1)], cache=cache)
            mx.eval([c.state for c in cache])
        return cache, model(x[:, n - 1:], cache=cache)[:, -1, :]

    for i in range(3):
        _, total = timed(lambda: prefill(4128)[1])
        print(f"cold 4128 (512 chunks) #{i}: {total:.1f} ms")
    for n in (97, 97, 97, 101, 89, 113):
        cache, _ = prefill(4096)
        mx.eval([c.state for c in cache])
        host, total = timed(lambda: model(rnd(n), cache=cache)[:, -1, :])
        print(f"suffix {n} one forward: host {host:.1f} ms, total {total:.1f} ms")
        cache, _ = prefill(4096)
        mx.eval([c.state for c in cache])
        host, total = timed(lambda: (model(rnd(n - 1), cache=cache), model(rnd(1), cache=cache)[:, -1, :])[1])
        print(f"suffix {n} as {n - 1} + 1: host {host:.1f} ms, total {total:.1f} ms")
        for _ in range(3):
            host, total = timed(lambda: model(rnd(1), cache=cache)[:, -1, :])
        print(f"  decode at {cache[0].offset}: host {host:.1f} ms, total {total:.1f} ms")


if __name__ == "__main__":
    main()
