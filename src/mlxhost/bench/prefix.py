"""`mlxhost bench prefix`: what the prefix cache saves, in-process on the engine core.

For each shared-prefix length: TTFT of a request whose prefix was never seen (cold) against one
whose prefix an earlier request left in the cache (hit), plus decode speed with the cache on and
off. Requests run one at a time so the numbers are the cache's, not the batcher's.

`--together N,...` instead: two identical N-token prompts sent at once (agents start sub-agents and
helpers with one long system prompt), with the second waiting for the first's prompt blocks (the
scheduler's in-flight wait) and without (both prefill it side by side).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import random
import statistics
import tempfile
import time

from mlxhost.bench import plot
from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import default_json_path, int_list
from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.testing.demo import ensure_demo_model
from mlxhost.testing.families import build_family_folder

_COLUMNS = [
    ("block_size", "block", "d"), ("prefix_tokens", "prefix", "d"), ("ttft_cold_ms", "ttft cold", ".1f"),
    ("ttft_hit_ms", "ttft hit", ".1f"), ("speedup", "speed-up", ".1f"), ("hit_tokens", "hit tok", "d"),
    ("restore_hit_ms", "restore", ".1f"), ("ttft_ssd_ms", "ttft ssd", ".1f"), ("ssd_speedup", "ssd speed-up", ".1f"),
    ("ssd_read_ms", "ssd read", ".1f"), ("restore_ssd_ms", "ssd restore", ".1f"),
]


def _restore_timings(core) -> tuple[float, float]:
    """(restore s, SSD read s) the prefix cache spent so far: blocks into caches, blocks from disk."""
    timings = core.cache_stats().get("timings", {})
    return timings.get("restore_seconds", 0.0), timings.get("ssd_read_seconds", 0.0)


def _run_timed(core, prompt: list[int]) -> tuple[float, int, float, float]:
    """(ttft s, cached tokens, restore s, SSD read s) of a one-token request run alone."""
    before = _restore_timings(core)
    ttft, _, cached = _run_one(core, prompt, 1)
    after = _restore_timings(core)
    return ttft, cached, after[0] - before[0], after[1] - before[1]


def _run_one(core, prompt: list[int], max_tokens: int, out_ids: list[int] | None = None) -> tuple[float, float, int]:
    """(ttft s, decode tokens/s, cached tokens) of one request run alone; its tokens go to `out_ids`."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rid = f"bench-{time.monotonic_ns()}"
    start = time.perf_counter()
    core.add_request(Request(rid, prompt, params))
    first = last = None
    n = cached = 0
    while core.has_work:
        for out in core.step():
            now = time.perf_counter()
            first = first or now
            last = now
            n += len(out.new_token_ids)
            cached = out.num_cached_tokens
            if out_ids is not None:
                out_ids.extend(out.new_token_ids)
    core.on_idle()  # as the server's engine thread does: this request's blocks go to the SSD tier now
    rate = (n - 1) / (last - first) if n > 1 and last > first else 0.0
    return first - start, rate, cached


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def run_prefix_bench(args) -> dict:
    with contextlib.ExitStack() as stack:
        if args.shape:
            # GPU shapes write gigabytes: the folder goes when the run ends.
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"mlxhost-bench-{args.shape}-"))
            started = time.perf_counter()
            args.model = str(build_family_folder(folder, args.shape))
            print(f"built {args.shape} in {time.perf_counter() - started:.1f} s", flush=True)
        return _run_prefix_bench(args)


_TOGETHER_COLUMNS = [
    ("prompt_tokens", "prompt", "d"), ("wait", "wait", ""), ("both_first_s", "both 1st token s", ".2f"),
    ("ttft_first_s", "ttft 1st s", ".2f"), ("ttft_second_s", "ttft 2nd s", ".2f"),
    ("second_cached", "2nd cached", "d"), ("second_cached_pct", "2nd cached %", ".1f"),
    ("prefilled_tokens", "prefilled", "d"), ("speedup", "speed-up", ".2f"),
]


