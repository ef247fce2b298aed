"""`mlxhost bench decode`: where single-stream decode time goes.

One greedy stream of `--max-tokens` tokens through the layers of the stack, same model, same prompt:
mlx-lm's own `generate_step` (the reference), the engine core stepped in a plain loop (scheduler +
runner + detokenizer, no threads), the same loop on a thread of its own (MLX gives each thread its own
default stream; the model was loaded on the main thread's), and the async engine (engine thread +
asyncio hand-off). The gaps between the rows are the costs of each layer.

`--url` adds a served row: one streamed request per round to a running server (its model must be the
same folder), timed by the client as `bench serve` times it. A shared GPU host's CPU flips between a fast
and a slow mode every 1-5 s (the same raw loop: 3.8 then 6.2 ms a step), so each round times raw
`generate_step` and the served stream back to back (raw's untimed compile pass runs once, before the
rounds) and in turns first: raw then served in even rounds, served then raw in odd ones. Each round's
served/raw ratio and order are kept beside the table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import threading
import time
import uuid

from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import ServeBenchConfig, default_json_path
from mlxhost.bench.serve_request import make_client, make_prompt, timed_request
from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.testing.demo import ensure_demo_model

PATHS = ("raw", "core", "thread", "async")
_WAKE_TOKENS = 8  # the untimed request before each timed served one
_COLUMNS = [("path", "path", "s"), ("tok_s", "tok/s", ".1f"), ("ratio", "vs raw", ".2f"),
            ("step_p50_ms", "step p50 ms", ".2f"), ("step_max_ms", "step max ms", ".1f")]


def _raw(model, prompt_ids: list[int], max_tokens: int) -> dict:
    import mlx.core as mx  # lazy: mlx only when used
    from mlx_lm.generate import generate_step  # lazy: mlx_lm only when used

    # One pass: `run` makes the untimed first one (it compiles kernels) once, before the rounds, so
    # nothing stands between this pass and the served stream it is compared with.
    times, last = [], None
    for _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens):
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return _row("mlx-lm generate_step", times)


def _core(loaded, cfg: EngineConfig, prompt_ids: list[int], max_tokens: int, label: str) -> dict:
    from mlxhost.engine.core import EngineCore  # lazy: pulls in mlx_lm

    core = EngineCore(loaded.model, loaded.tokenizer, cfg, 1 << 20)
    best = None
    for rep in range(2):  # the first pass compiles kernels / fills caches; the second is measured
        core.add_request(Request(f"{label}-{rep}", prompt_ids,
                                 SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), []))
        times, last = [], None
        while core.has_work:
            outs = core.step()
            now = time.perf_counter()
            if outs:
                if last is not None:
                    times.append(now - last)
                last = now
        best = times
    return _row(label, best)


def _core_on_thread(loaded, cfg: EngineConfig, prompt_ids: list[int], max_tokens: int) -> dict:
    """The core loop on a new thread, as the engine thread runs it, without asyncio: tells a cost of
    running MLX off the loading thread apart from the hand-off to asyncio."""
    out: dict = {}

    def body() -> None:
        try:
            out["row"] = _core(loaded, cfg, prompt_ids, max_tokens, "engine core loop (own thread)")
        except BaseException as exc:  # re-raised on the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=body, name="bench-core")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["row"]


async def _async(loaded, cfg: EngineConfig, prompt_ids: list[int], max_tokens: int,
                 switch_s: float | None = None) -> dict:
    from mlxhost.server.app import make_engine  # lazy: pulls in fastapi

    previous = sys.getswitchinterval()
    if switch_s is not None:
        sys.setswitchinterval(switch_s)

    engine = make_engine(loaded, cfg, 1 << 20)
    engine.start(asyncio.get_running_loop())
    try:
        times = []
        for _ in range(2):
            times, last = [], None
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for _out in engine.generate(Request(uuid.uuid4().hex, prompt_ids, params, [])):
                now = time.perf_counter()
                if last is not None:
                    times.append(now - last)
                last = now
    finally:
        engine.stop()
        sys.setswitchinterval(previous)
    label = "async engine (engine thread + asyncio)"
    return _row(label if switch_s is None else f"{label}, GIL switch {switch_s * 1000:g} ms", times)


def _row(path: str, gaps: list[float]) -> dict:
    gaps = gaps[1:] or gaps  # the gap after the first token still holds prefill bookkeeping
    total = sum(gaps)
    return {"path": path, "tok_s": len(gaps) / total if total else None,
            "step_p50_ms": statistics.median(gaps) * 1000 if gaps else None,
            "step_max_ms": max(gaps) * 1000 if gaps else None}


async def _served(cfg, prompt: str) -> dict:
    """One streamed request to the server at `cfg.url`, timed as `bench serve` times a stream (content
    chunks after the first; usage spreads tokens over chunks), right after a short untimed one that wakes
    the server: 8B shape on an H100, 155 tok/s for the one stream timed right after another, 96-112 for the
    five timed first after the server sat idle while the raw row ran. The wake asks for few tokens so the
    timed stream stays close in time to the raw pass it is compared with."""
    async with make_client(cfg, 1) as client:
        await timed_request(client, dataclasses.replace(cfg, max_tokens=_WAKE_TOKENS), prompt)
        result = await timed_request(client, cfg, prompt)
    if not result.ok:
        raise RuntimeError(f"served request failed: {result.error}")
    gaps = sorted(result.itl_s)
    return {"path": f"served over HTTP ({cfg.display_label})", "tok_s": result.decode_tok_s,
            "step_p50_ms": statistics.median(gaps) * 1000 if gaps else None,
            "step_max_ms": gaps[-1] * 1000 if gaps else None}


def run(args: argparse.Namespace) -> int:
    unknown = set(args.paths) - set(PATHS)
    if unknown or not args.paths:
        raise SystemExit(f"--paths takes some of {', '.join(PATHS)}; got {', '.join(sorted(unknown)) or 'none'}")
    served = None
    if args.url:
        served = ServeBenchConfig(url=args.url, model=args.served_model, concurrency=[1],
                                  max_tokens=args.max_tokens, endpoint="completions", warmup=0, label="served")
    loaded = load_model(args.model or str(ensure_demo_model()))
    prompt = make_prompt(0, "decode", 0, args.prompt_tokens)
    prompt_ids = loaded.tokenizer.encode(prompt)
    base = EngineConfig(max_num_seqs=args.max_num_seqs, enable_prefix_cache=False)
    _raw(loaded.model, prompt_ids, args.max_tokens)  # untimed, once: the first pass compiles kernels
    measure = {"raw": lambda: _raw(loaded.model, prompt_ids, args.max_tokens)}  # the reference runs every round
    if served is not None:
        measure["served"] = lambda: asyncio.run(_served(served, prompt))
    rows, round_ratios, round_orders = [], [], []
    for rep in range(args.repeat):
        # Raw and served back to back (the host's CPU mode flips every 1-5 s), odd rounds served first:
        # neither side is always the one timed first.
        order = list(measure)[::-1] if rep % 2 else list(measure)
        pair = {side: measure[side]() for side in order}
        rows.extend(pair.values())
        if served is not None:
            round_ratios.append(pair["served"]["tok_s"] / pair["raw"]["tok_s"])
            round_orders.append(order)
        if "core" in args.paths:
            rows.append(_core(loaded, base, prompt_ids, args.max_tokens, "engine core loop"))
        if "thread" in args.paths:
            rows.append(_core_on_thread(loaded, base, prompt_ids, args.max_tokens))
        if "async" in args.paths:
            rows.append(asyncio.run(_async(loaded, base, prompt_ids, args.max_tokens)))
            for switch_s in args.switch_intervals:
                rows.append(asyncio.run(_async(loaded, base, prompt_ids, args.max_tokens, switch_s)))
    raw = statistics.median(r["tok_s"] for r in rows if r["path"].startswith("mlx-lm"))
    for r in rows:
        r["ratio"] = r["tok_s"] / raw if r["tok_s"] and raw else None
    print(format_table(rows, _COLUMNS))
    result = {"model": args.model, "max_tokens": args.max_tokens, "rows": rows}
    if served is not None:
        tok_s = statistics.median(r["tok_s"] for r in rows if r["path"].startswith("served"))
        result["served"] = {"url": args.url, "median_tok_s": tok_s, "median_vs_raw": tok_s / raw,
                            "round_ratios": round_ratios, "round_orders": round_orders,
                            "median_round_ratio": statistics.median(round_ratios)}
        print(f"served: median {tok_s:.1f} tok/s = {tok_s / raw:.3f}x the median raw; per round "
              f"{', '.join(f'{x:.3f}' for x in round_ratios)} (median {statistics.median(round_ratios):.3f}x)")
    path = write_json(args.output_json or default_json_path("decode"), result)
    print(f"wrote {path}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or hub id (default: the demo model)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens generated per stream")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the engine's batch limit (as served)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="rounds over all paths (spread between runs); raw and --url's served stream run "
                             "back to back in each, in turns first")
    parser.add_argument("--switch-intervals", type=lambda t: [float(x) / 1000 for x in t.split(",") if x],
                        default=[], metavar="MS,...", help="also run the async engine with these GIL switch intervals")
    parser.add_argument("--paths", type=lambda t: [x for x in t.split(",") if x], default=list(PATHS),
                        metavar="P,...", help="in-process paths to run each round: raw (always run: the reference), "
                                              "core, thread, async")
    parser.add_argument("--url", default=None,
                        help="also time one streamed request per round to this running server (same model folder), "
                             "right after a short untimed one (max_tokens 8) that wakes it")
    parser.add_argument("--served-model", default="bench", help="the model name sent to --url")
    parser.add_argument("--output-json", default=None, help="result file (default: bench-results/decode-*.json)")
