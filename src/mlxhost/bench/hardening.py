"""Hardening benchmarks, against a running server (any build, so before/after compare):

  python -m mlxhost.bench.hardening stall --url URL --model NAME   # streams' worst inter-token gap
                                                                    # while 5 MB bodies arrive
  python -m mlxhost.bench.hardening rss --url URL --pid PID --model NAME   # RSS: warm-up, soak, clear
  python -m mlxhost.bench.hardening startup MODEL_PATH            # `mlxhost serve` until /health

Each prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from mlxhost.server.settings import ArgumentParser, HelpFormatter


def _stream(url: str, model: str, max_tokens: int, gaps: list) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    last, worst, n = None, 0.0, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    worst = max(worst, now - last)
                last, n = now, n + 1
    gaps.append((worst, n))


def _phase(url: str, model: str, streams: int, max_tokens: int, bodies: int, body_mb: float) -> dict:
    gaps: list = []
    threads = [threading.Thread(target=_stream, args=(url, model, max_tokens, gaps)) for _ in range(streams)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    statuses, health_s = [], []
    big = "word " * int(body_mb * 10**6 / 5)
    with httpx.Client(base_url=url, timeout=600) as c:
        for _ in range(bodies):
            r = c.post("/v1/chat/completions", json={"model": model, "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": big}]})
            statuses.append(r.status_code)
            started = time.perf_counter()
            c.get("/health")
            health_s.append(time.perf_counter() - started)
    for t in threads:
        t.join()
    return {"max_gap_s": max(g for g, _ in gaps), "tokens_per_stream": min(n for _, n in gaps),
            "statuses": sorted(set(statuses)), "max_health_s": max(health_s, default=0.0)}


def stall(args) -> dict:
    quiet = _phase(args.url, args.model, args.streams, args.max_tokens, 0, 0)
    loaded = _phase(args.url, args.model, args.streams, args.max_tokens, args.bodies, args.body_mb)
    print(f"{'phase':<22}{'max gap s':>10}{'tokens':>8}{'statuses':>12}{'health s':>10}")
    for name, r in (("no big bodies", quiet), (f"{args.bodies} x {args.body_mb} MB bodies", loaded)):
        print(f"{name:<22}{r['max_gap_s']:>10.3f}{r['tokens_per_stream']:>8}{str(r['statuses']):>12}"
              f"{r['max_health_s']:>10.3f}")
    return {"quiet": quiet, "big_bodies": loaded}


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _requests(c: httpx.Client, model: str, n: int, tag: str, words: int) -> None:
    for i in range(n):
        text = f"{tag} {i} " + " ".join(f"w{(i * 7 + j) % 997}" for j in range(words))
        c.post("/v1/chat/completions", json={"model": model, "max_tokens": 16,
                                             "messages": [{"role": "user", "content": text}]}).raise_for_status()


def rss(args) -> dict:
    out = {}
    with httpx.Client(base_url=args.url, timeout=600) as c:
        _requests(c, args.model, 8, "warm", args.words)
        out["after_warmup"] = _rss(args.pid)
        _requests(c, args.model, args.requests, "soak", args.words)  # distinct prompts fill the prefix cache
        out["after_soak"] = _rss(args.pid)
        out["cleared_blocks"] = c.delete("/v1/cache").json().get("cleared_blocks")
        time.sleep(1.0)
        out["after_clear"] = _rss(args.pid)
    out["clear_vs_warmup"] = out["after_clear"] / out["after_warmup"] - 1
    for k in ("after_warmup", "after_soak", "after_clear"):
        print(f"{k:<14}{out[k] / (1 << 20):>10.1f} MiB")
    print(f"after clear vs after warm-up: {out['clear_vs_warmup']:+.1%} ({out['cleared_blocks']} blocks cleared)")
    return out


def startup(args) -> dict:
    cmd = [sys.executable, "-m", "mlxhost.server.cli", "serve", args.model_path, "--port", str(args.port)]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    ready = None
    try:
        while proc.poll() is None and time.perf_counter() - started < args.timeout:
            try:
                if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=1).status_code == 200:
                    ready = time.perf_counter() - started
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    print(f"start-up of {args.model_path}: " + (f"{ready:.1f} s" if ready else f"not ready in {args.timeout} s"))
    return {"model": args.model_path, "startup_s": ready}


def make_parser() -> argparse.ArgumentParser:
    # Its subcommands' parsers are of this class too: no abbreviated flags, the same one-line errors.
    p = ArgumentParser(prog="python -m mlxhost.bench.hardening", formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("stall", formatter_class=HelpFormatter,
                       help="streams' worst inter-token gap, quiet and while big request bodies arrive")
    s.add_argument("--streams", type=int, default=8, help="streaming requests running through both phases")
    s.add_argument("--max-tokens", type=int, default=600, help="tokens each stream generates")
    s.add_argument("--bodies", type=int, default=6, help="big request bodies sent one after another")
    s.add_argument("--body-mb", type=float, default=5.0, help="size of each big body in MB")
    r = sub.add_parser("rss", formatter_class=HelpFormatter, help="server RSS after warm-up, a soak, a cache clear")
    r.add_argument("--pid", type=int, required=True, help="the server's process id (its RSS is read from /proc)")
    r.add_argument("--requests", type=int, default=300, help="soak: requests with distinct prompts")
    r.add_argument("--words", type=int, default=200, help="words per prompt")
    for q in (s, r):
        q.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
        q.add_argument("--model", required=True, help="model name sent in each request")
    u = sub.add_parser("startup", formatter_class=HelpFormatter, help="`mlxhost serve MODEL` until /health answers")
    u.add_argument("model_path", help="model folder to serve")
    u.add_argument("--port", type=int, default=18321, help="port the server is started on")
    u.add_argument("--timeout", type=float, default=600, help="seconds to wait for /health")
    for q in (s, r, u):
        q.add_argument("--out", default=None, help="JSON results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    result = {"stall": stall, "rss": rss, "startup": startup}[args.what](args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
