"""Runs the stored batches, oldest first, a few lines at a time: validating → in_progress → finalizing →
completed (or cancelling → cancelled, failed, expired). Each line goes through `dispatch(url, body, owner)`, the
server's own route for that endpoint under the batch creator's API key; only its answer is stored (one commit per
line), so a restart runs what is left."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mlxhost.batch.lines import InputError, Line, answer_line, expired_line, parse_lines
from mlxhost.batch.store import BatchStore

log = logging.getLogger(__name__)

# (status code, JSON body) of one request run in-process for the batch's owner (its creator's key name, or None).
Dispatch = Callable[[str, dict, str | None], Awaitable[tuple[int, dict]]]

_IDLE_WAKE_S = 5.0  # idle, look again this often (expiry)
_RETRY_S = 0.5  # a busy server (429 server_busy, 503) is asked again after this long
_MAX_UNAVAILABLE = 20  # a line answered 503 this many times in a row is stored as failed


@dataclass
class BatchProgress:
    """What /v1/status shows while a batch runs."""

    batch_id: str | None = None
    num_lines_run: int = 0  # lines this process ran (a restarted server does not count earlier ones)


def _file_id(batch_id: str, kind: str) -> str:
    """The result files' ids follow from the batch's, so a finalize repeated after a crash rewrites the same file."""
    return f"file-{hashlib.sha256(f'{batch_id}:{kind}'.encode()).hexdigest()[:24]}"


class BatchRunner:
    def __init__(self, store: BatchStore, dispatch: Dispatch, max_num_running: int = 4) -> None:
        self.store, self.dispatch = store, dispatch
        self.max_num_running = max_num_running
        self.progress = BatchProgress()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._running_id: str | None = None  # the batch whose lines are running now
        self._finalizing: set[str] = set()  # batches whose files are being written (cancel and the loop may meet)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batch-runner")

    async def stop(self) -> None:
        """Lines in flight are dropped unanswered (their engine requests abort); a restart runs them again."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def wake(self) -> None:
        self._wake.set()

    def status(self) -> dict:
        """/v1/status's `batches`: how many wait or run, and the running one's counts."""
        active = self.store.active_batch_ids()
        running = self.store.batch(self._running_id) if self._running_id is not None else None
        return {"num_active": len(active),
                "running": None if running is None else {"id": running["id"], "endpoint": running["endpoint"],
                                                          **running["request_counts"]},
                "num_lines_run": self.progress.num_lines_run}

    async def cancel(self, batch: dict) -> dict:
        """cancelling; a batch whose lines are not running ends cancelled at once, the running one once its lines
        in flight are answered (as OpenAI's: those may still complete)."""
        self._set(batch, "cancelling", "cancelling_at")
        if batch["id"] != self._running_id:
            await self._finalize(self.store.batch(batch["id"]))
        self.wake()
        return self.store.batch(batch["id"])

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            for batch_id in self.store.active_batch_ids():
                try:
                    await self._advance(batch_id)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug must not stop every later batch; this one is retried at the next wake
                    log.exception("batch %s failed to advance", batch_id)
            try:
                await asyncio.wait_for(self._wake.wait(), _IDLE_WAKE_S)
            except asyncio.TimeoutError:
                pass

    async def _advance(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        if batch["status"] in ("validating", "in_progress"):
            lines = await self._read_lines(batch)
            batch = self.store.batch(batch_id)  # a cancel may have come while the file was read
            if batch["status"] == "validating" or (batch["status"] == "in_progress" and isinstance(lines, Exception)):
                # The input file deleted (or damaged) since validation: the batch fails, once.
                batch = self._validate(batch, lines)
            if batch["status"] == "in_progress" and not isinstance(lines, Exception):
                batch = await self._run_lines(batch, lines)
        if batch["status"] in ("finalizing", "cancelling"):
            await self._finalize(batch)

    async def _read_lines(self, batch: dict) -> list[Line] | InputError | OSError:
        """The input file's lines, read and parsed on a worker thread (a file of thousands of lines would hold the
        event loop, and every stream on it, for the read); the reason instead where it cannot be read."""
        def read() -> list[Line]:
            return parse_lines(self.store.read_file(batch["input_file_id"]), batch["endpoint"])

        try:
            return await asyncio.to_thread(read)
        except (InputError, OSError) as exc:
            return exc

    def _validate(self, batch: dict, lines: list[Line] | InputError | OSError) -> dict:
        if isinstance(lines, Exception):
            errors = lines.errors if isinstance(lines, InputError) else [
                {"code": "file_not_found", "message": f"the input file cannot be read: {lines}", "param": None,
                 "line": None}]
            return self._set(batch, "failed", "failed_at", errors={"object": "list", "data": errors})
        batch["request_counts"]["total"] = len(lines)
        return self._set(batch, "in_progress", "in_progress_at")

    async def _run_lines(self, batch: dict, lines: list[Line]) -> dict:
        batch_id = batch["id"]
        answered = self.store.answered(batch_id)
        if answered:
            log.info("batch %s resumes: %d of %d lines answered before", batch_id, len(answered), len(lines))
        self.progress = BatchProgress(batch_id)
        self._running_id = batch_id
        slots = asyncio.Semaphore(self.max_num_running)
        running: set[asyncio.Task] = set()
        try:
            for idx, line in enumerate(lines):
                if idx in answered:
                    continue
                await slots.acquire()
                status = self.store.batch(batch_id)["status"]
                if status != "in_progress" or time.time() >= batch["expires_at"]:
                    slots.release()
                    break
                task = asyncio.ensure_future(self._run_line(batch, batch_id, idx, line))
                running.add(task)
                task.add_done_callback(lambda t: (running.discard(t), slots.release()))
            if running:
                await asyncio.gather(*running)
        finally:
            for task in running:  # a stopping server: the lines in flight stay unanswered
                task.cancel()
            self._running_id = None
        batch = self.store.batch(batch_id)
        if batch["status"] != "in_progress":  # cancelled meanwhile
            return batch
        if time.time() >= batch["expires_at"]:
            done = self.store.answered(batch_id)
            for idx, line in enumerate(lines):
                if idx not in done:
                    self.store.add_result(batch_id, idx, False, expired_line(line.custom_id))
            await self._finalize(batch, final="expired", stamp="expired_at")
            return self.store.batch(batch_id)
        return self._set(batch, "finalizing", "finalizing_at")

    async def _run_line(self, batch: dict, batch_id: str, idx: int, line: Line) -> None:
        unavailable, owner = 0, self.store.batch_owner(batch_id)
        while True:
            status, body = await self.dispatch(batch["endpoint"], line.body, owner)
            code = (body.get("error") or {}).get("code") if isinstance(body.get("error"), dict) else None
            # Busy or stopping is not the request's answer: ask again (a restart would too).
            if status == 429 and code == "server_busy" or status == 503 and unavailable < _MAX_UNAVAILABLE:
                unavailable += status == 503
                await asyncio.sleep(_RETRY_S)
                continue
            break
        self.store.add_result(batch_id, idx, 200 <= status < 300, answer_line(line.custom_id, status, body))
        self.progress.num_lines_run += 1

    async def _finalize(self, batch: dict, final: str | None = None, stamp: str | None = None) -> None:
        """Writes the output and error files (input order) and ends the batch: completed, cancelled or `final`.
        The bytes are written and fsynced on a worker thread; the rows, on the loop (the store's one owner)."""
        if batch["id"] in self._finalizing:  # the other caller (cancel, or the loop) writes the files and ends it
            return
        self._finalizing.add(batch["id"])
        try:
            await self._write_results(batch, final, stamp)
        finally:
            self._finalizing.discard(batch["id"])

    async def _write_results(self, batch: dict, final: str | None, stamp: str | None) -> None:
        if final is None:
            final, stamp = ("cancelled", "cancelled_at") if batch["status"] == "cancelling" else ("completed",
                                                                                                  "completed_at")
        for ok, kind, key in ((True, "output", "output_file_id"), (False, "error", "error_file_id")):
            results = self.store.results(batch["id"], ok)
            if results:
                data = ("\n".join(results) + "\n").encode()
                file_id = await asyncio.to_thread(self.store.write_bytes, data, _file_id(batch["id"], kind))
                self.store.record_file(file_id, len(data), f"batch_{batch['id']}_{kind}.jsonl", "batch_output",
                                       self.store.batch_owner(batch["id"]))
                batch[key] = _file_id(batch["id"], kind)
        self._set(batch, final, stamp)
        log.info("batch %s %s: %s", batch["id"], final, self.store.batch(batch["id"])["request_counts"])

    def _set(self, batch: dict, status: str, stamp: str, **fields) -> dict:
        batch.update(fields, status=status)
        batch[stamp] = batch.get(stamp) or int(time.time())
        self.store.put_batch(batch)
        return self.store.batch(batch["id"])
