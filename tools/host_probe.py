"""Why one stream's pace on the GPU host swings between rounds: raw generate_step, round by round,
beside what the host and the GPU were doing.

The served-against-raw line of `bench decode --url` compares two streams a second apart, and on the H100
hosts the same raw loop gave 3.5 ms a step in one round and 6.2 ms in the next. This probe prints, per round,
the step time with the CPU the main thread ran on and the GPU's SM clock and throttle reasons, so a slow round can
be put down to the CPU (a core, a NUMA node) or to the GPU (clocks), and a pinning tested against it.

usage: python tools/host_probe.py MODEL_DIR [--rounds 16] [--tokens 128] [--label NAME]
Run it under `taskset -c CPUS` to compare a pinned run with a free one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import threading
import time


def _cpu_of_thread() -> int:
    # Field 39 of /proc/<pid>/task/<tid>/stat is the CPU the thread last ran on.
    tid = threading.get_native_id()
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def _gpu_state() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,pstate,clocks_throttle_reasons.active,"
             "utilization.gpu,temperature.gpu,power.draw", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--label", default="free")
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(args.model)
    prompt = mx.array(tokenizer.encode("The quick brown fox " * 40))
    print(f"[{args.label}] pid {os.getpid()} affinity {sorted(os.sched_getaffinity(0))}", flush=True)

    def one_round() -> tuple[float, float, int, int]:
        cpus = set()
        times, last = [], None
        for n, _ in enumerate(generate_step(prompt, model, max_tokens=args.tokens)):
            now = time.perf_counter()
            if last is not None:
                times.append(now - last)
            last = now
            if n % 16 == 0:
                cpus.add(_cpu_of_thread())
        return (len(times) / sum(times), statistics.median(times) * 1000, min(cpus), len(cpus))

    one_round()  # kernels compile on the first pass
    rates = []
    for r in range(args.rounds):
        before = _gpu_state()
        tok_s, p50, cpu, ncpus = one_round()
        rates.append(tok_s)
        print(f"[{args.label}] round {r:2d}: {tok_s:6.1f} tok/s  step p50 {p50:5.2f} ms  cpu {cpu} "
              f"({ncpus} seen)  gpu before: {before}", flush=True)
    print(f"[{args.label}] median {statistics.median(rates):.1f} tok/s, min {min(rates):.1f}, max {max(rates):.1f}",
          flush=True)


if __name__ == "__main__":
    main()
