"""What a new attention shape costs on MLX-CUDA (issue #15/#19 diagnosis): mlx-lm forwards over a plain
KVCache at growing offsets, query lengths 1 and 5, repeated shapes vs new ones, a 4k prefill and a suffix
after it; and which quantized_matmul shapes the backend takes. Run it twice, with MLX_CUDA_USE_CUDNN_SDPA=0
and without, and compare. usage: python3 scripts/cuda_sdpa_probe.py MODEL_DIR"""
import os
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def ms(fn):
    mx.synchronize()
    t = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t) * 1000


def main():
    model, _ = load(sys.argv[1])
    print("MLX_CUDA_USE_CUDNN_SDPA =", os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "(default)"))
    rnd = lambda n: mx.random.randint(3, 1000, (1, n))  # noqa: E731
    cache = make_prompt_cache(model)
    print(f"prefill 1000: {ms(lambda: model(rnd(1000), cache=cache)):.1f} ms")
    for _ in range(6):
        y = rnd(5)
        off = cache[0].offset
        print(f"L=5 at new offset {off}: {ms(lambda: model(y, cache=cache)):.1f} ms")
    for _ in range(4):
        for c in cache:
            c.trim(5)
        print(f"L=5 at the same offset again: {ms(lambda: model(y, cache=cache)):.1f} ms")
    for _ in range(4):
        print(f"L=1 at {cache[0].offset}: {ms(lambda: model(rnd(1), cache=cache)):.1f} ms")
    for n in (3000, 4000, 4000):
        c2 = make_prompt_cache(model)
        x = rnd(n)
        total = ms(lambda: [model(x[:, i:i + 2048], cache=c2) for i in range(0, n, 2048)][-1])
        print(f"prefill {n} in 2048 chunks: {total:.1f} ms")
    for k in (37, 64, 101, 37):
        c3 = make_prompt_cache(model)
        ms(lambda: model(rnd(4096), cache=c3))
        print(f"suffix {k} after 4096: {ms(lambda: model(rnd(k), cache=c3)):.1f} ms")
    # quantized attention shapes: queries (B, H, M, D) against quantized keys (B, H, N, D)
    for M, N in ((1, 256), (1, 300), (2, 2), (5, 300), (1, 1024), (8, 4096)):
        q = mx.random.normal((1, 8, M, 128)).astype(mx.bfloat16)
        k = mx.random.normal((1, 8, N, 128)).astype(mx.bfloat16)
        for bits in (8, 4):
            try:
                qk = mx.quantize(k, group_size=64, bits=bits)
                mx.eval(mx.quantized_matmul(q, *qk, transpose=True, group_size=64, bits=bits))
                res = "ok"
            except Exception as exc:  # noqa: BLE001
                res = str(exc)[:90]
            print(f"quantized_matmul M={M} N={N} bits={bits}: {res}")


main()
