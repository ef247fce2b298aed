"""AsyncEngine with a fake core: no model, just the queue plumbing between asyncio and the engine thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import time

from mlxhost.engine.contract import Core, CoreStats, StepInfo
from mlxhost.engine.loop import Assembled, AsyncEngine, EngineClosedError
from mlxhost.engine.request import Request, RequestOutput, SamplingParams


class _Core:
    """Emits one token per step for every request it holds, forever, until aborted."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.aborted: list[str] = []
        self.kv_capacity_tokens = 1000
        self.last_step: StepInfo | None = None
        self.lock = threading.Lock()

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request

    def stats(self) -> CoreStats:
        return CoreStats(kv_capacity_tokens=self.kv_capacity_tokens, last_step=self.last_step)

    def adapters(self) -> dict:
        return {}

    def clear_cache(self) -> int:
        return 0

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.aborted.append(request_id)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.001)
        self.kv_capacity_tokens = 500  # as if memory pressure lowered it
        return [RequestOutput(rid, [1], "x", 1, 1) for rid in self.requests]

    def on_idle(self) -> None:
        pass

    def close(self) -> None:
        pass

    def status(self) -> dict:
        return {"num_running": len(self.requests), "prefix_cache": {"enabled": False}}


def _engine(core: _Core) -> AsyncEngine:
    assert isinstance(core, Core)
    return AsyncEngine(lambda: Assembled(core, memory_refresh_s=0.05), max_num_waiting=10)


def _request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=10**6))


def test_a_stream_never_iterated_aborts_its_request_and_is_forgotten():
    core = _Core()
    engine = _engine(core)

    async def main():
        engine.start(asyncio.get_running_loop())
        outputs = engine.generate(_request("gone"))  # e.g. the client left before the response started
        assert engine.num_active == 1
        del outputs
        gc.collect()
        for _ in range(200):
            if "gone" in core.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.num_active == 0

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert core.aborted == ["gone"]


def test_a_stream_left_early_aborts_once_and_a_finished_one_not_at_all():
    core = _Core()
    engine = _engine(core)

    async def main():
        engine.start(asyncio.get_running_loop())
        outputs = engine.generate(_request("early"))
        async for _ in outputs:
            break
        await outputs.aclose()
        del outputs
        gc.collect()
        for _ in range(200):
            if core.aborted:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert engine.num_active == 0
        # The live KV capacity follows the core's (lowered under pressure), not the start-up one.
        assert engine.kv_capacity_tokens == 500

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert core.aborted == ["early"]


def test_step_trace_writes_a_line_per_step(tmp_path, monkeypatch):
    trace = tmp_path / "steps.tsv"
    monkeypatch.setenv("MLXHOST_STEP_TRACE", str(trace))
    class _Traced(_Core):
        def step(self):
            self.last_step = StepInfo((7, 7), num_decoding=1, num_rows=3, execute_s=0.002, prefill_s=0.001)
            return super().step()

    core = _Traced()
    engine = _engine(core)

    async def main():
        engine.start(asyncio.get_running_loop())
        outputs = engine.generate(_request("r"))
        n = 0
        async for _ in outputs:
            n += 1
            if n == 5:
                break
        engine.stop()  # while the loop still runs: the fake core's outputs never end

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    header, *lines = trace.read_text().splitlines()
    assert header.split("\t")[:3] == ["t_s", "inbox_ms", "step_ms"]
    assert len(lines) >= 5
    fields = lines[0].split("\t")
    assert len(fields) == len(header.split("\t"))
    assert fields[5:10] == ["2", "14", "1", "3", "1"]  # chunks, prefill tokens, decoding, rows, outputs


def _held(engine: AsyncEngine) -> threading.Event:
    """Holds the engine thread inside a call (as a long step would) until the returned event is set."""
    inside, release = threading.Event(), threading.Event()

    def hold(core) -> None:
        inside.set()
        release.wait(60)

    engine._inbox.put(("call", (hold, concurrent.futures.Future())))
    assert inside.wait(60)
    return release


def test_reads_come_from_the_snapshot_while_the_engine_thread_is_busy():
    core = _Core()
    engine = _engine(core)

    async def main():
        engine.start(asyncio.get_running_loop())
        assert engine.snapshot.status == {"num_running": 0, "prefix_cache": {"enabled": False}}
        release = _held(engine)
        try:
            assert engine.busy_s is not None
            assert engine.snapshot.cache_stats == {"enabled": False}  # no wait for the engine thread
            waiting = asyncio.ensure_future(engine.call(lambda core: 1))
            await asyncio.sleep(0.05)
            assert not waiting.done()  # a call does wait: only the snapshot is free
        finally:
            release.set()
        assert await waiting == 1

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_the_shutdown_deadline_answers_calls_and_gives_up_on_a_busy_engine():
    core = _Core()
    engine = _engine(core)
    release = None

    async def main():
        nonlocal release
        engine.start(asyncio.get_running_loop())
        release = _held(engine)
        waiting = asyncio.ensure_future(engine.call(lambda core: 1))
        await asyncio.sleep(0)
        assert engine.end_all("shutting down") == []
        try:
            await waiting
        except EngineClosedError as exc:
            assert str(exc) == "shutting down"
        else:
            raise AssertionError("the call was not answered at the deadline")
        assert engine.stop(lambda: 0.0) is False  # the deadline is long past and the engine is still busy

    try:
        asyncio.run(main())
    finally:
        release.set()
        assert engine.stop() is True  # once the call ends, the thread stops (the skipped call never runs)
