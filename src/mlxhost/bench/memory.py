"""`mlxhost bench memory`: what the memory features do to memory, in-process on one model.

(a) timeline: one long greedy generation with and without `--kv-prealloc`; MLX's active and peak
    memory after every step and the process RSS, so the 256-token staircase (or its absence) shows.
(b) burst: N long requests at once with admission control on (a small KV budget) and off (an
    unlimited one); the peak memory each reaches.

MLX's counters are process-wide: each run starts from a collected, cleared state and reports memory
above what the engine held before its first request (weights, the model's own buffers). The prefix
cache is off in both parts: its blocks grow memory on purpose and would blur what is measured.
"""

from __future__ import annotations

import argparse
import gc
import time
from datetime import datetime
from typing import Any

from mlxhost.bench import plot
from mlxhost.bench.report import format_table, write_json
from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.memory.device import read_memory
from mlxhost.models.loader import load_model
from mlxhost.testing.demo import ensure_demo_model

_MIB = 1 << 20
_UNLIMITED = 10**12


def _rss() -> int:
    return read_memory().process_rss


def _make_core(loaded, **kw):
    import mlx.core as mx  # lazy: mlx only when used

    from mlxhost.engine.core import EngineCore  # lazy: pulls in mlx_lm

    gc.collect()
    mx.clear_cache()
    config = EngineConfig(enable_prefix_cache=False, memory_refresh_s=0.0, **kw)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=1 << 20)
    gc.collect()
    mx.clear_cache()
    mx.synchronize()
    mx.reset_peak_memory()  # the start-up profiling pass set it
    return core


def _prompt(i: int, n: int) -> list[int]:
    return [(i * 7919 + j * 31) % 1500 + 3 for j in range(n)]


def run_timeline(loaded, prompt_tokens: int, num_tokens: int, kv_prealloc_tokens: int) -> dict:
    """Per step: MLX active and peak memory above the engine's baseline, and RSS."""
    import mlx.core as mx  # lazy: mlx only when used

    core = _make_core(loaded, max_num_seqs=1, kv_prealloc_tokens=kv_prealloc_tokens)
    base = mx.get_active_memory()
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(Request("timeline", _prompt(0, prompt_tokens), params))
    active, peak, rss, tokens = [], [], [], 0
    start = time.perf_counter()
    while core.has_work:
        tokens += sum(len(o.new_token_ids) for o in core.step())
        mx.synchronize()
        active.append(mx.get_active_memory() - base)
        peak.append(mx.get_peak_memory() - base)
        rss.append(_rss())
    elapsed = time.perf_counter() - start
    del core
    decode = active[1:-2] or active  # after the join, before the finished row is dropped
    return {
        "kv_prealloc_tokens": kv_prealloc_tokens,
        "num_tokens": tokens,
        "tok_s": tokens / elapsed if elapsed > 0 else None,
        "active_first": decode[0],
        "active_max": max(decode),
        "active_growth": max(decode) - decode[0],
        "num_active_increases": sum(b > a for a, b in zip(decode, decode[1:])),
        "peak_max": max(peak),
        "rss_first": rss[0],
        "rss_max": max(rss),
        "active": active,
        "peak": peak,
        "rss": rss,
    }


def run_burst(loaded, num_requests: int, prompt_tokens: int, max_tokens: int, kv_budget_tokens: int) -> dict:
    import mlx.core as mx  # lazy: mlx only when used

    core = _make_core(loaded, max_num_seqs=num_requests, kv_budget_tokens=kv_budget_tokens,
                      max_num_waiting=num_requests)
    base = mx.get_active_memory()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        core.add_request(Request(f"burst-{i}", _prompt(i + 1, prompt_tokens), params))
    max_running = max_active = tokens = steps = 0
    start = time.perf_counter()
    while core.has_work:
        tokens += sum(len(o.new_token_ids) for o in core.step())
        steps += 1
        max_running = max(max_running, core.scheduler.num_running)
        max_active = max(max_active, mx.get_active_memory() - base)
    mx.synchronize()
    elapsed = time.perf_counter() - start
    row = {
        "admission": "on" if kv_budget_tokens < _UNLIMITED else "off",
        "kv_budget_tokens": kv_budget_tokens if kv_budget_tokens < _UNLIMITED else None,
        "num_requests": num_requests,
        "num_tokens": tokens,
        "max_running": max_running,
        "steps": steps,
        "peak_mib": (mx.get_peak_memory() - base) / _MIB,
        "max_active_mib": max_active / _MIB,
        "wall_s": elapsed,
        "tok_s": tokens / elapsed if elapsed > 0 else None,
    }
    del core
    return row


