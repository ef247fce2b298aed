"""Per-call cost of MLX's collectives between local ranks: what tensor parallel pays per layer.

Starts N ranks of itself on this host (NCCL: one GPU each; ring: loopback, for a dry run on a CPU), then
each rank times, inside one mx.eval each:
  - K chained all_sum of a [1, hidden] array (a decode step's all-reduces, nothing else);
  - K chained [1, hidden] x [hidden, hidden] matmuls with an all_sum after each (the decode pattern), and
    the same matmuls alone: the difference is what the all-reduces add to a step;
  - K chained all_gather of [1, hidden] (a pipeline hand-off's collective);
  - K layer-like segments (a matmul and --ops small kernels) with and without an all_sum after each.
usage: python tools/allsum_probe.py [--backend nccl|ring] [--ranks 2] [--hidden 5120] [--calls 128]
Prints one JSON line per rank (ms per call, medians of --repeat runs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> int:
    """Runs the ranks and returns the worst exit code; stops them all (and removes the ring's hostfile) when
    one fails, when --timeout passes or when this process is told to stop (SIGTERM from `timeout`)."""
    env = {**os.environ, "MLX_WORLD_SIZE": str(args.ranks)}
    hostfile = None
    if args.backend == "nccl":
        env.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(_free_port()))
    else:
        fd, hostfile = tempfile.mkstemp(suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([[f"127.0.0.1:{_free_port()}"] for _ in range(args.ranks)], f)
        env["MLX_HOSTFILE"] = hostfile
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the cleanup below runs
    procs = []
    deadline = time.monotonic() + getattr(args, "timeout", 600)
    try:
        for rank in range(args.ranks):
            child = {**env, "MLX_RANK": str(rank)}
            if args.backend == "nccl":
                child["CUDA_VISIBLE_DEVICES"] = str(rank)
            procs.append(subprocess.Popen([sys.executable, args.script, "--rank-worker", *sys.argv[1:]], env=child))
        # A rank that dies leaves the others waiting in a collective: the first failure ends the run.
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                print("a rank failed or the time ran out: stopping the ranks", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return max(p.returncode for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if hostfile:
            os.unlink(hostfile)


def _time(fn, repeat: int) -> float:
    import mlx.core as mx

    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def worker(args) -> None:
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend=args.backend)
    k, dtype = args.calls, mx.bfloat16 if args.backend == "nccl" else mx.float32
    x = mx.random.normal((1, args.hidden)).astype(dtype)
    w = (mx.random.normal((args.hidden, args.hidden)) * 0.01).astype(dtype)
    mx.eval(x, w)
    start = time.perf_counter()
    mx.eval(mx.distributed.all_sum(x, group=group))
    first_ms = (time.perf_counter() - start) * 1e3

    def sums():
        y = x
        for _ in range(k):
            y = mx.distributed.all_sum(y, group=group) * 0.5
        return y

    def gathers():
        y = x
        for _ in range(k):
            y = mx.distributed.all_gather(y, group=group)[:1]
        return y

    def matmuls(reduce: bool):
        def run():
            y = x
            for _ in range(k):
                y = y @ w
                if reduce:
                    y = mx.distributed.all_sum(y, group=group)
            return y
        return run

    def layers(reduce: bool):
        # A layer-like segment between all-reduces: one matmul and --ops small kernels (norms, rope,
        # residuals): if an all-reduce made the host wait for the device, the device would idle while the
        # host encodes the next segment, and the difference to no all-reduce would grow with --ops.
        def run():
            y = x
            for _ in range(k):
                y = y @ w
                for _ in range(args.ops):
                    y = mx.sin(y) * 0.5 + y
                if reduce:
                    y = mx.distributed.all_sum(y, group=group)
            return y
        return run

    for fn in (sums, gathers, matmuls(True), matmuls(False), layers(True), layers(False)):  # compile first
        mx.eval(fn())
    result = {"rank": group.rank(), "backend": args.backend, "hidden": args.hidden, "calls": k,
              "first_all_sum_ms": round(first_ms, 2)}
    result["all_sum_ms_per_call"] = _time(sums, args.repeat) * 1e3 / k
    result["all_gather_ms_per_call"] = _time(gathers, args.repeat) * 1e3 / k
    with_sum = _time(matmuls(True), args.repeat)
    alone = _time(matmuls(False), args.repeat)
    result["matmul_ms_per_call"] = alone * 1e3 / k
    result["matmul_plus_all_sum_ms_per_call"] = with_sum * 1e3 / k
    result["all_sum_adds_ms_per_call"] = (with_sum - alone) * 1e3 / k
    with_sum, alone = _time(layers(True), args.repeat), _time(layers(False), args.repeat)
    result["layer_ms_per_call"] = alone * 1e3 / k
    result["layer_all_sum_adds_ms_per_call"] = (with_sum - alone) * 1e3 / k
    print(json.dumps({key: round(v, 4) if isinstance(v, float) else v for key, v in result.items()}), flush=True)


def rank_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every probe that starts its own ranks (`launch`) takes."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--backend", default="nccl", choices=["nccl", "ring"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are stopped")
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    return p


def run(args, worker_fn, script: str) -> int:
    """A rank runs `worker_fn`; the launching process starts the ranks of `script` and waits for them."""
    if args.rank_worker:
        worker_fn(args)
        return 0
    args.script = script
    return launch(args)


def main() -> int:
    p = rank_parser(__doc__)
    p.add_argument("--hidden", type=int, default=5120, help="Qwen3-32B: 5120; Qwen3-8B: 4096")
    p.add_argument("--calls", type=int, default=128, help="collectives per eval (32B TP decode: 2 x 64 layers)")
    p.add_argument("--ops", type=int, default=24, help="small kernels per layer-like segment")
    p.add_argument("--repeat", type=int, default=9)
    return run(p.parse_args(), worker, __file__)


if __name__ == "__main__":
    sys.exit(main())
