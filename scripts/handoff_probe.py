"""Why one stream is slower served than in the core loop on MLX-CUDA (issue #19's c=1 gap).

Each variant keeps its engine for the whole run and serves one stream per round (the step rate, a step's end
to the next on the host clock, second request of each round), rounds interleaved so host drift hits every
row alike. `core` rows step an `EngineCore` on a thread of their own, as the engine thread does but without
asyncio; `async` rows go through `AsyncEngine` on an asyncio loop. `plain`: no decode buckets, no warm-up
(as the CPU serves); `default`: the CUDA defaults (`make_engine`: buckets and warm-up); `buckets`/`warm`:
one of the two. usage: python scripts/handoff_probe.py MODEL_DIR [TOKENS] [ROUNDS]
"""
import asyncio
import dataclasses
import queue
import statistics
import sys
import threading
import time
import uuid

import mlx.core as mx

from mlxserve.bench.decode import _raw
from mlxserve.config import EngineConfig
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.models.loader import load_model
from mlxserve.server import make_engine

loaded = load_model(sys.argv[1])
N = int(sys.argv[2]) if len(sys.argv) > 2 else 256
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 4
prompt = loaded.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 20)
base = EngineConfig(max_num_seqs=64, enable_prefix_cache=False)
CONFIGS = {
    "plain": dataclasses.replace(base, decode_buckets="off", warmup="off"),
    "buckets": dataclasses.replace(base, decode_buckets="on", warmup="off"),
    "warm": dataclasses.replace(base, decode_buckets="off", warmup="on"),
    "default": base,
}


def _params():
    return SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def _gaps(stamps):
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]


class CoreThread:
    """An EngineCore built and stepped on its own thread (MLX state stays with the thread that made it)."""

    def __init__(self, cfg):
        self.inbox, self.result = queue.Queue(), queue.Queue()
        threading.Thread(target=self._run, args=(cfg,), daemon=True).start()
        self.result.get()

    def _run(self, cfg):
        with mx.stream(mx.default_stream(mx.default_device())):
            core = make_engine(loaded, cfg, 1 << 20)._make_core()  # buckets and warm-up as served
            self.result.put(None)
            while self.inbox.get() is not None:
                stamps = []
                for _ in range(2):
                    stamps = []
                    core.add_request(Request(uuid.uuid4().hex, prompt, _params(), []))
                    while core.has_work:
                        if core.step():
                            stamps.append(time.perf_counter())
                self.result.put(_gaps(stamps))

    def run(self):
        self.inbox.put(1)
        return self.result.get()


async def _serve_one(engine):
    stamps = []
    for _ in range(2):
        stamps = []
        async for _ in engine.generate(Request(uuid.uuid4().hex, prompt, _params(), [])):
            stamps.append(time.perf_counter())
    return _gaps(stamps)


async def main():
    loop = asyncio.get_running_loop()
    cores = {f"core {k}": CoreThread(CONFIGS[k]) for k in ("plain", "default")}
    engines = {}
    for k, cfg in CONFIGS.items():
        engines[f"async {k}"] = make_engine(loaded, cfg, 1 << 20)
        engines[f"async {k}"].start(loop)
    table = {}
    _raw(loaded.model, prompt, N)  # untimed: the first pass compiles kernels
    for r in range(ROUNDS):
        raw = _raw(loaded.model, prompt, N)
        table.setdefault("raw", []).append(raw["tok_s"])
        rows = {"raw": raw["tok_s"]}
        for name, core in cores.items():
            gaps = await loop.run_in_executor(None, core.run)
            rows[name] = table.setdefault(name, []).append(len(gaps) / sum(gaps)) or table[name][-1]
        for name, engine in engines.items():
            gaps = await _serve_one(engine)
            rows[name] = table.setdefault(name, []).append(len(gaps) / sum(gaps)) or table[name][-1]
        print(f"round {r}: " + ", ".join(f"{k} {v:.0f}" for k, v in rows.items()), flush=True)
    for engine in engines.values():
        engine.stop()
    for core in cores.values():
        core.inbox.put(None)
    raw_med = statistics.median(table["raw"])
    print("\nmedian over rounds (x raw):")
    for label, rates in table.items():
        med = statistics.median(rates)
        print(f"{label:14s} {med:8.1f} tok/s  {med / raw_med:.3f}x   ({', '.join(f'{x:.0f}' for x in rates)})")


asyncio.run(main())