TIMELINE_SUMMARY = [
    ("mode", "KV prealloc", ""), ("active_first_mib", "active@1 MiB", ".2f"), ("active_max_mib", "active max MiB", ".2f"),
    ("active_growth_mib", "growth MiB", ".2f"), ("num_active_increases", "# increases", "d"),
    ("peak_max_mib", "peak MiB", ".2f"), ("rss_growth_mib", "RSS growth MiB", ".1f"), ("tok_s", "tok/s", ".0f"),
]
BURST_COLUMNS = [
    ("admission", "admission", ""), ("kv_budget_tokens", "KV budget tok", "d"), ("max_running", "max running", "d"),
    ("peak_mib", "peak MiB", ".2f"), ("max_active_mib", "max active MiB", ".2f"), ("num_tokens", "tokens", "d"),
    ("tok_s", "tok/s", ".0f"),
]


def timeline_rows(runs: dict[str, dict], every: int) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """Memory over time, both runs side by side at every `every`-th step."""
    n = max(1, min(len(r["active"]) for r in runs.values()) - 2)  # the last steps drop the finished row
    steps = sorted(set(list(range(0, n, every)) + [n - 1]))
    cols = [("step", "step", "d")]
    for name in runs:
        cols += [(f"active_{name}", f"active {name} MiB", ".2f"), (f"peak_{name}", f"peak {name} MiB", ".2f")]
    rows = []
    for s in steps:
        row: dict[str, Any] = {"step": s}
        for name, r in runs.items():
            row[f"active_{name}"] = r["active"][s] / _MIB
            row[f"peak_{name}"] = r["peak"][s] / _MIB
        rows.append(row)
    return rows, cols


def summary_row(name: str, r: dict) -> dict:
    return {"mode": name, "active_first_mib": r["active_first"] / _MIB, "active_max_mib": r["active_max"] / _MIB,
            "active_growth_mib": r["active_growth"] / _MIB, "num_active_increases": r["num_active_increases"],
            "peak_max_mib": r["peak_max"] / _MIB, "rss_growth_mib": (r["rss_max"] - r["rss_first"]) / _MIB,
            "tok_s": r["tok_s"]}


def run_memory_bench(args: argparse.Namespace) -> dict:
    loaded = load_model(args.model or str(ensure_demo_model()))
    reserve = args.kv_prealloc or args.prompt_tokens + args.num_tokens
    # Warm-up past a 256-position step: the process's first allocations (~10-20 MiB of RSS here) stay
    # out of whichever run comes first.
    run_timeline(loaded, args.prompt_tokens, min(args.num_tokens, 300), 0)
    timeline = {
        "off": run_timeline(loaded, args.prompt_tokens, args.num_tokens, 0),
        "on": run_timeline(loaded, args.prompt_tokens, args.num_tokens, reserve),
    }
    per_request = args.burst_prompt_tokens + args.burst_max_tokens
    budget = args.burst_kv_budget_tokens or 4 * per_request
    burst = [
        run_burst(loaded, args.burst_requests, args.burst_prompt_tokens, args.burst_max_tokens, budget),
        run_burst(loaded, args.burst_requests, args.burst_prompt_tokens, args.burst_max_tokens, _UNLIMITED),
    ]
    return {
        "config": {k: v for k, v in vars(args).items() if not callable(v)},
        "timeline": timeline,
        "burst": burst,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the demo model)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="timeline: prompt length")
    parser.add_argument("--num-tokens", type=int, default=2048, help="timeline: tokens generated")
    parser.add_argument("--kv-prealloc", type=int, default=0,
                        help="timeline: reservation of the prealloc run (default: prompt + generated tokens)")
    parser.add_argument("--every", type=int, default=256, help="timeline: table row every N steps")
    parser.add_argument("--burst-requests", type=int, default=16, help="burst: requests sent at once")
    parser.add_argument("--burst-prompt-tokens", type=int, default=64, help="burst: prompt length of each request")
    parser.add_argument("--burst-max-tokens", type=int, default=512, help="burst: tokens each request generates")
    parser.add_argument("--burst-kv-budget-tokens", type=int, default=0,
                        help="admission on: KV budget (default: 4 requests' worth); off: unlimited")
    parser.add_argument("--output-json", default=None, help="result file (default: bench-results/memory-<time>.json)")
    plot.add_plot_argument(parser)


def run(args: argparse.Namespace) -> int:
    result = run_memory_bench(args)
    timeline = result["timeline"]
    print("(a) one generation, memory above the engine's baseline (MLX active/peak; RSS)")
    print(format_table([summary_row(n, r) for n, r in timeline.items()], TIMELINE_SUMMARY))
    print()
    rows, cols = timeline_rows(timeline, args.every)
    print(format_table(rows, cols))
    print()
    print(f"(b) {args.burst_requests} requests at once, {args.burst_prompt_tokens} + {args.burst_max_tokens} tokens each")
    print(format_table(result["burst"], BURST_COLUMNS))
    path = write_json(args.output_json or f"bench-results/memory-{datetime.now():%Y%m%d-%H%M%S}.json", result)
    print(f"wrote {path}")
    if args.plot is not None:
        plot.write_plot(plot.plot_memory, timeline, args.plot, path)
    ok = all(r["num_tokens"] == args.num_tokens for r in timeline.values())
    ok = ok and all(b["num_tokens"] == args.burst_requests * args.burst_max_tokens for b in result["burst"])
    return 0 if ok else 1
