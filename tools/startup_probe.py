"""Start-up of one `mlxhost serve` from launch: when it answers, when the first request's first token comes,
how long requests sent while the warm-up still runs wait (first token, longest gap between two tokens), when
the warm-up ends, and the same load once it has ended. The server's log lines about the warm-up and the kernel
cache are printed beside the numbers, each with its time since launch.

usage: python tools/startup_probe.py MODEL_DIR --label cold-0.6b [--kernel-dir DIR] [--load-s 60]
       [--concurrency 16] [--wait-warmup-s 240] [--out FILE.json] [-- SERVER FLAGS...]
       python tools/startup_probe.py --attach URL --server-log FILE --launched-at EPOCH_S --label L [...]
--kernel-dir: MLX_PTX_CACHE_DIR for the server (an empty folder: a fresh machine; one an earlier start
filled: a warm restart). --attach: time a server someone else launched (tools/gpu-serve.sh, PROBE=1) from
EPOCH_S (time.time() at its launch): ready, first token, then waves for --load-s or until its log says the
warm-up finished, then (no load) until it finished or --wait-warmup-s passed since launch; it is left running
for the load that follows. Runs where mlxhost, its MLX
build and httpx import (tools/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import httpx

_WORDS = "time person year way day thing man world life hand part child eye woman place work week case point".split()
_LOGGED = re.compile(r"loaded |memory budget|KV for running|warm-up|kernel cache|tiled|slow engine step|Traceback|Error|"
                     r"ready on")
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def _prompt(tag: str, i: int, words: int = 170) -> str:
    rng = random.Random(f"{tag}/{i}")
    return f"Request {tag}.{i}: " + " ".join(rng.choices(_WORDS, k=words))


async def _one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, t0: float) -> dict:
    body = {"model": "bench", "stream": True, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}]}
    sent = time.monotonic()
    first, last, gap, tokens = None, None, 0.0, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"sent_s": sent - t0, "error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the server failed the request mid-stream: counted, not a crash of the probe
                err = chunk["error"]
                return {"sent_s": sent - t0, "error": str(err.get("message", err) if isinstance(err, dict) else err)}
            delta = chunk["choices"]
            if not delta or not delta[0].get("delta", {}).get("content"):
                continue
            now = time.monotonic()
            tokens += 1
            if first is None:
                first = now
            else:
                gap = max(gap, now - last)
            last = now
    if first is None:
        return {"sent_s": sent - t0, "error": "no content"}
    return {"sent_s": sent - t0, "ttft_s": first - sent, "max_gap_s": gap, "end_s": last - t0, "chunks": tokens}


async def _waves(url: str, tag: str, concurrency: int, until: float, t0: float, max_tokens: int,
                 min_waves: int = 1, stop=lambda: False) -> list[dict]:
    """Waves of `concurrency` requests until `until` (monotonic) or `stop()`, at least `min_waves`."""
    out, wave = [], 0
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        while wave < min_waves or (time.monotonic() < until and not stop()):
            out += await asyncio.gather(*(_one(client, url, _prompt(f"{tag}{wave}", i), max_tokens, t0)
                                          for i in range(concurrency)))
            wave += 1
    return out


def _stats(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = sorted(r["ttft_s"] for r in ok)
    return {"num": len(results), "errors": len(results) - len(ok),
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None, "ttft_max_s": ttft[-1] if ttft else None,
            "max_gap_s": max((r["max_gap_s"] for r in ok), default=None)}


def _log_reader(log_path: str, wall0: float, t0: float):
    """(read_log, lines): read_log() appends each new line of the server's log to `lines` with its time since
    launch (the line's own stamp if it has one)."""
    lines: list[tuple[float, str]] = []
    seen = 0

    def read_log() -> None:
        nonlocal seen
        with open(log_path) as f:
            text = f.read()
        for line in text.splitlines()[seen:]:
            m = _STAMP.match(line)
            when = (time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000 - wall0 if m
                    else time.monotonic() - t0)
            lines.append((when, line))
        seen = len(text.splitlines())

    return read_log, lines


def _wait_ready(url: str, alive=lambda: True, limit_s: float = 600) -> bool:
    deadline = time.monotonic() + limit_s
    while alive() and time.monotonic() < deadline:
        try:
            if httpx.get(url + "/v1/models", timeout=2, trust_env=False).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def _attach(args) -> int:
    """--attach: the start of a server launched at args.launched_at, left running."""
    t0 = time.monotonic() - (time.time() - args.launched_at)
    read_log, lines = _log_reader(args.server_log, args.launched_at, t0)
    out: dict = {"label": args.label}
    if not _wait_ready(args.attach, limit_s=args.wait_warmup_s):
        print(f"== {args.label}: not ready within {args.wait_warmup_s:.0f} s")
        return 1
    out["ready_s"] = time.monotonic() - t0
    first = asyncio.run(_first(args.attach, t0))
    out["first_request"] = first
    out["first_token_s"] = first.get("sent_s", 0) + first.get("ttft_s", float("nan"))
    if args.out:  # what is known so far, in case a time limit stops this process
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    def finished() -> bool:  # no background warm-up (CPU, --warmup on/off): one wave is enough
        read_log()
        return (any("warm-up finished" in line for _, line in lines)
                or not any("warm-up runs while serving" in line for _, line in lines))

    # Load for --load-s at most: the warm-up's own pieces run only while the engine is idle, so a load that
    # never pauses would keep it from ending; then the warm-up may finish alone until --wait-warmup-s.
    during = asyncio.run(_waves(args.attach, "during", args.concurrency, time.monotonic() + args.load_s, t0,
                                args.max_tokens, min_waves=1, stop=finished))
    out["during"] = _stats(during)
    out["requests_during"] = during
    while not finished() and time.monotonic() - t0 < args.wait_warmup_s:
        time.sleep(1)
    done = [t for t, line in lines if "warm-up finished" in line]
    out["warmup_finished_s"] = done[0] if done else None
    out["after"] = {"num": 0, "errors": 0, "ttft_p50_s": None, "ttft_max_s": None, "max_gap_s": None}
    out["log"] = [f"{t:7.1f} s  {line[:260]}" for t, line in lines if _LOGGED.search(line)]
    _report(args, out)
    return 0


def _report(args, out: dict) -> None:
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    done = out["warmup_finished_s"]
    print(f"== {args.label}: ready {out['ready_s']:.1f} s, first token {out['first_token_s']:.1f} s after launch; "
          f"warm-up finished {'%.1f s' % done if done is not None else 'not seen'}")
    for key in ("during", "after"):
        s = out[key]
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"   {key:6s} c={args.concurrency}: {s['num']} requests, {s['errors']} errors, TTFT p50 "
              f"{f(s['ttft_p50_s'])} s, max {f(s['ttft_max_s'])} s, longest gap between tokens {f(s['max_gap_s'])} s")
    print("\n".join(out["log"][-25:]))


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--label", required=True)
    p.add_argument("--kernel-dir", default=None)
    p.add_argument("--load-s", type=float, default=60)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--wait-warmup-s", type=float, default=240)
    p.add_argument("--out", default=None)
    p.add_argument("--attach", default=None, metavar="URL", help="a server already launched: do not launch one")
    p.add_argument("--server-log", default=None, help="--attach: the server's log file")
    p.add_argument("--launched-at", type=float, default=None, help="--attach: time.time() at the server's launch")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a time limit's TERM still stops the server (finally)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.server_args = argv[cut + 1:]
    if args.attach:
        return _attach(args)
    if args.model is None:
        p.error("MODEL_DIR is needed unless --attach names a running server")
    port = 8100 + random.randrange(800)
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.kernel_dir:
        env["MLX_PTX_CACHE_DIR"] = args.kernel_dir
    log_path = (args.out or f"/tmp/startup-{args.label}.json").rsplit(".", 1)[0] + ".log"
    log = open(log_path, "w")
    t0, wall0 = time.monotonic(), time.time()
    server = subprocess.Popen([sys.executable, "-m", "mlxhost.server.cli", "serve", args.model, "--port", str(port),
                               "--served-model-name", "bench", "--max-num-seqs", "64", *args.server_args],
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    read_log, lines = _log_reader(log_path, wall0, t0)
    out: dict = {"label": args.label}
    try:
        while True:
            if server.poll() is not None:
                read_log()
                print("\n".join(line for _, line in lines[-30:]))
                return 1
            try:
                if httpx.get(url + "/v1/models", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        out["ready_s"] = time.monotonic() - t0
        first = asyncio.run(_first(url, t0))
        out["first_request"] = first
        out["first_token_s"] = first.get("sent_s", 0) + first.get("ttft_s", float("nan"))
        during = asyncio.run(_waves(url, "during", args.concurrency, time.monotonic() + args.load_s, t0,
                                    args.max_tokens))
        out["during"] = _stats(during)
        read_log()
        deadline = time.monotonic() + args.wait_warmup_s
        while not any("warm-up finished" in line for _, line in lines) and time.monotonic() < deadline:
            time.sleep(1)
            read_log()
        finished = [t for t, line in lines if "warm-up finished" in line]
        out["warmup_finished_s"] = finished[0] if finished else None
        after = asyncio.run(_waves(url, "after", args.concurrency, 0, t0, args.max_tokens, min_waves=2))
        out["after"] = _stats(after)
        out["requests_during"] = during
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        read_log()
    out["log"] = [f"{t:7.1f} s  {line[:260]}" for t, line in lines if _LOGGED.search(line)]
    _report(args, out)
    return 0


async def _first(url: str, t0: float) -> dict:
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        return await _one(client, url, _prompt("first", 0), 16, t0)


if __name__ == "__main__":
    sys.exit(main())
