"""`mlxhost bench serve`: a streaming load generator for any OpenAI-compatible server.

The same harness drives mlxhost, mlx_lm.server, vllm-mlx..., so their numbers compare
side by side. Every time is taken on the client: it is what a user of the server sees.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from urllib.parse import urlsplit

from mlxhost.bench import plot
from mlxhost.bench.report import format_table, mean, percentile, write_json
from mlxhost.bench.serve_request import (
    RequestResult,
    make_client,
    make_prompt,
    pooled_rate,
    quiet_client_logs,
    timed_request,
)

ENDPOINT_PATHS = {"completions": "/completions", "chat": "/chat/completions"}

TABLE_COLUMNS = [  # (level key, header, format); times in ms
    ("label", "label", ""), ("concurrency", "conc", "d"), ("num_requests", "reqs", "d"),
    ("ttft_p50_ms", "ttft p50", ".1f"), ("ttft_p99_ms", "ttft p99", ".1f"), ("ttft_max_ms", "ttft max", ".1f"),
    ("itl_p50_ms", "itl p50", ".2f"), ("itl_p99_ms", "itl p99", ".2f"),
    ("decode_tok_s_per_req", "decode tok/s/req", ".1f"), ("e2e_tok_s_per_req", "e2e tok/s/req", ".1f"),
    ("agg_tok_s", "agg tok/s", ".1f"),
    ("req_s", "req/s", ".2f"), ("num_errors", "errors", "d"),
]


class ServeBenchError(RuntimeError):
    """The bench cannot measure anything (e.g. every warmup request failed)."""


@dataclass
class ServeBenchConfig:
    url: str  # base URL, with or without the trailing /v1
    model: str
    concurrency: list[int]  # each level is one run
    prompt_tokens: int = 128  # approximate prompt length
    # Lengths cycled over each level's requests instead (e.g. a burst of mixed prompts: concurrency =
    # num_requests = len(list) sends them all at once).
    prompt_tokens_mix: list[int] | None = None
    max_tokens: int = 128
    num_requests: int | None = None  # per level; None -> a few waves (see num_requests_for)
    endpoint: str = "completions"  # or "chat"
    warmup: int = 1  # sent before measuring: a cold server compiles kernels on its first call
    ignore_eos: bool = True  # extra body field; servers that don't know it ignore it
    timeout_s: float = 600
    seed: int = 0
    label: str = ""  # shown in the table, e.g. "mlxhost" / "mlx_lm.server"
    output_json: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"url must look like http://host:port, got {self.url!r}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.prompt_tokens < 1 or self.max_tokens < 1 or any(n < 1 for n in self.prompt_tokens_mix or ()):
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}")
        if self.warmup < 0 or self.timeout_s <= 0:
            raise ValueError("warmup must be >= 0 and timeout_s > 0")

    @property
    def base_url(self) -> str:
        base = self.url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"

    @property
    def request_url(self) -> str:
        return self.base_url + ENDPOINT_PATHS[self.endpoint]

    @property
    def display_label(self) -> str:
        return self.label or urlsplit(self.url).netloc

    def prompt_tokens_for(self, index: int) -> int:
        return self.prompt_tokens_mix[index % len(self.prompt_tokens_mix)] if self.prompt_tokens_mix else self.prompt_tokens

    def num_requests_for(self, concurrency: int) -> int:
        if self.num_requests is not None:
            return self.num_requests
        # Four waves: the first starts all at once (a prefill burst); the later ones see
        # the staggered arrivals that steady traffic produces.
        return max(4 * concurrency, 8)


def summarize_level(
    cfg: ServeBenchConfig, concurrency: int, results: list[RequestResult], wall_s: float
) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok]
    itl = [gap for r in ok for gap in r.itl_s]
    decoded = [(r.num_completion_tokens - 1, r.decode_s) for r in ok if r.decode_tok_s is not None]
    prompt_lens = [r.num_prompt_tokens for r in ok if r.num_prompt_tokens is not None]
    num_tokens = sum(r.num_completion_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "label": cfg.display_label,
        "concurrency": concurrency,
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(errors),
        "wall_s": wall_s,
        "ttft_p50_ms": percentile(ttft, 50, scale=1000),
        "ttft_p99_ms": percentile(ttft, 99, scale=1000),
        "ttft_max_ms": max(ttft) * 1000 if ttft else None,
        "ttft_mean_ms": mean(ttft, scale=1000),
        "itl_p50_ms": percentile(itl, 50, scale=1000),
        "itl_p99_ms": percentile(itl, 99, scale=1000),
        "e2e_p50_ms": percentile(e2e, 50, scale=1000),
        "e2e_p99_ms": percentile(e2e, 99, scale=1000),
        "decode_tok_s_per_req": pooled_rate(decoded),
        "e2e_tok_s_per_req": pooled_rate([(r.num_completion_tokens, r.e2e_s) for r in ok if r.e2e_s]),
        "agg_tok_s": num_tokens / wall_s if wall_s > 0 else None,
        "req_s": len(ok) / wall_s if wall_s > 0 else None,
        "num_completion_tokens": num_tokens,
        "mean_prompt_tokens": mean(prompt_lens),
        "error_samples": list(dict.fromkeys(errors))[:3],
        "requests": [r.summary() for r in results],
    }


async def run_level(cfg: ServeBenchConfig, concurrency: int, *, tag: str | None = None) -> dict:
    """One concurrency level: keep `concurrency` requests in flight until all are sent."""
    tag = tag or f"c{concurrency}"
    num_requests = cfg.num_requests_for(concurrency)
    prompts = [make_prompt(cfg.seed, tag, i, cfg.prompt_tokens_for(i)) for i in range(num_requests)]
    results: list[RequestResult | None] = [None] * num_requests
    pending = iter(range(num_requests))

    async with make_client(cfg, concurrency) as client:

        async def worker() -> None:
            # Workers share one iterator: each takes the next unsent request as soon as
            # its previous one finishes, so exactly `concurrency` stay in flight.
            for i in pending:
                results[i] = await timed_request(client, cfg, prompts[i])

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, num_requests))))
        wall_s = time.perf_counter() - start
    return summarize_level(cfg, concurrency, results, wall_s)


async def run_serve_bench(cfg: ServeBenchConfig, on_level=None) -> dict:
    """All levels in order -> {"config", "warmup", "levels"}; writes JSON if cfg.output_json, after each level.

    `on_level(level_dict)` is called after each level, for progress output.
    """
    quiet_client_logs()
    warmup_results: list[RequestResult] = []
    if cfg.warmup:
        async with make_client(cfg, 1) as client:
            for i in range(cfg.warmup):
                prompt = make_prompt(cfg.seed, "warmup", i, cfg.prompt_tokens)
                warmup_results.append(await timed_request(client, cfg, prompt))
        if not any(r.ok for r in warmup_results):
            # The server is down or rejects the request shape: every level would only
            # count errors (perhaps after long timeouts), so stop here and say why.
            raise ServeBenchError(f"all warmup requests failed: {warmup_results[0].error}")
    num_warmup_errors = sum(not r.ok for r in warmup_results)
    result = {
        "config": asdict(cfg),
        "request_url": cfg.request_url,
        "warmup": {"num_requests": len(warmup_results), "num_errors": num_warmup_errors},
        "levels": [],
        "partial": True,  # until the last level: a file cut short by a time limit says so
    }
    for pos, concurrency in enumerate(cfg.concurrency):
        # The level's position is in the tag, so a repeated level gets fresh prompts too.
        level = await run_level(cfg, concurrency, tag=f"L{pos}c{concurrency}")
        result["levels"].append(level)
        result["partial"] = pos < len(cfg.concurrency) - 1
        if cfg.output_json:
            # After every level: a run cut by a time limit keeps the levels it finished.
            write_json(cfg.output_json, result)
        if on_level is not None:
            on_level(level)
    return result


def int_list(text: str) -> list[int]:
    # argparse prefixes the flag's name to the message; ranges are checked by ServeBenchConfig.
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers (e.g. 1,2,4), got {text!r}") from None


def add_serve_args_argument(parser: argparse.ArgumentParser) -> None:
    """--serve-args of the benches that start `mlxhost serve` themselves."""
    parser.add_argument("--serve-args", type=shlex.split, default=[],
                        help='more `mlxhost serve` flags as one string; a lone flag needs the = form, '
                             'e.g. --serve-args="--no-prefix-cache" or --serve-args "--cudnn-attention off"')
    parser.add_argument("--kernel-cache", choices=["fresh", "shared"], default="fresh",
                        help="MLX-CUDA's on-disk kernel cache for each server started: fresh (empty, so no server "
                             "finds another's compiles done) or shared (MLX's default folder, as on a machine "
                             "that served before)")


def add_load_arguments(parser: argparse.ArgumentParser, concurrency: list[int]) -> None:
    """The load shape `bench serve`, `engine`, `compare` and `structured` share (dests = ServeBenchConfig fields)."""
    parser.add_argument("--concurrency", type=int_list, default=concurrency,
                        help="comma-separated numbers of requests in flight, one level (run) each")
    parser.add_argument("--prompt-tokens", type=int, default=128,
                        help="approximate prompt length in tokens (distinct words per request: no prefix-cache hits)")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="completion tokens per request (max_tokens)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests per level (default: max(4 x concurrency, 8), four waves)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000[/v1]")
    parser.add_argument("--model", required=True, help="model name sent in each request")
    add_load_arguments(parser, [1, 2, 4, 8, 16])
    parser.add_argument("--prompt-tokens-mix", type=int_list, default=None, metavar="N,N,...",
                        help="prompt lengths cycled over each level's requests (a burst of mixed prompts: "
                             "--concurrency 8 --num-requests 8 with 8 lengths)")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions",
                        help="completions: /v1/completions with a plain prompt; chat: /v1/chat/completions with"
                             " one user message (the chat template adds tokens)")
    parser.add_argument("--warmup", type=int, default=1, help="requests sent before measuring")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="don't send ignore_eos (for servers that reject unknown fields)")
    parser.add_argument("--timeout", dest="timeout_s", type=float, default=600.0,
                        help="per-request timeout in seconds")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' words (same seed: same prompts)")
    parser.add_argument("--label", default="", help="name shown in the table, e.g. mlx_lm.server")
    parser.add_argument("--output-json", default=None,
                        help="result file (default: bench-results/serve-<label>-<time>.json)")
    parser.add_argument("--no-json", action="store_true", help="print the table only")
    plot.add_plot_argument(parser)


def default_json_path(label: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "server"
    return f"bench-results/serve-{slug}-{datetime.now():%Y%m%d-%H%M%S}.json"


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    # add_arguments names each flag's dest after its config field.
    names = {f.name for f in fields(ServeBenchConfig)}
    cfg = ServeBenchConfig(**{k: v for k, v in vars(args).items() if k in names})
    if getattr(args, "no_json", False):
        cfg.output_json = None
    elif cfg.output_json is None:
        cfg.output_json = default_json_path(cfg.display_label)
    return cfg


def _print_progress(level: dict) -> None:
    # Levels can take minutes each; show that the run is moving, on stderr so the table
    # on stdout stays clean for redirection.
    done = f"{level['num_ok']}/{level['num_requests']} ok"
    rates = ", ".join(f"{title} {level[key]:.1f}" for key, title, _ in TABLE_COLUMNS
                      if (key.endswith("tok_s_per_req") or key == "agg_tok_s") and level.get(key) is not None)
    print(f"[{level['label']}] conc={level['concurrency']}: {done}" + (f", {rates}" if rates else ""),
          file=sys.stderr, flush=True)
    for message in level["error_samples"]:
        print(f"  error: {message}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """CLI entry: 0 when every request succeeded, 1 when some failed, 2 when nothing ran."""
    try:
        cfg = config_from_args(args)
        result = asyncio.run(run_serve_bench(cfg, on_level=_print_progress))
    except (ValueError, ServeBenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(result["levels"], TABLE_COLUMNS))
    if cfg.output_json:
        print(f"wrote {cfg.output_json}", file=sys.stderr)
    if getattr(args, "plot", None) is not None:
        series = [(result["levels"][0]["label"], result["levels"])]
        plot.write_plot(plot.plot_series, series, args.plot, cfg.output_json, "bench-serve.png")
    return 0 if all(level["num_errors"] == 0 for level in result["levels"]) else 1
