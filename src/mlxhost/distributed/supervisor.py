"""Rank 0's watch over the other ranks: a rank that dies, fails or stops answering ends the server.

A lost rank cannot be replaced (it held part of every layer, or whole layers), so the only honest
answer is to stop: every open stream ends with a 503 error event, then the process exits. It must
never hang, so the checks run on their own thread, from the moment the ranks exist: a rank process
that exited (the ones mlxhost started itself), a rank whose control connection closed or that
reported an error (at start-up too: the whole start-up fails within a second, with the rank's reason,
even while rank 0 waits inside a collective that rank will never join), and a step that has not come
back within `step_timeout_s` (a rank that stopped answering without closing its connection). The
timeout's message says what each rank was doing, from the phases the followers report.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from mlxhost.distributed.launch import LocalRanks

log = logging.getLogger(__name__)

FATAL_EXIT_CODE = 3
STARTUP_EXIT_CODE = 1
_POLL_S = 0.2
_FLUSH_S = 1.0  # time for the ended streams' error events to leave before the process goes
_SLOW_STEP_S = 10.0  # a step this long is logged with what every rank is doing (then every 10 s)


class Supervisor:
    def __init__(self, ranks: LocalRanks, step_timeout_s: float, exit: Callable[[int], None] = os._exit) -> None:
        self.ranks = ranks
        self.step_timeout_s = step_timeout_s
        self._exit = exit
        self._loop: Any = None
        self._end_streams: Callable[[str], Any] | None = None
        self._step_started: float | None = None
        self._step_what = ""
        self._slow_logged = 0.0
        self._closing = False
        self.serving = False  # False during start-up: a loss then is a failed start, not a lost server
        self.channel: Any = None  # the LeadChannel, for what the other ranks are doing
        self._fatal = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mlxhost-rank-watch", daemon=True)

    def start(self, channel: Any = None) -> None:
        """Starts watching (as soon as the ranks are connected); `channel`'s losses end the process."""
        self.channel = channel
        if channel is not None:
            channel.on_lost = self.fatal
        self._thread.start()

    def attach(self, loop: Any, end_streams: Callable[[str], Any]) -> None:
        """The event loop and the app's `end_streams(reason)`, once the server runs."""
        self._loop, self._end_streams = loop, end_streams
        self.serving = True

    def step_started(self, what: str = "") -> None:
        self._step_what = what
        self._slow_logged = 0.0
        self._step_started = time.monotonic()

    def step_done(self) -> None:
        self._step_started = None

    def closing(self) -> None:
        """A normal shutdown: ranks exiting now are expected."""
        self._closing = True
        if self.channel is not None:
            self.channel.closing = True
        self._stop.set()

    def dead_rank(self, wait_s: float = 0.0) -> str | None:
        """Which rank process exited, if any (waiting up to `wait_s` for one to be reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, child in enumerate(self.ranks.children, start=1):
                code = child.poll()
                if code is not None:
                    return f"rank {rank} (pid {child.pid}) exited with code {code}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def others(self) -> str:
        """What the other ranks last reported doing."""
        return self.channel.describe_peers() if self.channel is not None else "no reports"

    def fatal(self, reason: str) -> None:
        """Ends every stream with `reason`, stops the other ranks and exits. Never returns."""
        with self._fatal:  # the first caller does it; a second one waits for the exit
            if self._closing:
                log.warning("after shutdown: %s", reason)
                return
            if not self.serving:
                log.critical("start-up failed: %s; stopping every rank", reason)
                self.ranks.stop(timeout_s=2.0)
                logging.shutdown()
                self._exit(STARTUP_EXIT_CODE)
                return
            log.critical("distributed serving cannot go on: %s; ending all streams and exiting", reason)
            message = f"the server lost a rank and is exiting: {reason}"
            if self._loop is not None and self._end_streams is not None:
                try:
                    self._loop.call_soon_threadsafe(self._end_streams, message)
                except RuntimeError:  # the loop is closed already
                    pass
                time.sleep(_FLUSH_S)
            self.ranks.stop(timeout_s=2.0)
            logging.shutdown()
            self._exit(FATAL_EXIT_CODE)

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            dead = self.dead_rank()
            if dead is not None:
                self.fatal(dead)
                return
            started = self._step_started
            if started is None:
                continue
            took = time.monotonic() - started
            if took > self.step_timeout_s:
                self.fatal(f"a step got no answer from the other ranks for {self.step_timeout_s:.0f} s (rank 0: "
                           f"{self._step_what}; {self.others()})")
                return
            if took > _SLOW_STEP_S and took - self._slow_logged > _SLOW_STEP_S:
                self._slow_logged = took
                log.warning("step running for %.0f s: rank 0 %s; %s", took, self._step_what, self.others())
