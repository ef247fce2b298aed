"""The serving process's life: the port taken before the model loads, signals honoured in every phase,
and a shutdown with a deadline.

- Start-up: `bind` takes the port first, so a port in use is reported in a second, not after minutes
  of loading. Until uvicorn runs, Python's own handlers stand (SIGTERM's default ends the process at
  once, SIGINT raises KeyboardInterrupt); once uvicorn has installed its handlers but the app is still
  starting (the engine thread profiles memory while the loop waits for it), a signal ends the process
  the default way: there is nothing to drain yet, and uvicorn would only notice after start-up.
- Shutdown: the first SIGTERM/SIGINT stops accepting connections and lets running streams finish
  until `shutdown_timeout_s`; then each stream still open ends with an error event (finish reason
  "abort"), and one log line names each. A second signal ends them at once. On every path the engines are
  stopped, which writes the SSD tier's queued blocks to disk (engine_core.close()) — unless an engine is
  still inside a step (or call) a moment past the deadline: then the process exits without it (os._exit,
  after flushing the logs), since a step may run for minutes on a slow machine and nothing can interrupt it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import sys
import time
from typing import Any

import uvicorn

log = logging.getLogger(__name__)

# After the deadline the ended streams need a moment to send their error events and close.
_CLOSE_GRACE_S = 5.0
# A second signal: the ended streams' error events leave before the loop stops, up to this long (a loaded
# machine may need more than a moment to run their last chunks).
_FORCE_FLUSH_S = 2.0
# Past the deadline, a step still running gets this long to end (a normal one takes milliseconds); then
# the process exits without its engine.
_STEP_GRACE_S = 1.0


class PortInUseError(OSError):
    pass


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on (host, port), bound now; PortInUseError when taken."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    # SO_REUSEADDR as uvicorn sets it: a restart may bind while old connections sit in TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


class GracefulServer(uvicorn.Server):
    """uvicorn's server with mlxhost's shutdown: a deadline for running streams and an SSD flush on
    every path (uvicorn skips the app's lifespan shutdown after a second signal)."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        self._deadline_handle: Any = None
        self._loop: Any = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.started:
            # Still starting (the app's lifespan blocks the loop while the engine starts): end now.
            log.warning("signal %d during start-up: exiting", sig)
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            return
        first = not self.should_exit
        self.should_exit = True
        # Signal handlers run between two bytecodes of the loop's own thread: schedule, do not act here
        # (but the deadline is read while the engines are waited for, which blocks the loop: set it now).
        state = self.config.app.state
        if first:
            log.info("shutting down: running streams have %.0f s to finish (a second signal ends them now)",
                     self.shutdown_timeout_s)
            state.stop_deadline = time.monotonic() + self.shutdown_timeout_s + _STEP_GRACE_S
            self._loop.call_soon_threadsafe(self._arm_deadline)
        else:
            state.stop_deadline = min(getattr(state, "stop_deadline", None) or math.inf,
                                      time.monotonic() + _FORCE_FLUSH_S + _STEP_GRACE_S)
            self._loop.call_soon_threadsafe(self._force)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def _arm_deadline(self) -> None:
        self._deadline_handle = self._loop.call_later(self.shutdown_timeout_s, self._end_streams,
                                                      "the server is shutting down: this stream was ended at its "
                                                      "shutdown deadline")

    def _end_streams(self, reason: str) -> None:
        for request_id in self.config.app.state.end_streams(reason):  # the FastAPI app (create_app)
            log.warning("request %s ended: %s", request_id, reason)

    def _force(self) -> None:
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
        self._end_streams("the server is shutting down now (second signal)")
        self._force_when_sent(self._loop.time() + _FORCE_FLUSH_S)

    def _force_when_sent(self, deadline: float) -> None:
        # The request tasks end once their responses are written: the error events have left.
        if not self.server_state.tasks or self._loop.time() >= deadline:
            self.force_exit = True
        else:
            self._loop.call_later(0.02, self._force_when_sent, deadline)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        # After a second signal uvicorn skipped the lifespan's shutdown, which closes the services and stops the
        # engines: done here, so the SSD tier's queued blocks still reach the disk. Otherwise only engines left
        # inside a step.
        state = self.config.app.state
        if self.force_exit:
            await state.close_services()  # each bounded by the shutdown deadline (create_app's close_services)
        num_stuck = state.close_models(lambda: state.stop_deadline)
        if num_stuck:
            log.warning("exiting at the shutdown deadline without %d engine(s) still inside a step", num_stuck)
            _exit_now()
        # A graceful stop is a normal exit (0), not a death by the signal uvicorn would re-raise.
        self._captured_signals.clear()


def _exit_now() -> None:
    """Ends the process without waiting for a thread stuck inside a step: a normal exit would run
    interpreter and MLX teardown under it. The log lines written so far reach the console first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a graceful stop, as uvicorn's own path ends (the signal is not re-raised)


# The HTTP thread and the engine thread share one GIL. Python makes a thread that wants it wait up to the
# switch interval (5 ms by default) before the holder must let go, and under load the HTTP thread holds it
# for long runs of SSE chunks while the engine thread's step waits to build its next graph. A shorter interval
# measured no different from the default (docs/BENCHMARKS.md), so Python's stays; this is for A/B runs.
SWITCH_INTERVAL_ENV = "MLXHOST_SWITCH_INTERVAL_MS"


def switch_interval_s(environ=os.environ) -> float | None:
    """The GIL switch interval the serving process sets, in seconds; None keeps Python's."""
    value = environ.get(SWITCH_INTERVAL_ENV)
    if not value:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = 0.0
    if not 0 < ms < math.inf:
        raise ValueError(f"{SWITCH_INTERVAL_ENV} must be a number of milliseconds above 0, got {value!r}")
    return ms / 1000


def run(app: Any, sock: socket.socket, log_level: str, shutdown_timeout_s: float,
        switch_interval: float | None = None) -> None:
    """Serves `app` on the already bound `sock` until a signal, then shuts down gracefully.
    `switch_interval`: the GIL switch interval in seconds (switch_interval_s), None keeps Python's."""
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    config = uvicorn.Config(app, log_level=log_level,
                            # uvicorn's own bound, behind ours: streams are ended at the deadline already.
                            timeout_graceful_shutdown=shutdown_timeout_s + _CLOSE_GRACE_S)
    GracefulServer(config, shutdown_timeout_s).run(sockets=[sock])
