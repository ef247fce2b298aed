"""The asyncio facade: handlers submit, stream and abort; one engine thread owns MLX.

Commands go to the engine thread through a thread-safe queue; each step's outputs come back in one
`call_soon_threadsafe` callback that fans them out to per-request asyncio queues. What the status routes
show comes from a snapshot the engine thread publishes (status.py), so no read waits behind a step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from mlxhost.engine.contract import Core, CoreStats, StepInfo
from mlxhost.engine.request import Request, RequestOutput, merge_outputs
from mlxhost.engine.scheduler import QueueFullError
from mlxhost.engine.status import StatusSnapshot, take_snapshot

log = logging.getLogger(__name__)

# A step this long stalls every stream; worth a log line (kernel compiles, a huge prefill chunk).
_SLOW_STEP_S = 1.0
# A file to write one line per engine step to (where a step's time goes under load, e.g. on a GPU).
STEP_TRACE_ENV = "MLXHOST_STEP_TRACE"
STEP_SYNC_ENV = "MLXHOST_STEP_SYNC"
# The status snapshot is rebuilt after a step at most this often (it reads memory: ~0.6 ms on a CPU, a
# tiny model's whole step), and always after a step that finished a request, after a call and on idle.
_SNAPSHOT_EVERY_S = 0.1
# Idle, the engine wakes at least this often, so the snapshot's memory readings stay this fresh.
_IDLE_WAKE_S = 5.0
# stop() waits this long for the engine thread to close its core (the SSD tier's queued writes).
_STOP_JOIN_S = 30.0
_JOIN_SLICE_S = 0.05


class EngineClosedError(Exception):
    """A call the engine never got to (or never finished) before the server's shutdown deadline."""


# The counters the HTTP side reads (metrics); a core's stats() (engine/contract.py).
EngineStats = CoreStats


@dataclass
class Assembled:
    """A core with everything it serves with (engine/assemble.py builds it): the warm-up the loop runs between
    requests (engine/warmup.py's BackgroundWarmup; None: none left), and how often desktop mode re-reads memory."""

    core: Core
    warmup: Any = None
    memory_refresh_s: float = 0.0


# Where the warm-up's own steps run (docs/BENCHMARKS.md, "What the warm-up leaves behind"): "thread" by default on
# MLX-CUDA, where steps on the engine thread left a lone stream 10% slower after the warm-up; "off" elsewhere.
WARMUP_ISOLATE_ENV = "MLXHOST_WARMUP_ISOLATE"


def warmup_isolation(environ=os.environ) -> str:
    mode = environ.get(WARMUP_ISOLATE_ENV)
    if mode is None:
        from mlxhost.platform.backend import is_cuda  # lazy: imports mlx

        return "thread" if is_cuda() else "off"
    return mode


class _WarmupSteps:
    """Runs the background warm-up's steps: on the engine thread's stream like every other step ("off"), on a
    stream of their own ("stream"), or on a thread of their own ("thread": MLX keeps each thread's streams, and on
    MLX-CUDA their instantiated CUDA graphs, apart), whose streams are dropped when the warm-up ends. The engine
    thread waits for each such step, so the core still has one user at a time."""

    def __init__(self, mode: str) -> None:
        import mlx.core as mx  # lazy: mlx only when used

        if mode not in ("", "off", "stream", "thread"):
            log.warning("%s=%r is not 'off', 'stream' or 'thread': the warm-up's steps run as every other step",
                        WARMUP_ISOLATE_ENV, mode)
        elif mode in ("stream", "thread"):
            log.info("the warm-up's steps run on a %s of their own (%s)", mode, WARMUP_ISOLATE_ENV)
        self._stream = mx.new_stream(mx.default_device()) if mode == "stream" else None
        self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlxhost-warm")
                      if mode == "thread" else None)

    def step(self, core: Core) -> list:
        import mlx.core as mx  # lazy: mlx only when used

        if self._stream is not None:
            with mx.stream(self._stream):
                return core.step()
        if self._pool is not None:
            return self._pool.submit(core.step).result()
        return core.step()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.submit(_drop_thread_streams).result()
            self._pool.shutdown()
            self._pool = None


def _drop_thread_streams() -> None:
    """MLX 0.32 needs each thread that used it to clear its streams before it ends: left to process teardown, a
    finished thread's stream aborted the interpreter at exit now and then ("terminate called without an active
    exception", exit code 134; ml-explore/mlx#3395)."""
    import mlx.core as mx  # lazy: mlx only when used

    if hasattr(mx, "clear_streams"):
        mx.synchronize()
        mx.clear_streams()


