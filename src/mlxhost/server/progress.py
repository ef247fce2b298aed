"""Stage lines on stderr for slow one-off work (building the demo model): `demo model: writing weights...`,
so a first `mlxhost serve` says what it is doing instead of sitting silent."""

from __future__ import annotations

import sys
import time


class StageLog:
    """A `progress(stage)` callback: prints each stage as it starts, with the time since the first."""

    def __init__(self, what: str, out=None) -> None:
        self.what, self._out = what, out
        self._start: float | None = None  # the clock starts at the first stage, not at import time

    def __call__(self, stage: str) -> None:
        if self._start is None:
            self._start = time.perf_counter()
        self._print(f"{self.what}: {stage}... (+{time.perf_counter() - self._start:.1f} s)")

    def done(self) -> None:
        """The total time, if any stage was shown (nothing was built: nothing to say)."""
        if self._start is not None:
            self._print(f"{self.what}: done in {time.perf_counter() - self._start:.1f} s")

    def _print(self, line: str) -> None:
        print(line, file=self._out or sys.stderr, flush=True)  # read at call time: tests swap sys.stderr
