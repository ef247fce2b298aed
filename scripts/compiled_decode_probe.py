"""Can one stream decode faster than mlx-lm's generate_step with a compiled step (#19's stretch goal)?

On the H100 hosts one 0.6B stream is bound by the host: the GPU is busy 23-38% of a 3.8-6.2 ms step
(`scripts/host_probe.py`), the rest is Python building the step's graph and MLX encoding its kernels.
`mx.compile` replays a traced graph instead of running the model's Python and fuses elementwise ops.
A compiled step needs a cache whose shapes do not change every token: this probe keeps each layer's
keys and values in a buffer of fixed capacity, writes the new position with `mx.slice_update` at an
offset passed as an array, and masks the unused tail (mlx-lm's attention reads `cache.offset`,
`update_and_fetch` and `make_mask`, the protocol its own caches implement).

Rows, interleaved over rounds: mlx-lm's generate_step; the same pipelined loop over a plain KVCache
with argmax (what the engine's lone row runs); the compiled step. Greedy tokens of the last two are
compared.

usage: python scripts/compiled_decode_probe.py MODEL_DIR [--tokens 256] [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx


class _View:
    """One layer's cache inside the compiled step: fixed-capacity buffers, the write position as an array."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, k: mx.array, v: mx.array):
        start = self.offset[None]
        self.keys = mx.slice_update(self.keys, k, start, axes=(2,))
        self.values = mx.slice_update(self.values, v, start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size=None):
        # One new token at position `offset` sees positions 0..offset; the buffer's tail is unused.
        return mx.arange(self.keys.shape[2]) <= self.offset


def make_compiled_step(model, n_layers: int):
    def step(tok, offset, *kv):
        views = [_View(kv[2 * i], kv[2 * i + 1], offset) for i in range(n_layers)]
        logits = model(tok[:, None], cache=views)[:, -1, :]
        out = [mx.argmax(logits, axis=-1)]
        for v in views:
            out += [v.keys, v.values]
        return out

    return mx.compile(step)


def _capacity(n: int) -> int:
    c = 256
    while c < n:
        c *= 2
    return c


def prefill(model, prompt: mx.array):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)[:, -1, :]
    tok = mx.argmax(logits, axis=-1)
    mx.eval(tok, [c.state for c in cache])
    return tok, cache


def _pipelined(tok: mx.array, forward, n: int):
    """generate_step's pipelining: launch token i+1 before reading token i back; the gaps between reads."""
    nxt = forward(tok)
    mx.async_eval(nxt)
    toks, times, last = [tok.item()], [], None
    for _ in range(n - 1):
        fut = forward(nxt)
        mx.async_eval(fut)
        toks.append(nxt.item())
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
        nxt = fut
    return toks, times


def plain_loop(model, prompt: mx.array, n: int):
    tok, cache = prefill(model, prompt)
    return _pipelined(tok, lambda t: mx.argmax(model(t[:, None], cache=cache)[:, -1, :], axis=-1), n)


def compiled_loop(model, step, prompt: mx.array, n: int):
    tok, cache = prefill(model, prompt)
    off = cache[0].offset
    cap = _capacity(off + n + 1)
    kv = []
    for c in cache:
        for a in (c.keys, c.values):
            buf = mx.zeros((*a.shape[:2], cap, a.shape[3]), dtype=a.dtype)
            buf[..., :off, :] = a[..., :off, :]
            kv.append(buf)
    del cache
    mx.eval(kv)
    state = {"off": off, "kv": kv}

    def forward(t):
        # The old buffers are dropped before the step is evaluated, so slice_update can write in place.
        out = step(t, mx.array(state["off"], dtype=mx.int32), *state["kv"])
        state["off"] += 1
        state["kv"] = out[1:]
        return out[0]

    return _pipelined(tok, forward, n)


def raw_loop(model, prompt: mx.array, n: int):
    from mlx_lm.generate import generate_step

    toks, times, last = [], [], None
    for t, _ in generate_step(prompt, model, max_tokens=n):
        toks.append(t)
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return toks, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    from mlx_lm import load

    model, tokenizer = load(args.model)
    prompt = mx.array(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 16))
    step = make_compiled_step(model, len(model.layers))
    rows = {"raw generate_step": lambda: raw_loop(model, prompt, args.tokens),
            "plain KVCache + argmax": lambda: plain_loop(model, prompt, args.tokens),
            "compiled step": lambda: compiled_loop(model, step, prompt, args.tokens)}
    t0 = time.perf_counter()
    for fn in rows.values():  # compile kernels and trace once
        fn()
    print(f"first passes took {time.perf_counter() - t0:.1f} s", flush=True)
    rates: dict[str, list[float]] = {k: [] for k in rows}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        line = []
        for name, fn in rows.items():
            toks, times = fn()
            tokens[name] = toks
            rate = len(times) / sum(times)
            rates[name].append(rate)
            line.append(f"{name} {rate:6.1f} (p50 {statistics.median(times) * 1000:.2f} ms)")
        print(f"round {r}: " + " | ".join(line), flush=True)
    for name, rs in rates.items():
        print(f"{name:24s} median {statistics.median(rs):7.1f} tok/s")
    base = rates["raw generate_step"]
    for name in ("plain KVCache + argmax", "compiled step"):
        ratios = [a / b for a, b in zip(rates[name], base)]
        print(f"{name} / raw per round: median {statistics.median(ratios):.3f}x "
              f"({', '.join(f'{x:.2f}' for x in ratios)})")
    a, b = tokens["plain KVCache + argmax"], tokens["compiled step"]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    print(f"greedy tokens: compiled matches plain for the first {same} of {len(a)}")


if __name__ == "__main__":
    main()