class AsyncEngine:
    def __init__(self, assemble: Callable[[], Assembled], max_num_waiting: int) -> None:
        # The core (and with it the model's MLX stream) is built on the engine thread itself.
        self._assemble = assemble
        self._max_num_waiting = max_num_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.stats = CoreStats()  # the core's, after its last step (or idle wake-up, or call)
        # What /v1/status and /v1/cache/stats show: built on the engine thread, swapped whole, read anywhere.
        self.snapshot: StatusSnapshot | None = None
        self._snapshot_at = 0.0  # engine thread only
        self._snapshot_failed = False  # engine thread only: a failure is logged once
        # When the engine thread entered the step (or call) it is in; None between them. Written there only.
        self._busy_since: float | None = None
        self._calls: dict[concurrent.futures.Future, asyncio.Future] = {}  # loop thread only
        self._stop_sent = False
        self._warming = False  # a background warm-up is still running (written on the engine thread only)
        self._warm_steps: _WarmupSteps | None = None  # where its steps run (engine thread only)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="mlxhost-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self, until: Callable[[], float | None] = lambda: None) -> bool:
        """Stops the engine thread, which closes its core first. `until()` (time.monotonic(), read while
        waiting: a second signal brings it forward) bounds the wait for a step or call still running;
        False when the thread was still inside one then: left running (a daemon), the process may exit."""
        thread = self._thread
        if thread is None:
            return True
        if not self._stop_sent:
            self._inbox.put(("stop", None))
            self._stop_sent = True
        give_up = time.monotonic() + _STOP_JOIN_S
        while thread.is_alive() and time.monotonic() < give_up:
            thread.join(timeout=_JOIN_SLICE_S)  # in slices: a signal handler runs between them
            deadline = until()
            if thread.is_alive() and deadline is not None and time.monotonic() >= deadline \
                    and self._busy_since is not None:
                return False
        self._thread = None
        return True

    @property
    def busy_s(self) -> float | None:
        """How long the engine thread has been inside its current step or call (None: between them)."""
        since = self._busy_since
        return time.perf_counter() - since if since is not None else None

    @property
    def warmup_running(self) -> bool:
        """Whether the background warm-up (engine/warmup.py) still has pieces or helper processes to finish."""
        return self._warming

    @property
    def kv_capacity_tokens(self) -> int | None:
        """The KV capacity (memory/capacity.py; desktop mode lowers it under memory pressure) as of the core's last
        step, idle wake-up or call: the API's "can never fit" check."""
        return self.stats.kv_capacity_tokens

    @property
    def num_active(self) -> int:
        return len(self._streams)

    def request_progress(self, request_id: str) -> dict | None:
        """The request's entry of the latest status snapshot (its prefill progress); None before the engine
        published one that has it."""
        snapshot = self.snapshot
        return snapshot.requests.get(request_id) if snapshot is not None else None

    # -- requests ------------------------------------------------------------------------------
    def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queues `request` and returns its output stream; raises QueueFullError at once when full.

        Iterate the stream to the end or close it: leaving it early (a disconnect cancels the
        handler) aborts the request, which frees its slot and KV in the next engine step.
        """
        # Everything not running is waiting (or on its way to the queue). The running count may lag a
        # step behind, which only ever overstates the queue: the scheduler's own limit is never hit.
        num_waiting = len(self._streams) - self.stats.num_running
        if num_waiting >= self._max_num_waiting:
            raise QueueFullError(
                f"{num_waiting} requests are already waiting (limit {self._max_num_waiting}) behind "
                f"{self.stats.num_running} running"
            )
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = stream
        self._inbox.put(("add", request))
        return _OutputStream(self, request.request_id, stream)

    async def _iterate(self, rid: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                ready = [await stream.get()]
                while not ready[-1].finished and not stream.empty():
                    ready.append(stream.get_nowait())
                out = merge_outputs(ready)
                finished = out.finished
                yield out
        finally:
            if finished:
                self._streams.pop(rid, None)
            else:
                self._forget(rid)

    def _forget(self, rid: str) -> None:
        """A stream left early: its request is aborted (once, whoever gets here first)."""
        if self._streams.pop(rid, None) is not None:
            self._inbox.put(("abort", rid))

    def end_all(self, error: str) -> list[str]:
        """Ends every open stream now (on the loop's thread): a last output with `error` and finish reason
        "abort", and its request aborted. Shutdown's deadline: clients learn why their stream stopped.
        Calls still waiting for the engine thread (or running on it) raise EngineClosedError. Returns the
        ended streams' request ids."""
        ended = list(self._streams.items())
        for rid, stream in ended:
            stream.put_nowait(RequestOutput(rid, [], "", 0, 0, finish_reason="abort", error=error))
            self._forget(rid)
        for future, waiter in list(self._calls.items()):
            future.cancel()  # only one the engine thread has not started: it skips it
            if not waiter.done():
                waiter.set_exception(EngineClosedError(error))
        return [rid for rid, _ in ended]

    async def call(self, fn: Callable[[Core], object]) -> object:
        """Runs `fn(core)` on the engine thread between two steps (state the engine owns, e.g. the
        prefix cache, is only touched there) and returns its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        # Our own loop future, not asyncio.wrap_future's: end_all() can settle it while the engine thread
        # is stuck, and a result arriving after that is dropped instead of raising in the loop.
        waiter = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: waiter.get_loop().call_soon_threadsafe(_settle, waiter, f))
        self._calls[future] = waiter
        self._inbox.put(("call", (fn, future)))
        try:
            return await waiter
        finally:
            self._calls.pop(future, None)
            future.cancel()  # a caller gone first: the engine thread skips it if it has not started it

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    # -- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            try:
                if self._warm_steps is not None:  # its thread's streams too, however the loop ended
                    self._warm_steps.close()
            finally:
                _drop_thread_streams()

    def _serve(self) -> None:
        import mlx.core as mx  # lazy: mlx only when used

        # The engine thread's own default stream, not `mx.new_stream`: on MLX's CUDA backend a new
        # stream made every new prompt length stall for tens of seconds, the default one did not
        # (docs/BENCHMARKS.md). The thread is the only one issuing MLX work, so it owns this stream all the same.
        stream = mx.default_stream(mx.default_device())
        with mx.stream(stream):
            try:
                built = self._assemble()
            except BaseException as exc:  # reported to start()
                self._startup_error = exc
                self._ready.set()
                return
            core = built.core
            self._warming = built.warmup is not None  # before start() returns: a reader then sees it
            self._publish(core)
            self._ready.set()
            # Idle, the loop still wakes now and then: desktop mode re-reads free memory in on_idle(), and
            # the status snapshot's memory readings are renewed.
            idle_timeout = min(built.memory_refresh_s or _IDLE_WAKE_S, _IDLE_WAKE_S)
            trace = _StepTrace.open(os.environ.get(STEP_TRACE_ENV))
            # Warm-up while serving (engine/warmup.py): its steps run while no request is in the engine.
            warm = built.warmup
            warm_steps = _WarmupSteps(warmup_isolation()) if warm is not None else None
            self._warm_steps = warm_steps
            while True:
                timeout = idle_timeout
                if warm is not None:
                    self._busy_since = time.perf_counter()  # a warm-up forward is a step too (a compile)
                    wait = warm.between_steps(core)
                    self._busy_since = None
                    timeout = min(wait, idle_timeout or wait) if wait else idle_timeout
                    if warm.finished:
                        warm = None
                        self._warming = False
                        warm_steps.close()
                block = not core.has_work
                if block:
                    core.on_idle()
                    self._publish(core)
                waited = time.perf_counter()
                try:
                    while True:
                        cmd, arg = self._inbox.get(block=block, timeout=timeout if block else None)
                        block = False
                        if cmd == "stop":
                            self._warming = False
                            if warm is not None:
                                warm.close()  # its thread's streams: _run closes warm_steps however the loop ends
                            core.close()
                            trace.close()
                            return
                        if cmd == "add":
                            if warm is not None:
                                warm.interrupt(core)  # no real step carries warm-up rows
                            self._add(core, arg)
                        elif cmd == "call":
                            self._call(core, *arg)
                        else:
                            core.abort(arg)
                except queue.Empty:
                    pass
                started = self._busy_since = time.perf_counter()
                outputs = warm_steps.step(core) if warm is not None and warm.owns_step else core.step()
                self._busy_since = None
                elapsed = time.perf_counter() - started
                self.stats = stats = core.stats()
                if elapsed > _SLOW_STEP_S:
                    log.warning("slow engine step: %.2f s with %d running, %d waiting (%s)", elapsed,
                                stats.num_running, stats.num_waiting,
                                stats.last_step.describe() if stats.last_step is not None else "nothing")
                trace.write(stats, waited, started, elapsed, len(outputs))
                # Before the outputs leave: a client that saw its request end reads a status that shows it.
                if any(out.finished for out in outputs) or started - self._snapshot_at >= _SNAPSHOT_EVERY_S:
                    self._publish(core)
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _publish(self, core: Core) -> None:
        """Builds the status snapshot and the stats (engine thread) and swaps them in: a reference write each."""
        self._snapshot_at = time.perf_counter()
        try:
            self.stats = core.stats()
            self.snapshot = take_snapshot(core)
        except Exception:  # the status is not worth an engine: the last good snapshot stays
            if not self._snapshot_failed:
                log.exception("building the status snapshot failed")
            self._snapshot_failed = True

    def _call(self, core: Core, fn, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():  # its caller left, or the shutdown deadline passed
            return
        self._busy_since = time.perf_counter()
        try:
            result = fn(core)
        except Exception as exc:
            self._busy_since = None
            self._publish(core)
            future.set_exception(exc)
        else:
            self._busy_since = None
            self._publish(core)  # before the caller resumes: a read after a change (DELETE /v1/cache) sees it
            future.set_result(result)

    def _add(self, core: Core, request: Request) -> None:
        try:
            core.add(request)
        except Exception as exc:
            out = RequestOutput(request.request_id, [], "", request.num_prompt_tokens, 0, error=str(exc))
            self._loop.call_soon_threadsafe(self._dispatch, [out])


def _settle(waiter: asyncio.Future, future: concurrent.futures.Future) -> None:
    """On the loop: a call's result to its caller, unless the caller left or end_all() answered first."""
    if waiter.done() or future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(future.result())


class _OutputStream:
    """One request's outputs. Leaving it early aborts the request, and so does never iterating it at
    all: a client gone before the response started leaves an async generator whose `finally` never
    runs, so without the finalizer here its request ran to max_tokens and its stream stayed counted
    (the model looked busy for good and could never be unloaded)."""

    def __init__(self, engine: AsyncEngine, rid: str, stream: asyncio.Queue) -> None:
        self._outputs = engine._iterate(rid, stream)
        weakref.finalize(self, engine._forget, rid)

    def __aiter__(self) -> "_OutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._outputs.__anext__()

    async def aclose(self) -> None:
        await self._outputs.aclose()


# The StepInfo fields the trace writes after decode_ms, in ms, each in a column named `<name>_ms`.
_HOST_FIELDS = ("schedule_s", "sample_s", "launch_s", "readback_s", "detok_s", "update_s", "output_s")


class _StepTrace:
    """`MLXHOST_STEP_TRACE=FILE`: one tab-separated line per engine step, for finding where time goes
    under load: start (s), inbox ms (adding requests before the step), step ms, runner ms, prefill ms of
    it, prefill chunks, prefill tokens, decoding rows, batch rows, outputs, running, waiting, then the runner's
    block stores, joining the prefilled rows to the batch, and the decode (its graph and the wait for the
    previous step's tokens), ms; then the host's other phases (engine/contract.py StepInfo), ms: the core's
    schedule, the decode's sampling, launch and read-back, the core's detokenizing, update and outputs.
    Times are the host's: a prefill's device work shows in whichever column first waits for it (a lone
    prompt's in join or decode, a batched prefill's in decode), unless MLXHOST_STEP_SYNC=1 makes the runner
    wait for the device after each phase (diagnosis only: the host no longer runs ahead of the device).
    Off by default; a step costs one formatted line when on."""

    def __init__(self, f=None) -> None:
        self._f = f
        self._t0 = time.perf_counter()
        self._last = None  # the step last written: a step that scheduled nothing leaves it in place

    @classmethod
    def open(cls, path: str | None) -> "_StepTrace":
        if not path:
            return cls()
        f = open(path, "a", buffering=1)  # line by line: a crashed engine thread loses nothing
        f.write("t_s\tinbox_ms\tstep_ms\trunner_ms\tprefill_ms\tchunks\tprefill_tokens\tdecoding\trows\t"
                "outputs\trunning\twaiting\tstore_ms\tjoin_ms\tdecode_ms\t"
                + "\t".join(f[:-2] + "_ms" for f in _HOST_FIELDS) + "\n")
        return cls(f)

    def write(self, stats: CoreStats, waited: float, started: float, elapsed: float, num_outputs: int) -> None:
        if self._f is None:
            return
        step: StepInfo | None = stats.last_step
        if step is None or step is self._last:
            return
        self._last = step
        # Microseconds (.3f ms): a tiny model's whole decode step on a CPU is about a millisecond.
        self._f.write(f"{started - self._t0:.4f}\t{(started - waited) * 1e3:.3f}\t{elapsed * 1e3:.3f}\t"
                      f"{step.execute_s * 1e3:.3f}\t{step.prefill_s * 1e3:.3f}\t"
                      f"{len(step.prefill_chunk_tokens)}\t{sum(step.prefill_chunk_tokens)}\t"
                      f"{step.num_decoding}\t{step.num_rows}\t{num_outputs}\t"
                      f"{stats.num_running}\t{stats.num_waiting}\t"
                      f"{step.store_s * 1e3:.3f}\t{step.join_s * 1e3:.3f}\t{step.decode_s * 1e3:.3f}\t"
                      + "\t".join(f"{getattr(step, f) * 1e3:.3f}" for f in _HOST_FIELDS) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
