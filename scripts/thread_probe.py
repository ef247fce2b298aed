"""Is MLX-CUDA slower on a thread other than the one that first used it (#19's c=1 gap)?

`bench decode` on an H100 put the engine core loop at raw generate_step's pace on the main thread and at
0.875x of it on a thread of its own. This probe runs raw generate_step round by round on two threads of
one process, in turns: `first` (the thread that imported MLX and loaded the model) and `second` (started
after). With --import-on-thread the main thread never imports MLX: a worker thread does, so it is `first`.

usage: python scripts/thread_probe.py MODEL_DIR [--rounds 12] [--tokens 128] [--import-on-thread]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading


class Worker:
    """A thread that runs the callables it is handed, one at a time, and hands back their results."""

    def __init__(self, name: str) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            fn = self.inbox.get()
            try:
                self.outbox.put(fn())
            except BaseException as exc:  # noqa: BLE001
                self.outbox.put(exc)

    def call(self, fn):
        self.inbox.put(fn)
        out = self.outbox.get()
        if isinstance(out, BaseException):
            raise out
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--import-on-thread", action="store_true")
    args = parser.parse_args()

    state: dict = {}

    def setup():
        from mlx_lm import load

        state["model"], tok = load(args.model)
        state["prompt"] = tok.encode("The quick brown fox jumps over the lazy dog. " * 16)

    def raw():
        from mlxserve.bench.decode import _raw  # bench decode's own timing of generate_step

        return _raw(state["model"], state["prompt"], args.tokens)["tok_s"]

    if args.import_on_thread:
        first = Worker("first")
        first.call(setup)
        run_first = lambda: first.call(raw)  # noqa: E731
    else:
        setup()
        run_first = raw
    second = Worker("second")
    rates: dict[str, list[float]] = {"first": [], "second": []}
    run_first(), second.call(raw)  # compile kernels on both
    for r in range(args.rounds):
        order = [("first", run_first), ("second", lambda: second.call(raw))]
        for name, fn in order[:: -1 if r % 2 else 1]:
            rates[name].append(fn())
        print(f"round {r}: first {rates['first'][-1]:.1f}  second {rates['second'][-1]:.1f}  "
              f"ratio {rates['second'][-1] / rates['first'][-1]:.3f}", flush=True)
    ratios = [b / a for a, b in zip(rates["first"], rates["second"])]
    print(f"{'import on a worker thread' if args.import_on_thread else 'import on the main thread'}: "
          f"first {statistics.median(rates['first']):.1f}, second {statistics.median(rates['second']):.1f} tok/s; "
          f"second/first per round median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
