"""`mlxhost bench engine --long-prompt TOKENS`: the gap between a decoding stream's tokens while a long prompt
prefills beside it, once per `--max-decode-gap` value (0: whole prefill chunks beside the decode rows).

Streams start and decode; once each has its first token, the long prompt arrives. Every gap a stream sees
between the long prompt's arrival and its first token is counted; the long prompt's time to first token
says what the bound costs the prefill.

Admission reserves every row's prompt + max_tokens (scheduler.py `_kv_bound`), so the streams ask for only as
many tokens as lets all of them and the long prompt in at once (`stream_max_tokens`): with 100k each, eight 8B
streams on an 80 GB card left five waiting for good, and the round never started.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid

from mlxhost.bench.serve_request import make_prompt
from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# How long the streams may take to all have their first token before the round gives up (a cold compile of a
# new batch size on MLX-CUDA takes tens of seconds; a stream that is never admitted takes forever).
START_TIMEOUT_S = 300.0
MAX_STREAM_TOKENS = 100_000
# Tokens a stream decodes before the long prompt lands: the steps that start the streams and a second of steady
# decoding (about 200 steps of a small model on a GPU).
STREAM_MARGIN_TOKENS = 2048


def stream_max_tokens(kv_capacity: int | None, num_streams: int, stream_prompt_tokens: int,
                      long_prompt_tokens: int, max_num_seqs: int | None = None, kv_prealloc_tokens: int = 0) -> int:
    """Each stream's max_tokens: as many as lets the streams and the long prompt be admitted together, in the
    engine's `max_num_seqs` slots and under `kv_capacity` (admission's bound, scheduler.py `_kv_bound`: rows x
    the longest prompt + max_tokens, or `kv_prealloc_tokens` where more; 5% held back for prompts that tokenize
    longer). The streams must still be decoding when the long prompt's first token comes: they decode one token
    a step, and its prefill takes far fewer steps than it has tokens, so at least that many plus what they decode
    before it lands. Where the slots or the KV cannot hold that: ValueError, naming what to change."""
    rows = num_streams + 1
    if max_num_seqs is not None and rows > max_num_seqs:
        raise ValueError(f"{num_streams} streams and the long prompt need {rows} sequences at once, and the engine "
                         f"runs {max_num_seqs}: ask for fewer streams or a larger --max-num-seqs")
    least = long_prompt_tokens + STREAM_MARGIN_TOKENS
    if kv_capacity is None:
        return max(MAX_STREAM_TOKENS, least)
    room = int(kv_capacity / rows / 1.05)  # the longest row's length that lets every row in
    tokens = min(max(MAX_STREAM_TOKENS, least), room - stream_prompt_tokens)
    if tokens < least or kv_prealloc_tokens > room:
        raise ValueError(f"{num_streams} streams beside a {long_prompt_tokens}-token prompt need about "
                         f"{int(rows * max(stream_prompt_tokens + least, kv_prealloc_tokens) * 1.05)} KV tokens, "
                         f"and this engine holds {kv_capacity}: ask for fewer streams or a shorter prompt")
    return tokens


async def run_gap_round(engine, loaded, num_streams: int, stream_prompt_tokens: int, long_prompt_tokens: int,
                        seed: int, tag: str = "", max_tokens: int = MAX_STREAM_TOKENS) -> dict:
    """One round on a running engine: `num_streams` streams decode, then the long prompt arrives; the gaps the
    streams see until its first token, and that first token's delay."""
    tok, eos = loaded.tokenizer, loaded.eos_token_ids
    gaps: list[float] = []
    window = {"start": None, "end": None}
    started = asyncio.Event()
    num_started = 0

    async def stream(i: int) -> None:
        nonlocal num_started
        ids = tok.encode(make_prompt(seed, f"{tag}stream", i, stream_prompt_tokens))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        last = None
        async for out in engine.generate(Request(uuid.uuid4().hex, ids, params, eos)):
            if out.error:
                raise RuntimeError(f"stream {i} failed: {out.error}")
            now = time.perf_counter()
            if last is None:
                num_started += 1
                if num_started == num_streams:
                    started.set()
            elif window["start"] is not None and last >= window["start"] and (window["end"] is None
                                                                               or now <= window["end"]):
                gaps.append(now - last)
            last = now
            if window["end"] is not None:
                return  # leaving the stream aborts its request
            if out.finished:
                raise RuntimeError(f"stream {i} ended ({out.finish_reason}) before the long prompt's first token")

    tasks = [asyncio.ensure_future(stream(i)) for i in range(num_streams)]
    try:
        waiting = asyncio.ensure_future(started.wait())
        await asyncio.wait({waiting, *tasks}, return_when=asyncio.FIRST_COMPLETED, timeout=START_TIMEOUT_S)
        if not started.is_set():  # a stream failed or ended, or some never started: not a hang
            waiting.cancel()
            for task in tasks:
                if task.done():
                    task.result()  # its error
            raise RuntimeError(f"only {num_started} of {num_streams} streams had their first token within "
                               f"{START_TIMEOUT_S:.0f} s ({engine.stats.num_waiting} requests waiting)")
        await asyncio.sleep(1.0)  # steady decoding before the prompt lands
        ids = tok.encode(make_prompt(seed, f"{tag}long", 0, long_prompt_tokens))
        window["start"] = time.perf_counter()
        async for _ in engine.generate(Request(uuid.uuid4().hex, ids, SamplingParams(max_tokens=1), eos)):
            break
        window["end"] = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"num_gaps": len(gaps), "gap_p50_s": percentile(gaps, 0.5), "gap_p99_s": percentile(gaps, 0.99),
            "gap_max_s": max(gaps) if gaps else None, "gap_mean_s": statistics.fmean(gaps) if gaps else None,
            "long_ttft_s": window["end"] - window["start"], "long_prompt_tokens": len(ids)}


