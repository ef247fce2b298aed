"""`mlxhost bench batch`: interactive TTFT while a Batch API job runs, against the same server idle.

mlxhost is started as a subprocess (the demo model unless --model) with a Batch API folder of its own. First
the interactive requests run on the idle server (`bench serve`'s harness: streamed, timed the same way); then a
batch of --batch-requests completion lines is uploaded and created, and once it is in progress the same number
of interactive requests (fresh prompts) runs again. Batch lines run in the lowest scheduling class, so the
second row says what a batch costs the interactive users. The batch is then waited for, to report its pace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time

import httpx

from mlxhost.bench.compare import _free_port, _running
from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import ServeBenchConfig, add_serve_args_argument, default_json_path, run_serve_bench
from mlxhost.bench.serve_request import make_prompt
from mlxhost.testing.demo import ensure_demo_model

COLUMNS = [
    ("phase", "phase", ""), ("num_requests", "reqs", "d"), ("ttft_p50_ms", "ttft p50", ".1f"),
    ("ttft_p99_ms", "ttft p99", ".1f"), ("ttft_max_ms", "ttft max", ".1f"), ("itl_p50_ms", "itl p50", ".2f"),
    ("itl_p99_ms", "itl p99", ".2f"), ("batch_lines_done", "batch lines done", "d"),
    ("num_errors", "errors", "d"),
]
_ENDED = ("completed", "failed", "expired", "cancelled")


def batch_lines(model: str, n: int, prompt_tokens: int, max_tokens: int, seed: int) -> bytes:
    """The batch's input file: `n` completion lines of their own prompts (none hits another's prefix)."""
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": make_prompt(seed, "batch", i, prompt_tokens), "max_tokens": max_tokens,
                       "ignore_eos": True}} for i in range(n)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def start_batch(client: httpx.Client, data: bytes) -> str:
    """Uploads `data` and creates the batch; its id."""
    upload = client.post("/v1/files", files={"file": ("bench.jsonl", data, "application/jsonl")},
                         data={"purpose": "batch"})
    upload.raise_for_status()
    created = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                                               "completion_window": "24h"})
    created.raise_for_status()
    return created.json()["id"]


def batch_state(client: httpx.Client, batch_id: str) -> tuple[str, int]:
    """Its status and how many lines are answered."""
    body = client.get(f"/v1/batches/{batch_id}").json()
    counts = body.get("request_counts") or {}
    return body["status"], counts.get("completed", 0) + counts.get("failed", 0)


def wait_for(client: httpx.Client, batch_id: str, done, timeout_s: float) -> tuple[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        status, num_done = batch_state(client, batch_id)
        if done(status, num_done) or time.monotonic() > deadline:
            return status, num_done
        time.sleep(0.1)


def interactive_row(phase: str, level: dict, lines_done: int | None) -> dict:
    keys = ("num_requests", "ttft_p50_ms", "ttft_p99_ms", "ttft_max_ms", "ttft_mean_ms", "itl_p50_ms", "itl_p99_ms",
            "num_errors")
    return {"phase": phase, **{k: level.get(k) for k in keys}, "batch_lines_done": lines_done}


def run(args: argparse.Namespace) -> int:
    model = args.model or str(ensure_demo_model())
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    rows, batch = [], {}
    with tempfile.TemporaryDirectory(prefix="mlxhost-bench-batch-") as folder:
        cmd = [sys.executable, "-m", "mlxhost.server.cli", "serve", model, "--port", str(port),
               "--served-model-name", "bench", "--max-num-seqs", str(args.max_num_seqs), "--batch-dir", folder,
               "--log-level", "warning", *args.serve_args]
        with _running(cmd, url, args.startup_timeout, args.kernel_cache), \
                httpx.Client(base_url=url, timeout=120, trust_env=False) as client:

            def interactive(seed: int, warmup: int) -> dict:
                cfg = ServeBenchConfig(url=url, model="bench", concurrency=[args.concurrency],
                                       prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                                       num_requests=args.num_requests, warmup=warmup, seed=seed, label="interactive")
                return asyncio.run(run_serve_bench(cfg))["levels"][0]

            rows.append(interactive_row("idle", interactive(seed=1, warmup=1), None))
            print(f"idle: ttft p50 {rows[-1]['ttft_p50_ms']:.1f} ms", flush=True)
            data = batch_lines("bench", args.batch_requests, args.batch_prompt_tokens, args.batch_max_tokens, seed=3)
            started = time.monotonic()
            batch_id = start_batch(client, data)
            status, _ = wait_for(client, batch_id, lambda s, n: s != "validating", args.batch_timeout)
            level = interactive(seed=2, warmup=0)  # fresh prompts: nothing the idle round cached
            status, num_done = batch_state(client, batch_id)
            rows.append(interactive_row("during batch", level, num_done))
            running = status not in _ENDED and num_done < args.batch_requests
            if not running:
                print("warning: the batch ended before the interactive requests did; raise --batch-requests",
                      flush=True)
            status, num_done = wait_for(client, batch_id, lambda s, n: s in _ENDED, args.batch_timeout)
            wall_s = time.monotonic() - started
            batch = {"id": batch_id, "status": status, "num_lines": args.batch_requests, "num_done": num_done,
                     "wall_s": wall_s, "lines_per_s": num_done / wall_s if wall_s > 0 else None,
                     "running_throughout": running}
    print(format_table(rows, COLUMNS))
    idle, busy = rows
    if idle["ttft_p50_ms"] and busy["ttft_p50_ms"]:
        print(f"during the batch / idle: ttft p50 x{busy['ttft_p50_ms'] / idle['ttft_p50_ms']:.2f}, "
              f"p99 x{busy['ttft_p99_ms'] / idle['ttft_p99_ms']:.2f}")
    print(f"batch: {batch['num_done']}/{batch['num_lines']} lines {batch['status']} in {batch['wall_s']:.1f} s")
    config = {k: v for k, v in vars(args).items() if k != "func"}
    path = write_json(args.output_json or default_json_path("batch"), {"config": config, "rows": rows,
                                                                        "batch": batch})
    print(f"wrote {path}")
    return 0 if all(r["num_errors"] == 0 for r in rows) and batch["status"] == "completed" else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or hub id (default: the demo model)")
    parser.add_argument("--batch-requests", type=int, default=64, help="lines of the batch (N)")
    parser.add_argument("--batch-prompt-tokens", type=int, default=256, help="prompt tokens of each batch line")
    parser.add_argument("--batch-max-tokens", type=int, default=128, help="completion tokens of each batch line")
    parser.add_argument("--num-requests", type=int, default=16, help="interactive requests in each phase")
    parser.add_argument("--concurrency", type=int, default=1, help="interactive requests at a time")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt tokens of each interactive request")
    parser.add_argument("--max-tokens", type=int, default=32, help="completion tokens of each interactive request")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="the server's --max-num-seqs")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds the server may take to start")
    parser.add_argument("--batch-timeout", type=float, default=1800.0, help="seconds to wait for the batch")
    add_serve_args_argument(parser)
    parser.add_argument("--output-json", default=None, help="result file (default: bench-results/serve-batch-<time>.json)")
