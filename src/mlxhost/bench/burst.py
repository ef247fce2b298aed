"""`mlxhost bench burst`: a burst of mixed-length prompts arriving together, TTFT of each, per server setting.

mlxhost is started once per (--max-num-prefill-rows, --prefill-step-size) pair as a subprocess and sent
`repeats` bursts (all prompts at once, fresh prompts each time, after a warm-up) with `bench serve`'s
harness; the table gives each prompt's median TTFT by its length, the mean and the worst. Rows 1 is
one prompt per forward (the path before batched prefill), so one call compares before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys

from mlxhost.bench.compare import _free_port, _running
from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import ServeBenchConfig, add_serve_args_argument, default_json_path, int_list, run_serve_bench
from mlxhost.testing.demo import ensure_demo_model

# Prompt tokens of the burst first measured on the GPU (130-1,400 words, about 180-1,900 tokens).
DEFAULT_MIX = [180, 1900, 550, 1100, 270, 1500, 820, 400]


def _command(model: str, port: int, rows: int, step: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "mlxhost.server.cli", "serve", model, "--port", str(port), "--served-model-name", "bench",
            "--max-num-prefill-rows", str(rows), "--prefill-step-size", str(step), "--log-level", "warning", *extra]


def summarize(label: str, mix: list[int], levels: list[dict]) -> dict:
    """One table row: each prompt's median TTFT over the bursts (ms, keyed by its length), mean and max."""
    row: dict = {"label": label, "num_errors": sum(lv["num_errors"] for lv in levels)}
    per_prompt: dict[int, list[float]] = {i: [] for i in range(len(mix))}
    means, maxes = [], []
    for lv in levels:
        ttfts = [r["ttft_s"] for r in lv["requests"]]
        for i, t in enumerate(ttfts):
            if t is not None:
                per_prompt[i % len(mix)].append(t * 1000)
        ok = [t * 1000 for t in ttfts if t is not None]
        if ok:
            means.append(statistics.mean(ok))
            maxes.append(max(ok))
    for i, n in enumerate(mix):
        row[f"ttft_{i}"] = statistics.median(per_prompt[i]) if per_prompt[i] else None
    row["ttft_mean_ms"] = statistics.median(means) if means else None
    row["ttft_max_ms"] = statistics.median(maxes) if maxes else None
    return row


def columns(mix: list[int]) -> list[tuple[str, str, str]]:
    # Shortest prompt first, so a row reads as TTFT against prompt length.
    order = sorted(range(len(mix)), key=mix.__getitem__)
    return ([("label", "setting", "")] + [(f"ttft_{i}", f"{mix[i]} tok", ".0f") for i in order]
            + [("ttft_mean_ms", "mean", ".0f"), ("ttft_max_ms", "max", ".0f"), ("num_errors", "errors", "d")])


def run(args: argparse.Namespace) -> int:
    model = args.model or str(ensure_demo_model())
    mix = args.prompt_tokens_mix
    rows, raw = [], []
    for step in args.prefill_step_sizes:
        for num_rows in args.rows:
            label = f"rows {num_rows}, step {step}"
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            print(f"starting mlxhost ({label}) on {url}", file=sys.stderr, flush=True)
            with _running(_command(model, port, num_rows, step, args.serve_args), url, args.startup_timeout,
                          args.kernel_cache):
                cfg = ServeBenchConfig(url=url, model="bench", concurrency=[len(mix)] * args.repeats,
                                       num_requests=len(mix), prompt_tokens_mix=mix, max_tokens=args.max_tokens,
                                       endpoint=args.endpoint, warmup=args.warmup, label=label)
                result = asyncio.run(run_serve_bench(cfg))
            rows.append(summarize(label, mix, result["levels"]))
            raw.append(result)
            print(format_table(rows[-1:], columns(mix)), file=sys.stderr, flush=True)
    print(format_table(rows, columns(mix)))
    path = write_json(args.output_json or default_json_path("burst"), {"model": model, "mix": mix, "rows": rows,
                                                                       "runs": raw})
    print(f"wrote {path}")
    return 0 if all(r["num_errors"] == 0 for r in rows) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the demo model)")
    parser.add_argument("--rows", type=int_list, default=[1, 8],
                        help="--max-num-prefill-rows values (1: one prompt per forward, as before batched prefill)")
    parser.add_argument("--prefill-step-sizes", type=int_list, default=[512], help="--prefill-step-size values")
    parser.add_argument("--prompt-tokens-mix", type=int_list, default=DEFAULT_MIX, metavar="N,N,...",
                        help="the burst: one prompt of each length, all sent at once")
    parser.add_argument("--repeats", type=int, default=3, help="bursts per setting (fresh prompts each)")
    parser.add_argument("--max-tokens", type=int, default=16, help="completion tokens per request")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="chat",
                        help="chat: /v1/chat/completions (the chat template adds tokens); completions: a plain prompt")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent one by one before the bursts")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds a server may take to start")
    add_serve_args_argument(parser)
    parser.add_argument("--output-json", default=None, help="result file (default: a dated file under bench-results/)")
