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

`--host-table` adds where the host's time per decode step goes on the core, thread and async paths: the
median of each phase the engine records per step (engine/contract.py StepInfo; the async path's from the
step trace its engine thread writes, MLXHOST_STEP_TRACE), the whole step, and the time between consecutive
tokens as the consumer sees them; the gap minus the step is the hand-off's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import ServeBenchConfig, default_json_path
from mlxhost.bench.serve_request import make_client, make_prompt, timed_request
from mlxhost.config import EngineConfig
from mlxhost.engine.contract import StepInfo
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.testing.demo import ensure_demo_model

PATHS = ("raw", "core", "thread", "async")
_WAKE_TOKENS = 8  # the untimed request before each timed served one
_COLUMNS = [("path", "path", "s"), ("tok_s", "tok/s", ".1f"), ("ratio", "vs raw", ".2f"),
            ("step_p50_ms", "step p50 ms", ".2f"), ("step_max_ms", "step max ms", ".1f")]
# The host table's phases (StepInfo's fields; forward: the rest of the runner's decode), then the whole
# step as the loop timed core.step(), and the consumer's gap between tokens.
_PHASES = ("schedule", "runner", "forward", "sample", "launch", "readback", "detok", "update", "output", "step")
_HOST_COLUMNS = [("path", "path", "s"), ("num_steps", "steps", "d"),
                 *((f"{p}_us", p, ".0f") for p in _PHASES), ("gap_us", "gap", ".0f"),
                 ("handoff_us", "gap-step", ".0f")]


@dataclass
class _HostSamples:
    """One path's decode steps over all rounds (phase -> seconds) and the consumer's gaps per token, seconds."""

    steps: list[dict] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)


def _decode_phases(info: StepInfo, step_s: float) -> dict | None:
    """A decode-only step's phases; None for a step that prefilled (its prefill's time spreads over the phases)."""
    if info.prefill_chunk_tokens or not info.num_decoding:
        return None
    return {"schedule": info.schedule_s, "runner": info.execute_s,
            "forward": info.decode_s - info.sample_s - info.launch_s - info.readback_s,
            "sample": info.sample_s, "launch": info.launch_s, "readback": info.readback_s,
            "detok": info.detok_s, "update": info.update_s, "output": info.output_s, "step": step_s}


def _traced_steps(path: Path, skip: int) -> list[dict]:
    """The decode phases of the step trace's lines after its first `skip` (engine/loop.py's `_StepTrace`)."""
    header, *lines = path.read_text().splitlines()
    names = header.split("\t")
    steps = []
    for line in lines[skip:]:
        fields = dict(zip(names, line.split("\t")))
        row = {k: float(v) / 1e3 for k, v in fields.items() if k.endswith("_ms")}
        info = StepInfo((int(fields["prefill_tokens"]),) if int(fields["chunks"]) else (),
                        int(fields["decoding"]), int(fields["rows"]), execute_s=row["runner_ms"],
                        prefill_s=row["prefill_ms"], store_s=row["store_ms"], join_s=row["join_ms"],
                        decode_s=row["decode_ms"],
                        **{f: row[f[:-2] + "_ms"] for f in ("schedule_s", "sample_s", "launch_s", "readback_s",
                                                             "detok_s", "update_s", "output_s")})
        phases = _decode_phases(info, row["step_ms"])
        if phases is not None:
            steps.append(phases)
    return steps


def _num_trace_lines(path: Path) -> int:
    return max(0, len(path.read_text().splitlines()) - 1) if path.exists() else 0


def _host_row(path: str, samples: _HostSamples) -> dict:
    """Medians in microseconds; a path without steps (raw) shows its gap as its step."""
    gap = statistics.median(samples.gaps) * 1e6 if samples.gaps else None
    row = {"path": path, "num_steps": len(samples.steps) or len(samples.gaps)}
    for p in _PHASES:
        row[f"{p}_us"] = statistics.median(s[p] for s in samples.steps) * 1e6 if samples.steps else None
    if not samples.steps:
        row["step_us"] = gap
    row["gap_us"] = gap
    row["handoff_us"] = gap - row["step_us"] if samples.steps and gap is not None else None
    return row


def _raw(model, prompt_ids: list[int], max_tokens: int, samples: _HostSamples | None = None) -> dict:
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
    if samples is not None:
        samples.gaps.extend(times[1:])
    return _row("mlx-lm generate_step", times)


def _core(loaded, cfg: EngineConfig, prompt_ids: list[int], max_tokens: int, label: str,
          samples: _HostSamples | None = None) -> dict:
    from mlxhost.engine.core import EngineCore  # lazy: pulls in mlx_lm

    core = EngineCore(loaded.model, loaded.tokenizer, cfg, 1 << 20)
    best, steps = None, []
    for rep in range(2):  # the first pass compiles kernels / fills caches; the second is measured
        core.add_request(Request(f"{label}-{rep}", prompt_ids,
                                 SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), []))
        times, last, steps, seen = [], None, [], core.last_step
        while core.has_work:
            began = time.perf_counter()
            outs = core.step()
            now = time.perf_counter()
            if core.last_step is not seen:  # a step that scheduled nothing leaves the last one in place
                seen = core.last_step
                steps.append(_decode_phases(seen, now - began))
            if outs:
                if last is not None:
                    times.append(now - last)
                last = now
        best = times
    if samples is not None:
        samples.steps.extend(s for s in steps if s is not None)
        samples.gaps.extend(best[1:])
    return _row(label, best)


