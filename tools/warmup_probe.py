"""What the background warm-up leaves behind that slows a lone stream (MLX-CUDA).

Served with `--warmup off` a lone stream decodes at raw `generate_step` speed; after the default warm-up it
read 0.87x (docs/BENCHMARKS.md, "One stream on MLX-CUDA"). This probe reproduces that in one process and
splits it: raw `generate_step` and the engine core loop, timed in paired rounds, before any warm-up, then
after the whole warm-up, then after each warm-up piece run alone on a fresh core. Process-wide state (MLX's
buffer cache, compiled kernels, Python's heap) is told apart from the core's own state by timing both the
warmed core and a core built after it.

usage: python tools/warmup_probe.py MODEL [--tokens 256] [--rounds 3] [--pieces all|lone,...]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.warmup import BackgroundWarmup
from mlxhost.models.loader import load_model


def raw_tok_s(model, prompt: list[int], tokens: int) -> float:
    times, last = [], None
    for _ in generate_step(mx.array(prompt), model, max_tokens=tokens):
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    gaps = times[1:]
    return len(gaps) / sum(gaps)


def core_tok_s(core: EngineCore, prompt: list[int], tokens: int, tag: str) -> float:
    core.add_request(Request(tag, prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), []))
    times, last = [], None
    while core.has_work:
        if core.step():
            now = time.perf_counter()
            if last is not None:
                times.append(now - last)
            last = now
    gaps = times[1:]
    return len(gaps) / sum(gaps)


def paired(core: EngineCore, model, prompt: list[int], tokens: int, rounds: int, tag: str) -> dict:
    """Median core/raw ratio over rounds, each round raw and core back to back (order alternating)."""
    ratios, raws, cores = [], [], []
    core_tok_s(core, prompt, 8, f"{tag}-wake")
    for i in range(rounds):
        if i % 2:
            c = core_tok_s(core, prompt, tokens, f"{tag}-{i}")
            r = raw_tok_s(model, prompt, tokens)
        else:
            r = raw_tok_s(model, prompt, tokens)
            c = core_tok_s(core, prompt, tokens, f"{tag}-{i}")
        ratios.append(c / r)
        raws.append(r)
        cores.append(c)
    row = {"label": tag, "ratio": statistics.median(ratios), "raw": statistics.median(raws),
           "core": statistics.median(cores), "ratios": [round(x, 3) for x in ratios],
           "gc_objects": len(gc.get_objects()), "mlx_cache_gib": mx.get_cache_memory() / 2**30,
           "mlx_active_gib": mx.get_active_memory() / 2**30}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--pieces", default="all")
    parser.add_argument("--tiles", action="store_true",
                        help="last: the server's warm-up with its tiled-kernel helper processes (MLX-CUDA)")
    args = parser.parse_args()
    loaded = load_model(args.model)
    prompt = loaded.tokenizer.encode("Tell me a long story about a lighthouse keeper. " * 10)
    cfg = EngineConfig(max_num_seqs=args.max_batch)

    def fresh() -> EngineCore:
        return EngineCore(loaded.model, loaded.tokenizer, cfg, 1 << 20)

    raw_tok_s(loaded.model, prompt, 16)  # kernels compile once, untimed
    rows = [paired(fresh(), loaded.model, prompt, args.tokens, args.rounds, "no warm-up")]
    core = fresh()
    t = time.perf_counter()
    BackgroundWarmup(args.max_batch, core.runner.buckets).run_to_end(core)
    print(f"whole warm-up: {time.perf_counter() - t:.1f} s", flush=True)
    rows.append(paired(core, loaded.model, prompt, args.tokens, args.rounds, "after whole warm-up (same core)"))
    rows.append(paired(fresh(), loaded.model, prompt, args.tokens, args.rounds, "after whole warm-up (new core)"))
    # Each piece alone on a fresh core (kernels are compiled by now: what remains is the core's own state).
    names = [p.name for p in BackgroundWarmup(args.max_batch, None)._pieces]
    chosen = names if args.pieces == "all" else [n for n in names if n.split()[0] in args.pieces.split(",")]
    for name in chosen:
        core = fresh()
        warm = BackgroundWarmup(args.max_batch, core.runner.buckets)
        warm._pieces = [p for p in warm._pieces if p.name == name]
        warm.run_to_end(core)
        rows.append(paired(core, loaded.model, prompt, args.tokens, args.rounds, f"after {name} alone"))
    if args.tiles:
        from mlxhost.engine.warmup import make_warmup

        core = fresh()
        t = time.perf_counter()
        make_warmup(core, args.max_batch, compile_tiles=True).run_to_end(core)
        print(f"warm-up with tiled kernels: {time.perf_counter() - t:.1f} s", flush=True)
        rows.append(paired(core, loaded.model, prompt, args.tokens, args.rounds, "after warm-up + tiles (same core)"))
        rows.append(paired(fresh(), loaded.model, prompt, args.tokens, args.rounds, "after warm-up + tiles (new core)"))
    print(f"{'label':45s} {'core/raw':>8s} {'raw tok/s':>9s} {'core tok/s':>10s}")
    for r in rows:
        print(f"{r['label']:45s} {r['ratio']:8.3f} {r['raw']:9.1f} {r['core']:10.1f}  {r['ratios']}")


if __name__ == "__main__":
    main()
