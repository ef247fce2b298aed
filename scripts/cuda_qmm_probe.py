"""Does MLX-CUDA's quantized matmul read the weights once per leading batch entry? (issue #19: at 16-32
decode rows an 8B step took 59 / 112 ms against 6 ms for one row, in mlxserve and vllm-mlx alike.)
1. one projection: x shaped (B, 1, K) as a decode step passes it, against the same rows as (B, K);
2. a whole decode step of the model over B rows of a plain KVCache, before and after
   models/quantized_rows.fold_quantized_rows, with the largest logit difference.
usage: python3 scripts/cuda_qmm_probe.py MODEL_DIR [B,B,...]   (default 1,2,4,8,16,32,64)"""
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxserve.models.quantized_rows import fold_quantized_rows


def ms(fn, repeats=10):
    times = []
    for i in range(repeats + 2):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def projections(model, rows):
    layer = model.model.layers[0]
    for name, proj in (("q_proj", layer.self_attn.q_proj), ("down_proj", layer.mlp.down_proj)):
        k = proj.weight.shape[1] * 32 // proj.bits
        for b in rows:
            x = mx.random.normal((b, 1, k)).astype(mx.bfloat16)
            batched = ms(lambda: proj(x))
            folded = ms(lambda: proj(x.reshape(b, k)))
            print(f"{name} K={k} N={proj.weight.shape[0]} B={b}: (B,1,K) {batched:.3f} ms  (B,K) {folded:.3f} ms")


def decode_steps(model, rows, prompt=128):
    out = {}
    mx.random.seed(0)  # the same prompts and tokens before and after folding
    for b in rows:
        cache = make_prompt_cache(model)
        tokens = mx.random.randint(0, 1000, (b, prompt))
        mx.eval(model(tokens, cache=cache))
        mx.eval([c.state for c in cache])
        step = mx.random.randint(0, 1000, (b, 1))

        def run():
            logits = model(step, cache=cache)
            for c in cache:  # stay at the same width
                c.offset -= 1
            return logits

        out[b] = (ms(run), run())
    return out


def main():
    model, _ = load(sys.argv[1])
    rows = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8,16,32,64").split(",")]
    print("mlx", mx.__version__, mx.default_device())
    projections(model, rows)
    before = decode_steps(model, rows)
    print("replaced", fold_quantized_rows(model), "layers")
    projections(model, rows[-2:])
    after = decode_steps(model, rows)
    for b in rows:
        diff = mx.abs(before[b][1].astype(mx.float32) - after[b][1].astype(mx.float32)).max().item()
        print(f"decode step B={b}: {before[b][0]:.2f} ms -> {after[b][0]:.2f} ms folded "
              f"({before[b][0] / after[b][0]:.2f}x), max logit diff {diff:.4f}")


if __name__ == "__main__":
    main()
