"""`mlxserve bench distributed`: one model served by 1 rank vs split over N (tensor parallel), same
load, one run: aggregate tok/s at each concurrency level and TTFT of a long prompt.

Each configuration is a fresh `mlxserve serve --tensor-parallel N` subprocess (N = 1: a plain server),
measured with `bench serve`'s harness, then stopped. Models are random-weight folders of real shapes
(built once under --model-root), so no download is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from mlxserve.bench.compare import _free_port
from mlxserve.bench.report import format_table, write_json
from mlxserve.bench.serve import ServeBenchConfig, default_json_path, int_list, run_level, run_serve_bench

TABLE_COLUMNS = [
    ("shape", "shape", ""), ("tp", "tp", "d"), ("backend", "backend", ""), ("agg_tok_s_c1", "c=1 tok/s", ".1f"),
    ("agg_tok_s_cmax", "c=max tok/s", ".1f"), ("cmax", "max c", "d"), ("ttft_long_ms", "ttft long p50 ms", ".0f"),
    ("long_prompt_tokens", "long prompt", "d"), ("num_errors", "errors", "d"),
]


def shapes() -> dict:
    from mlxserve.testing.demo import SHAPES

    # Qwen3-32B's shape (config.json of Qwen/Qwen3-32B), random weights.
    qwen3_32b = dataclasses.replace(SHAPES["qwen3-8b"], hidden_size=5120, num_hidden_layers=64,
                                    num_attention_heads=64, num_key_value_heads=8, intermediate_size=25600)
    return {"tiny": SHAPES["tiny"], "qwen3-8b": SHAPES["qwen3-8b"], "qwen3-32b": qwen3_32b}


def ensure_shape(root: Path, shape: str, bits: int | None) -> Path:
    from mlxserve.testing.demo import build_model_folder

    folder = root / f"{shape}-{bits or 'float'}bit"
    if (folder / "config.json").exists():
        return folder
    config = dataclasses.replace(shapes()[shape], quantize_bits=bits or None, quantize_with_converter=False)
    print(f"building {folder} (random weights)", flush=True)
    return build_model_folder(folder, config)


@contextlib.contextmanager
def serving(model: Path, tp: int, args, log_path: Path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlxserve.server.cli", "serve", str(model), "--port", str(port), "--served-model-name",
           "bench", "--max-num-seqs", str(args.max_num_seqs), "--memory-mode", "dedicated", "--no-web-ui",
           "--log-level", "info", *args.server_flag]
    if tp > 1:
        cmd += ["--tensor-parallel", str(tp), "--backend", args.backend]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        deadline = time.monotonic() + args.startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up within {args.startup_timeout:.0f} s; see {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()  # SIGTERM: a graceful stop, which also stops the other ranks
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def measure(url: str, args) -> dict:
    cfg = ServeBenchConfig(url=url, model="bench", concurrency=args.concurrency, prompt_tokens=args.prompt_tokens,
                           max_tokens=args.max_tokens, num_requests=args.num_requests, warmup=args.warmup)
    levels = (await run_serve_bench(cfg))["levels"]
    # TTFT of a long prompt, alone: the prefill's speed-up (or cost) from splitting the model.
    long_cfg = dataclasses.replace(cfg, concurrency=[1], prompt_tokens=args.long_prompt_tokens, max_tokens=4,
                                   num_requests=args.long_requests)
    long_level = await run_level(long_cfg, 1, tag="long")
    return {"levels": levels, "long": long_level}


def row(shape: str, tp: int, backend: str, result: dict) -> dict:
    levels = result["levels"]
    long_level = result["long"]
    return {"shape": shape, "tp": tp, "backend": backend if tp > 1 else "-",
            "agg_tok_s_c1": levels[0]["agg_tok_s"], "agg_tok_s_cmax": levels[-1]["agg_tok_s"],
            "cmax": levels[-1]["concurrency"], "ttft_long_ms": long_level["ttft_p50_ms"],
            "long_prompt_tokens": round(long_level["mean_prompt_tokens"] or 0),
            "num_errors": sum(lv["num_errors"] for lv in levels) + long_level["num_errors"]}


def run(args: argparse.Namespace) -> int:
    root = Path(args.model_root)
    root.mkdir(parents=True, exist_ok=True)
    rows, raw = [], []
    for shape in args.shapes:
        model = ensure_shape(root, shape, args.bits)
        for tp in args.tp:
            print(f"{shape}: tensor parallel {tp}", flush=True)
            log_path = root / f"server-{shape}-tp{tp}.log"
            try:
                with serving(model, tp, args, log_path) as url:
                    result = asyncio.run(measure(url, args))
            except RuntimeError as exc:  # one configuration that cannot start must not cost the others
                tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
                print(f"{shape} tp={tp} failed: {exc}\n{tail}", flush=True)
                rows.append({"shape": shape, "tp": tp, "backend": args.backend, "num_errors": -1, "error": str(exc)})
                raw.append({"shape": shape, "tp": tp, "error": str(exc), "log_tail": tail})
                continue
            rows.append(row(shape, tp, args.backend, result))
            raw.append({"shape": shape, "tp": tp, **result})
            print(format_table(rows[-1:], TABLE_COLUMNS), flush=True)
    print()
    print(format_table(rows, TABLE_COLUMNS))
    path = write_json(args.output_json or default_json_path("distributed"), {"rows": rows, "runs": raw,
                                                                             "bits": args.bits})
    print(f"wrote {path}")
    return 0 if all(r["num_errors"] == 0 for r in rows) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--shapes", type=names, default=["qwen3-8b", "qwen3-32b"],
                        help="comma list of: tiny, qwen3-8b, qwen3-32b (random weights, built under --model-root)")
    parser.add_argument("--bits", type=int, default=4, help="quantize the shapes to this many bits (0: bf16/float)")
    parser.add_argument("--tp", type=int_list, default=[1, 2], help="tensor-parallel sizes to compare")
    parser.add_argument("--backend", default="nccl", choices=["ring", "nccl", "jaccl", "mpi"],
                        help="mx.distributed backend of the ranks")
    parser.add_argument("--model-root", default="bench-models", help="where the shape folders are built and kept")
    parser.add_argument("--concurrency", type=int_list, default=[1, 16], help="comma list of concurrency levels")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--num-requests", type=int, default=None, help="per level (default: 4 waves)")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    parser.add_argument("--long-prompt-tokens", type=int, default=4096, help="prompt of the TTFT measurement")
    parser.add_argument("--long-requests", type=int, default=3, help="long prompts timed one at a time (median)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="the servers' batch limit")
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                        help="extra flag for every server (repeatable; e.g. --server-flag=--warmup=on)")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds a server may take to come up")
    parser.add_argument("--output-json", default=None, help="result file (default: bench-results/distributed-*.json)")