def _core_on_thread(loaded, cfg: EngineConfig, prompt_ids: list[int], max_tokens: int,
                    samples: _HostSamples | None = None) -> dict:
    """The core loop on a new thread, as the engine thread runs it, without asyncio: tells a cost of
    running MLX off the loading thread apart from the hand-off to asyncio."""
    out: dict = {}

    def body() -> None:
        try:
            out["row"] = _core(loaded, cfg, prompt_ids, max_tokens, "engine core loop (own thread)", samples)
        except BaseException as exc:  # re-raised on the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=body, name="bench-core")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["row"]


async def _async(loaded, cfg: EngineConfig, prompt_ids: list[int], max_tokens: int,
                 switch_s: float | None = None, samples: _HostSamples | None = None) -> dict:
    from mlxhost.engine.loop import STEP_TRACE_ENV  # lazy: pulls in the engine
    from mlxhost.server.app import make_engine  # lazy: pulls in fastapi

    previous = sys.getswitchinterval()
    if switch_s is not None:
        sys.setswitchinterval(switch_s)
    trace, traced_before = None, os.environ.get(STEP_TRACE_ENV)
    if samples is not None:
        # The engine thread's own step trace, as a server writes it: the engine's steps are out of reach here.
        # Its line (~5 us on a CPU) is written between the step and the hand-off: it counts in gap-step.
        trace = Path(tempfile.mkdtemp(prefix="mlxhost-decode-")) / "steps.tsv"
        os.environ[STEP_TRACE_ENV] = str(trace)

    engine = make_engine(loaded, cfg, 1 << 20)
    try:
        engine.start(asyncio.get_running_loop())
        times, per_token, skip = [], [], 0
        for _ in range(2):
            times, per_token, last = [], [], None
            skip = _num_trace_lines(trace) if trace is not None else 0
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for out in engine.generate(Request(uuid.uuid4().hex, prompt_ids, params, [])):
                now = time.perf_counter()
                if last is not None:
                    times.append(now - last)
                    per_token.append((now - last) / max(1, len(out.new_token_ids)))  # a merged output's tokens
                last = now
    finally:
        engine.stop()
        sys.setswitchinterval(previous)
        if trace is not None:
            if traced_before is None:
                os.environ.pop(STEP_TRACE_ENV, None)
            else:
                os.environ[STEP_TRACE_ENV] = traced_before
    if samples is not None:
        # Each step's line is written before its outputs leave the engine thread: the file is complete here.
        samples.steps.extend(_traced_steps(trace, skip))
        samples.gaps.extend(per_token[1:])
        trace.unlink()
        trace.parent.rmdir()
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
    # --host-table: each path's samples pooled over the rounds (the async path's with a GIL switch are not kept).
    host = {p: _HostSamples() for p in PATHS if p == "raw" or p in args.paths} if args.host_table else {}
    # The reference runs every round.
    measure = {"raw": lambda: _raw(loaded.model, prompt_ids, args.max_tokens, host.get("raw"))}
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
            rows.append(_core(loaded, base, prompt_ids, args.max_tokens, "engine core loop", host.get("core")))
        if "thread" in args.paths:
            rows.append(_core_on_thread(loaded, base, prompt_ids, args.max_tokens, host.get("thread")))
        if "async" in args.paths:
            rows.append(asyncio.run(_async(loaded, base, prompt_ids, args.max_tokens, samples=host.get("async"))))
            for switch_s in args.switch_intervals:
                rows.append(asyncio.run(_async(loaded, base, prompt_ids, args.max_tokens, switch_s)))
    raw = statistics.median(r["tok_s"] for r in rows if r["path"].startswith("mlx-lm"))
    for r in rows:
        r["ratio"] = r["tok_s"] / raw if r["tok_s"] and raw else None
    print(format_table(rows, _COLUMNS))
    result = {"model": args.model, "max_tokens": args.max_tokens, "rows": rows}
    if host:
        result["host_table"] = [_host_row(p, samples) for p, samples in host.items()]
        print("\nhost time per decode step, median us (forward: the runner's decode less sample, launch and "
              "readback; gap: between tokens as the consumer sees them)")
        print(format_table(result["host_table"], _HOST_COLUMNS))
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
    parser.add_argument("--host-table", action="store_true",
                        help="also tabulate the median host time of each phase of a decode step (schedule, runner "
                             "and its sample / launch / read-back, detokenizing, update, outputs) per path")
    parser.add_argument("--output-json", default=None, help="result file (default: bench-results/decode-*.json)")
