"""Where a busy decode batch's time goes on MLX-CUDA (issue #19: at 64 streams a decode step took
~21 ms and a step that also prefilled ~94 ms): the pieces in isolation, each timed to completion.
- a decode step (forward + argmax) over B rows of a BatchKVCache W positions wide, synced and pipelined;
- mlx-lm's BatchKVCache.extend (a row joins), filter (a row leaves), and a single row written into a
  free slot of the batch (what a join could cost);
- several prompts' chunks prefilled together (engine/batch_prefill.py) at the engine's chunk sizes.
usage: python3 scripts/cuda_batch_probe.py MODEL_DIR [B,B,...]   (default 32,64)"""
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlxserve.engine.batch_prefill import prefill_rows


def ms(fn, repeats=7):
    """Median ms of fn() run to completion (its result evaluated), after one untimed run."""
    times = []
    for i in range(repeats + 1):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        if i:
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def prompt_cache(model, n):
    cache = make_prompt_cache(model)
    model(mx.random.randint(3, 1000, (1, n)), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def batch_cache(model, lengths):
    rows = [prompt_cache(model, n) for n in lengths]
    batch = [BatchKVCache.merge(list(layer)) for layer in zip(*rows)]
    mx.eval([c.state for c in batch])
    return batch


def copy_batch(batch):
    out = []
    for c in batch:
        n = BatchKVCache([0])
        n.state = c.state
        out.append(n)
    return out


def main():
    path = sys.argv[1]
    sizes = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "32,64").split(",")]
    model, _ = load(path)
    print("MLX", mx.__version__, mx.default_device())
    for B in sizes:  # B >= 2 (filter keeps B - 1 rows)
        lengths = [180 + (37 * i) % 130 for i in range(B)]  # 180-309 tokens, as rows at different stages
        batch = batch_cache(model, lengths)
        tokens = mx.random.randint(3, 1000, (B,))

        def step(cache=batch):
            return mx.argmax(model(tokens[:, None], cache=cache)[:, -1, :], axis=-1)

        synced = ms(step)
        # Pipelined as the engine runs it: build step n+1, start it, then read step n.
        nxt = step()
        mx.async_eval(nxt)
        t = time.perf_counter()
        for _ in range(32):
            new = step()
            mx.async_eval(new)
            nxt.tolist()
            nxt = new
        nxt.tolist()
        piped = (time.perf_counter() - t) * 1000 / 32
        active = mx.get_active_memory() / 2**30
        one = [prompt_cache(model, 200)]
        one = [BatchKVCache.merge([c]) for c in one[0]]

        def extend():
            b = copy_batch(batch)
            for c, o in zip(b, one):
                c.extend(o)
            return [c.state[:2] for c in b]

        def filter_one():
            b = copy_batch(batch)
            keep = mx.array(list(range(1, B)))
            for c in b:
                c.filter(keep)
            return [c.state[:2] for c in b]

        scratch = [mx.array(a) for c in batch for a in c.state[:2]]
        mx.eval(scratch)

        def write_slot():
            # In place (the scratch buffers are donated): row 0's last n positions take the new row.
            for i, o in enumerate(one):
                idx, n = batch[i].state[4], o.state[4]
                for j in (0, 1):
                    a = scratch[2 * i + j]
                    a[0:1, :, idx - n:idx, :] = o.state[j][:, :, :n, :]
                    scratch[2 * i + j] = a
            return scratch

        width = batch[0].state[4]
        print(f"B={B} width {width}: decode step synced {synced:.2f} ms, pipelined {piped:.2f} ms; "
              f"extend by one row {ms(extend):.2f} ms; filter one row out {ms(filter_one):.2f} ms; "
              f"one row written into a slot {ms(write_slot):.2f} ms; MLX active {active:.2f} GiB")
    for k, n, ctx in ((8, 64, 0), (8, 64, 64), (8, 180, 0), (4, 180, 0), (1, 180, 0)):
        caches = [prompt_cache(model, ctx) if ctx else make_prompt_cache(model) for _ in range(k)]
        chunks = [[5 + (i + j) % 900 for j in range(n - i)] for i in range(k)]

        def together():
            logits, new = prefill_rows(model, caches, chunks)
            return [logits] + [c.state for row in new for c in row]

        print(f"prefill_rows {k} chunks of ~{n} after {ctx}: {ms(together, 5):.2f} ms")


if __name__ == "__main__":
    main()