def _set_target(core, seconds: float) -> None:
    # A bench-only reach into the scheduler's cost model: one engine (one warm-up, one set of compiled shapes)
    # serves every target, and what it learned of step costs carries over.
    core.scheduler.step_cost.max_decode_gap_s = seconds


async def run_gap_bench(model_path: str, engine_config: EngineConfig, targets: list[float], num_streams: int,
                        stream_prompt_tokens: int, long_prompt_tokens: int, seed: int = 0,
                        warm_rounds: int = 1, warmup_wait_s: float = 900.0) -> list[dict]:
    """One engine, as a server runs it (its background warm-up included, waited for first: where MLX compiles per
    shape, MLX-CUDA, the warm-up's helper processes compile the quantized kernels a first round would otherwise
    compile on the request path). Then per target: `warm_rounds` untimed rounds (the long prompt's own chunk
    shapes) and one timed round, each with prompts of its own, so none is a prefix hit for another."""
    from mlxhost.server.app import make_engine, resolve_max_model_len  # lazy: pulls in fastapi

    loaded = load_model(model_path)
    engine = make_engine(loaded, engine_config, resolve_max_model_len(loaded, engine_config))
    engine.start(asyncio.get_running_loop())
    rows = []
    try:
        waited = time.perf_counter()
        while engine.warmup_running and time.perf_counter() - waited < warmup_wait_s:
            await asyncio.sleep(0.5)
        if engine.warmup_running:
            print(f"the warm-up is still running after {warmup_wait_s:.0f} s; rounds start anyway", flush=True)
        else:  # a long wait here is the warm-up compiling (a cold kernel cache), not the rounds
            print(f"engine ready, warm-up over {time.perf_counter() - waited:.0f} s later", flush=True)
        # The prompts as the tokenizer counts them (a real vocabulary makes more tokens of the words than asked).
        counted = [len(loaded.tokenizer.encode(make_prompt(seed, tag, 0, n)))
                   for tag, n in (("stream", stream_prompt_tokens), ("long", long_prompt_tokens))]
        max_tokens = stream_max_tokens(engine.kv_capacity_tokens, num_streams, *counted,
                                       max_num_seqs=engine_config.max_num_seqs,
                                       kv_prealloc_tokens=engine_config.kv_prealloc_tokens)
        # A lone prompt first: the cost model measures a prefill before any round (as a server has).
        warm = loaded.tokenizer.encode(make_prompt(seed, "warm", 0, 256))
        async for _ in engine.generate(Request(uuid.uuid4().hex, warm, SamplingParams(max_tokens=2),
                                               loaded.eos_token_ids)):
            pass
        for pos, target in enumerate(targets):
            await engine.call(lambda core, t=target: _set_target(core, t))
            for k in range(warm_rounds):
                untimed = await run_gap_round(engine, loaded, num_streams, stream_prompt_tokens, long_prompt_tokens,
                                              seed, tag=f"t{pos}w{k}-", max_tokens=max_tokens)
                print(f"max_decode_gap {target}: untimed round {k + 1}, long prompt TTFT "
                      f"{untimed['long_ttft_s']:.1f} s", flush=True)
            row = await run_gap_round(engine, loaded, num_streams, stream_prompt_tokens, long_prompt_tokens, seed,
                                      tag=f"t{pos}-", max_tokens=max_tokens)
            rows.append({"max_decode_gap_s": target, **row})
            p99 = f"{row['gap_p99_s']:.3f} s" if row["gap_p99_s"] is not None else "- (no token fell in the prefill)"
            print(f"max_decode_gap {target}: p99 gap {p99}, long prompt TTFT {row['long_ttft_s']:.1f} s", flush=True)
    finally:
        engine.stop()
    return rows


GAP_COLUMNS = [("max_decode_gap_s", "target s", ""), ("num_gaps", "gaps", "d"), ("gap_p50_s", "p50 s", ".3f"),
               ("gap_p99_s", "p99 s", ".3f"), ("gap_max_s", "max s", ".3f"), ("long_ttft_s", "long TTFT s", ".1f")]
