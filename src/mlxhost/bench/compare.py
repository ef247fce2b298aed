"""`mlxhost bench compare`: mlxhost and mlx_lm.server on the same model, same load, one run.

Each server is started in turn as a subprocess on a loopback port, measured with `bench serve`'s
harness, then stopped, so the two never compete for the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from mlxhost.bench import plot
from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import (
    TABLE_COLUMNS,
    ServeBenchConfig,
    add_load_arguments,
    add_serve_args_argument,
    default_json_path,
    run_serve_bench,
)
from mlxhost.testing.demo import ensure_demo_model

_SERVERS = ("mlxhost", "mlx_lm", "vllm_mlx")
_DEFAULT_SERVERS = ("mlxhost", "mlx_lm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(server: str, model: str, port: int, args) -> tuple[list[str], str]:
    """The command line and the model name clients send."""
    if server == "mlxhost":
        cmd = [sys.executable, "-m", "mlxhost.server.cli", "serve", model, "--port", str(port),
               "--served-model-name", "bench", "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning",
               *args.serve_args]
        return cmd, "bench"
    if server == "vllm_mlx":
        # vllm-mlx (pip install vllm-mlx): its continuous-batching engine, as its README serves it.
        cmd = [sys.executable, "-m", "vllm_mlx.cli", "serve", model, "--port", str(port), "--continuous-batching",
               "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", "bench"]
        return cmd, "bench"
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port), "--log-level", "WARNING"]
    # mlx_lm.server matches the request's model against the path it loaded.
    return cmd, model


@contextlib.contextmanager
def _running(cmd: list[str], url: str, timeout_s: float, kernel_cache: str = "fresh"):
    # The server's log goes to a file: an unread pipe fills up and stalls a chatty server mid-run.
    log_file = tempfile.TemporaryFile("w+")
    # Each server starts with its own empty MLX kernel cache: MLX-CUDA keeps compiled kernels on disk,
    # so a server started after another would find the first one's compiles done for it.
    kernel_dir = tempfile.TemporaryDirectory(prefix="mlx-ptx-")
    env = {**os.environ, "MLX_PTX_CACHE_DIR": kernel_dir.name} if kernel_cache == "fresh" else dict(os.environ)
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log_file.seek(0)
                raise RuntimeError(f"{cmd[2]} exited with {proc.returncode}: {log_file.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=2, trust_env=False).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[2]} did not come up within {timeout_s:.0f} s")
            time.sleep(0.5)
        yield proc
    finally:
        _print_notable(log_file)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_file.close()
        kernel_dir.cleanup()


def _print_notable(log_file) -> None:
    """The server log's lines a reader of the table needs: warm-up, slow steps, errors."""
    log_file.seek(0)
    for line in log_file:
        if any(k in line for k in ("warm-up", "slow engine step", "Traceback", "ERROR")):
            print("  server log:", line.rstrip()[-300:])


def _ratios(levels: list[dict]) -> list[dict]:
    by = {(lv["label"], lv["concurrency"]): lv for lv in levels}
    rows = []
    for (label, c), lv in by.items():
        ref = by.get(("mlx_lm", c))
        if label == "mlxhost" and ref and ref.get("agg_tok_s"):
            rows.append({"concurrency": c, "agg_ratio": lv["agg_tok_s"] / ref["agg_tok_s"],
                         "ttft_p50_ratio": (ref["ttft_p50_ms"] or 0) / (lv["ttft_p50_ms"] or 1)})
    return rows


def run(args: argparse.Namespace) -> int:
    model = args.model or str(ensure_demo_model())
    levels, errors = [], 0
    for server in args.servers:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        cmd, name = _command(server, model, port, args)
        print(f"starting {server} on {url}", flush=True)
        with _running(cmd, url, args.startup_timeout, args.kernel_cache):
            cfg = ServeBenchConfig(url=url, model=name, concurrency=args.concurrency, prompt_tokens=args.prompt_tokens,
                                   max_tokens=args.max_tokens, num_requests=args.num_requests, label=server,
                                   warmup=args.warmup, endpoint=args.endpoint)
            result = asyncio.run(run_serve_bench(cfg))
        levels.extend(result["levels"])
        errors += sum(lv["num_errors"] for lv in result["levels"])
        print(format_table(result["levels"], TABLE_COLUMNS), flush=True)
    print()
    print(format_table(levels, TABLE_COLUMNS))
    ratios = _ratios(levels)
    if ratios:
        print()
        print(format_table(ratios, [("concurrency", "conc", "d"), ("agg_ratio", "mlxhost/mlx_lm agg tok/s", ".2f"),
                                    ("ttft_p50_ratio", "ttft p50 speed-up", ".2f")]))
    path = write_json(args.output_json or default_json_path("compare"),
                      {"model": model, "levels": levels, "ratios": ratios})
    print(f"wrote {path}")
    if args.plot is not None:  # the servers side by side
        plot.write_plot(plot.plot_series, plot.load_series([path]), args.plot, path)
    return 0 if errors == 0 else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the demo model)")
    parser.add_argument("--servers", type=lambda s: [x for x in s.split(",") if x], default=list(_DEFAULT_SERVERS),
                        help="comma list of: " + ", ".join(_SERVERS))
    add_load_arguments(parser, [1, 16])
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                        help="API route the load uses (as in `bench serve`)")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent to each server before measuring")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="mlxhost's --max-num-seqs (batch limit)")
    add_serve_args_argument(parser)
    parser.add_argument("--startup-timeout", type=float, default=600, metavar="SECONDS",
                        help="how long each server may take to answer /v1/models after its start")
    parser.add_argument("--output-json", default=None,
                        help="result file (default: bench-results/serve-compare-<time>.json)")
    plot.add_plot_argument(parser)