def _run_together(core, prompt: list[int], max_tokens: int) -> dict:
    """Two requests with `prompt` added in the same step, run to the end: when each got its first token
    (s after both were added) and how much of each prompt the prefix cache served."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [f"together-{time.monotonic_ns()}-{i}" for i in range(2)]
    start = time.perf_counter()
    for rid in rids:
        core.add_request(Request(rid, list(prompt), params))
    first: dict[str, float] = {}
    cached: dict[str, int] = {}
    while core.has_work:
        for out in core.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            cached[out.request_id] = out.num_cached_tokens
    return {"ttft": [first[r] for r in rids], "cached": [cached[r] for r in rids]}


def _together_rows(loaded, args, vocab: int) -> list[dict]:
    from mlxhost.engine.core import EngineCore  # lazy: pulls in mlx_lm
    from mlxhost.server.app import model_key, resolve_max_model_len  # lazy: pulls in fastapi

    rows = []
    config = EngineConfig(block_size=args.block_size[0], prefill_step_size=args.prefill_step_size,
                          cache_memory_bytes=int(args.cache_gb * (1 << 30)))
    max_len = resolve_max_model_len(loaded, config)
    rng = random.Random(0)
    for n in args.together:
        by_wait = {}
        for wait in (False, True):  # one core each: the other setting's prompts are no one's prefix here
            core = EngineCore(loaded.model, loaded.tokenizer, config, max_len, model_key=model_key(loaded))
            core.scheduler.wait_for_inflight = wait
            _run_one(core, _prompt(rng, 64, vocab), 4)  # warm-up
            runs = [_run_together(core, _prompt(rng, n, vocab), 1 + args.answer_tokens) for _ in range(args.repeats)]
            core.close()
            both = statistics.median(max(r["ttft"]) for r in runs)
            second = statistics.median(r["cached"][1] for r in runs)
            by_wait[wait] = both
            rows.append({"prompt_tokens": n, "wait": "on" if wait else "off", "both_first_s": both,
                         "ttft_first_s": statistics.median(r["ttft"][0] for r in runs),
                         "ttft_second_s": statistics.median(r["ttft"][1] for r in runs),
                         "second_cached": int(second), "second_cached_pct": 100 * second / n,
                         "prefilled_tokens": int(2 * n - statistics.median(sum(r["cached"]) for r in runs)),
                         "speedup": by_wait[False] / both})
            print(format_table(rows[-1:], _TOGETHER_COLUMNS), flush=True)
    return rows


def _run_prefix_bench(args) -> dict:
    from mlxhost.engine.core import EngineCore  # lazy: pulls in mlx_lm
    from mlxhost.server.app import model_key, resolve_max_model_len  # lazy: pulls in fastapi

    loaded = load_model(args.model or str(ensure_demo_model()))
    vocab = min(len(loaded.tokenizer), 2000)
    if args.together:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        return {"config": config, "together": _together_rows(loaded, args, vocab)}
    rows, fresh = [], itertools.count(1)
    for block_size in args.block_size:
        with tempfile.TemporaryDirectory(prefix="mlxhost-bench-ssd-") as ssd_dir:
            config = EngineConfig(block_size=block_size, prefill_step_size=args.prefill_step_size,
                                  cache_memory_bytes=int(args.cache_gb * (1 << 30)),
                                  ssd_cache_dir=ssd_dir if args.ssd else None)
            max_len = resolve_max_model_len(loaded, config)

            def make_core():
                return EngineCore(loaded.model, loaded.tokenizer, config, max_len, model_key=model_key(loaded))

            core = make_core()
            rng = random.Random(0)
            _run_one(core, _prompt(rng, 64, vocab), 4)  # warm-up
            for p in args.prefix_tokens:
                cold, hit, ssd, hit_tokens = [], [], [], 0
                restore, ssd_read, ssd_restore = [], [], []
                for _ in range(args.repeats):
                    # --vary-lengths: every repeat's messages are longer than any before (in this process:
                    # MLX-CUDA keeps what it compiled), so each prompt has a length never run, as in real traffic.
                    suffix = args.suffix_tokens + (3 * next(fresh) if args.vary_lengths else 0)
                    prefix = _prompt(rng, p, vocab)
                    turn1, answer = prefix + _prompt(rng, suffix, vocab), []
                    cold.append(_run_one(core, turn1, 1 + args.answer_tokens, answer)[0])
                    if args.answer_tokens:  # turn 2 of a conversation: turn 1, its answer, a new message
                        prefix = turn1 + answer
                    ttft, hit_tokens, restored, _ = _run_timed(core, prefix + _prompt(rng, suffix, vocab))
                    hit.append(ttft)
                    restore.append(restored)
                    if args.ssd:
                        # A restart: memory empty, the SSD tier found again by scanning its folder.
                        core.close()
                        core = make_core()
                        ttft, _, restored, read = _run_timed(core, prefix + _prompt(rng, suffix, vocab))
                        ssd.append(ttft)
                        ssd_restore.append(restored)
                        ssd_read.append(read)
                c, h = statistics.median(cold), statistics.median(hit)
                row = {"block_size": block_size, "prefix_tokens": p, "ttft_cold_ms": c * 1000,
                       "ttft_hit_ms": h * 1000, "speedup": c / h, "hit_tokens": hit_tokens,
                       "restore_hit_ms": statistics.median(restore) * 1000}
                if ssd:
                    row.update(ttft_ssd_ms=statistics.median(ssd) * 1000, ssd_speedup=c / statistics.median(ssd),
                               ssd_read_ms=statistics.median(ssd_read) * 1000,
                               restore_ssd_ms=statistics.median(ssd_restore) * 1000)
                rows.append(row)
                print(format_table(rows[-1:], _COLUMNS), flush=True)
            core.close()
    decode = _decode_on_off(loaded, args, vocab)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    return {"config": config, "rows": rows, "decode": decode}


def _decode_on_off(loaded, args, vocab: int) -> dict:
    """Decode tokens/s of the same requests with the cache on and off (alternating, median)."""
    from mlxhost.engine.core import EngineCore  # lazy: pulls in mlx_lm
    from mlxhost.server.app import model_key, resolve_max_model_len  # lazy: pulls in fastapi

    rates: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(args.repeats):
        for enabled in (True, False):
            config = EngineConfig(enable_prefix_cache=enabled, block_size=args.block_size[0])
            core = EngineCore(loaded.model, loaded.tokenizer, config, resolve_max_model_len(loaded, config),
                              model_key=model_key(loaded))
            rng = random.Random(rep)
            rates[enabled].append(_run_one(core, _prompt(rng, 64, vocab), args.decode_tokens)[1])
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"decode tok/s: cache on {on:.1f}, off {off:.1f} ({(on / off - 1) * 100:+.1f}%)", flush=True)
    return {"on_tok_s": on, "off_tok_s": off, "ratio": on / off}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the demo model)")
    parser.add_argument("--shape", default=None,
                        help="instead of --model, a random-weight fixture (testing/families.py): a tiny one per "
                             "family, e.g. gemma3_text (sliding window) or qwen3_next (recurrent state), or a GPU-sized "
                             "bfloat16 one: gemma3-4b (sliding window), qwen3.5-4b (hybrid)")
    parser.add_argument("--answer-tokens", type=int, default=0,
                        help="multi-turn: the cold request answers this many tokens and the hit request is "
                             "turn 2 (the cold prompt, its answer, a new message); 0: shared prefix, other suffix")
    parser.add_argument("--prefix-tokens", type=int_list, default=[512, 4096],
                        help="comma-separated shared-prefix lengths in tokens, one row each")
    parser.add_argument("--suffix-tokens", type=int, default=32,
                        help="tokens after the prefix, new in every request (what a hit still prefills)")
    parser.add_argument("--vary-lengths", action="store_true",
                        help="each repeat's new messages are 3 tokens longer than the last's, so every prompt "
                             "has a length not run before (on MLX-CUDA a new length costs graph builds)")
    parser.add_argument("--block-size", type=int_list, default=[256],
                        help="comma-separated prefix-cache block sizes in tokens, one pass each")
    parser.add_argument("--prefill-step-size", type=int, default=EngineConfig().prefill_step_size,
                        help="the engine's --prefill-step-size (prompt tokens per step)")
    parser.add_argument("--cache-gb", type=float, default=2.0, help="prefix-cache memory in GiB")
    parser.add_argument("--repeats", type=int, default=3,
                        help="cold/hit pairs per row and decode runs per setting (the median is shown)")
    parser.add_argument("--decode-tokens", type=int, default=256,
                        help="tokens generated by the decode-speed check, cache on vs off")
    parser.add_argument("--ssd", action="store_true", help="also measure TTFT after a restart, from the SSD tier")
    parser.add_argument("--together", type=int_list, default=[], metavar="N,...",
                        help="instead: two identical N-token prompts sent at once, the second waiting for the "
                             "first's prompt blocks and not (one row each); --block-size's first value is used")
    parser.add_argument("--output-json", default=None,
                        help="result file (default: bench-results/serve-prefix-<time>.json)")
    plot.add_plot_argument(parser)


def run(args: argparse.Namespace) -> int:
    result = run_prefix_bench(args)
    if args.together:
        print(format_table(result["together"], _TOGETHER_COLUMNS))
        print(f"wrote {write_json(args.output_json or default_json_path('prefix-together'), result)}")
        return 0
    print(format_table(result["rows"], _COLUMNS))
    path = write_json(args.output_json or default_json_path("prefix"), result)
    print(f"wrote {path}")
    if args.plot is not None:
        plot.write_plot(plot.plot_prefix, result["rows"], args.plot, path)
    return 0



