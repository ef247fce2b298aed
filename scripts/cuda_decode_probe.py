"""Why a batched decode step is slow on MLX-CUDA (issue #19): B rows over a KV cache W wide, through
mlx-lm's BatchKVCache (per-row offsets, an array mask: MLX-CUDA's vector attention kernel takes no mask,
so attention falls back) against a plain KVCache holding the same B rows (scalar offset, no mask), and
attention alone both ways. usage: python3 scripts/cuda_decode_probe.py MODEL_DIR"""
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, KVCache

from cuda_batch_probe import ms  # scripts/, beside this file


def model_dtype(model):
    try:
        return model.model.embed_tokens(mx.array([[1]])).dtype
    except Exception:  # noqa: BLE001
        return mx.bfloat16


def filled(model, B, W, batch):
    """Caches of B rows, W positions each, random keys/values (the timing does not depend on them)."""
    args = model.args
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    caches = []
    for _ in model.layers:
        k = mx.random.normal((B, heads, W + 256, dim)).astype(model_dtype(model))
        v = mx.random.normal((B, heads, W + 256, dim)).astype(model_dtype(model))
        if batch:
            c = BatchKVCache([i % 7 for i in range(B)])  # a little left padding per row
            c.keys, c.values, c._idx = k, v, W
            c.offset = mx.array([W - i % 7 for i in range(B)])
        else:
            c = KVCache()
            c.keys, c.values, c.offset = k, v, W
        caches.append(c)
    mx.eval([c.keys for c in caches])
    return caches


def main():
    model, _ = load(sys.argv[1])
    print("MLX", mx.__version__, mx.default_device(), model_dtype(model))
    args = model.args
    heads, kv = args.num_attention_heads, getattr(args, "num_key_value_heads", args.num_attention_heads)
    dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    for B in (1, 16, 32, 64):
        for W in (128, 512, 1024):
            tokens = mx.random.randint(3, 1000, (B, 1))
            row = {}
            for name, batch in (("batch", True), ("plain", False)):
                caches = filled(model, B, W, batch)

                def step():
                    out = model(tokens, cache=caches)
                    for c in caches:  # back to W: every timed step sees the same width
                        if batch:
                            c._idx -= 1
                            c.offset = c.offset - 1
                        else:
                            c.offset -= 1
                    return mx.argmax(out[:, -1, :], axis=-1)

                row[name] = ms(step, 9)
            dt = model_dtype(model)
            q = mx.random.normal((B, heads, 1, dim)).astype(dt)
            k = mx.random.normal((B, kv, W, dim)).astype(dt)
            v = mx.random.normal((B, kv, W, dim)).astype(dt)
            mask = mx.arange(W)[None, None, None, :] >= mx.array([i % 7 for i in range(B)])[:, None, None, None]
            sdpa = mx.fast.scaled_dot_product_attention
            a_mask = ms(lambda: [sdpa(q, k, v, scale=0.1, mask=mask) for _ in range(28)], 9)
            a_none = ms(lambda: [sdpa(q, k, v, scale=0.1) for _ in range(28)], 9)
            print(f"B={B:3d} W={W:5d}: step batch cache {row['batch']:7.2f} ms, plain cache {row['plain']:7.2f} ms;"
                  f" 28 attentions with mask {a_mask:7.2f} ms, without {a_none:7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
