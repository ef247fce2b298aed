"""The batch runner over a store in a temporary folder and a fake dispatch: validation, resuming after a restart
without running answered lines again, busy answers retried, cancel and expiry, and the result files' shapes."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from mlxhost.batch.runner import BatchRunner
from mlxhost.batch.store import BatchStore, FolderInUseError

URL = "/v1/chat/completions"
_BOUND_S = 30  # a hang bound, not a timing check


def input_file(n: int, url: str = URL) -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url,
                               "body": {"model": "m", "messages": [{"role": "user", "content": str(i)}]}}) + "\n"
                   for i in range(n)).encode()


def new_batch(store: BatchStore, data: bytes, expires_in: int = 3600, owner: str | None = None) -> str:
    file_id = store.add_file(data, "in.jsonl", "batch", owner=owner)["id"]
    now = int(time.time())
    batch_id = f"batch_{file_id}"
    store.add_batch({"id": batch_id, "object": "batch", "endpoint": URL, "errors": None, "input_file_id": file_id,
                     "completion_window": "24h", "status": "validating", "output_file_id": None,
                     "error_file_id": None, "created_at": now, "expires_at": now + expires_in,
                     "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": None}, owner)
    return batch_id


class Answers:
    """Answers each line with its content echoed; line "3" once with a busy 429, line "4" with a 400."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.owners: set[str | None] = set()
        self.busy_once = True
        self.release: asyncio.Event | None = None  # set: lines wait for it

    async def __call__(self, url: str, body: dict, owner: str | None) -> tuple[int, dict]:
        content = body["messages"][0]["content"]
        self.calls.append(content)
        self.owners.add(owner)
        if self.release is not None:
            await self.release.wait()
        if content == "3" and self.busy_once:
            self.busy_once = False
            return 429, {"error": {"message": "busy", "code": "server_busy"}}
        if content == "4":
            return 400, {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}
        return 200, {"id": f"chatcmpl-{content}", "object": "chat.completion", "text": content}


async def run_until(store: BatchStore, runner: BatchRunner, batch_id: str, statuses: set[str]) -> dict:
    runner.start()
    try:
        deadline = time.monotonic() + _BOUND_S
        while store.batch(batch_id)["status"] not in statuses:
            assert time.monotonic() < deadline, store.batch(batch_id)
            await asyncio.sleep(0.01)
        return store.batch(batch_id)
    finally:
        await runner.stop()


def read_lines(store: BatchStore, file_id: str) -> list[dict]:
    return [json.loads(line) for line in store.read_file(file_id).decode().splitlines()]


def test_a_batch_runs_to_completed_with_output_and_error_files(tmp_path):
    async def main():
        store = BatchStore(tmp_path)
        answers = Answers()
        batch_id = new_batch(store, input_file(6))
        batch = await run_until(store, BatchRunner(store, answers, max_num_running=2), batch_id, {"completed"})
        assert batch["request_counts"] == {"total": 6, "completed": 5, "failed": 1}
        assert all(batch[k] for k in ("in_progress_at", "finalizing_at", "completed_at"))
        out = read_lines(store, batch["output_file_id"])
        assert [o["custom_id"] for o in out] == ["r0", "r1", "r2", "r3", "r5"]
        first = out[0]
        assert set(first) == {"id", "custom_id", "response", "error"} and first["error"] is None
        assert first["response"]["status_code"] == 200 and first["response"]["body"]["text"] == "0"
        assert first["response"]["request_id"]
        (err,) = read_lines(store, batch["error_file_id"])
        assert err["custom_id"] == "r4" and err["response"]["status_code"] == 400
        assert sorted(answers.calls) == sorted(["0", "1", "2", "3", "3", "4", "5"])  # the busy one asked again
        assert store.file(batch["output_file_id"])["purpose"] == "batch_output"
        store.close()

    asyncio.run(main())


def test_the_input_is_read_and_the_result_files_written_off_the_event_loop(tmp_path, monkeypatch):
    """A file of thousands of lines read, or a result file fsynced, on the loop would hold every stream meanwhile."""
    threads: dict[str, set[str]] = {"read": set(), "write": set()}
    real_read, real_write = BatchStore.read_file, BatchStore.write_bytes

    def read_file(self, file_id):
        threads["read"].add(threading.current_thread().name)
        return real_read(self, file_id)

    def write_bytes(self, data, file_id=None):
        threads["write"].add(threading.current_thread().name)
        return real_write(self, data, file_id)

    async def main():
        store = BatchStore(tmp_path)
        batch_id = new_batch(store, input_file(3))  # written by the test, before the patch
        monkeypatch.setattr(BatchStore, "read_file", read_file)
        monkeypatch.setattr(BatchStore, "write_bytes", write_bytes)
        batch = await run_until(store, BatchRunner(store, Answers()), batch_id, {"completed"})
        assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        store.close()

    asyncio.run(main())
    loop_thread = threading.current_thread().name  # asyncio.run runs the loop on this thread
    assert threads["read"] and loop_thread not in threads["read"]
    assert threads["write"] and loop_thread not in threads["write"]


def test_a_batch_cancelled_while_its_input_is_read_stays_cancelled(tmp_path, monkeypatch):
    """The runner reads the input on a worker thread: a cancel that lands meanwhile ends the batch, and the runner,
    back from the read, neither validates it again nor runs a line of it."""
    reading, release = threading.Event(), threading.Event()
    real_read = BatchStore.read_file

    def slow_read(self, file_id):
        reading.set()
        assert release.wait(60)  # a hang bound, not a timing check
        return real_read(self, file_id)

    async def main():
        store = BatchStore(tmp_path)
        batch_id = new_batch(store, input_file(3))
        monkeypatch.setattr(BatchStore, "read_file", slow_read)
        answers = Answers()
        runner = BatchRunner(store, answers)
        runner.start()
        try:
            while not reading.is_set():
                await asyncio.sleep(0.01)
            assert (await runner.cancel(store.batch(batch_id)))["status"] == "cancelled"
            release.set()
            for _ in range(50):  # the runner's next turns over the batch
                await asyncio.sleep(0.01)
        finally:
            release.set()
            await runner.stop()
        assert store.batch(batch_id)["status"] == "cancelled" and answers.calls == []
        store.close()

    asyncio.run(main())


def test_lines_run_for_the_batchs_owner_and_its_result_files_are_the_owners(tmp_path):
    async def main():
        store = BatchStore(tmp_path)
        answers = Answers()
        batch_id = new_batch(store, input_file(5), owner="alice")
        batch = await run_until(store, BatchRunner(store, answers), batch_id, {"completed"})
        assert answers.owners == {"alice"}
        for file_id in (batch["input_file_id"], batch["output_file_id"], batch["error_file_id"]):
            assert store.file(file_id, "alice") is not None and store.file(file_id, "bob") is None
        assert store.batch(batch_id, "bob") is None and store.batch(batch_id, "alice")["id"] == batch_id
        assert store.list_batches(None, 10, "bob").items == []
        assert store.list_files(None, None, 10, True, "bob").items == []
        assert [b["id"] for b in store.list_batches(None, 10, "alice").items] == [batch_id]
        assert len(store.list_files(None, None, 10, True, "alice").items) == 3
        assert store.list_files(None, batch["input_file_id"], 10, True, "bob").items == []  # no cursor into another's
        store.close()

    asyncio.run(main())


def test_a_restart_runs_only_the_lines_not_answered(tmp_path):
    async def main():
        store = BatchStore(tmp_path)
        batch_id = new_batch(store, input_file(10))
        answers = Answers()
        answers.release = asyncio.Event()
        runner = BatchRunner(store, answers, max_num_running=3)
        runner.start()
        deadline = time.monotonic() + _BOUND_S
        while len(answers.calls) < 3:  # three lines in flight, none answered
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await runner.stop()  # the server stops: those three are dropped unanswered
        assert store.batch(batch_id)["request_counts"]["completed"] == 0
        # Two lines answered before the "crash" are on disk; the store is reopened as a new server would.
        from mlxhost.batch.lines import answer_line

        store.add_result(batch_id, 0, True, answer_line("r0", 200, {"text": "0"}))
        store.add_result(batch_id, 7, True, answer_line("r7", 200, {"text": "7"}))
        store.close()
        store = BatchStore(tmp_path)
        again = Answers()
        batch = await run_until(store, BatchRunner(store, again), batch_id, {"completed"})
        assert sorted(again.calls, key=int) == ["1", "2", "3", "3", "4", "5", "6", "8", "9"]
        assert batch["request_counts"] == {"total": 10, "completed": 9, "failed": 1}
        assert [o["custom_id"] for o in read_lines(store, batch["output_file_id"])] == [
            f"r{i}" for i in range(10) if i != 4]
        store.close()

    asyncio.run(main())


def test_cancel_ends_a_running_batch_after_its_lines_in_flight(tmp_path):
    async def main():
        store = BatchStore(tmp_path)
        batch_id = new_batch(store, input_file(20))
        queued_id = new_batch(store, input_file(5))
        answers = Answers()
        answers.release = asyncio.Event()
        runner = BatchRunner(store, answers, max_num_running=2)
        runner.start()
        deadline = time.monotonic() + _BOUND_S
        while len(answers.calls) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert (await runner.cancel(store.batch(queued_id)))["status"] == "cancelled"  # not running: at once
        assert (await runner.cancel(store.batch(batch_id)))["status"] == "cancelling"
        answers.release.set()
        batch = await run_until(store, runner, batch_id, {"cancelled"})
        assert batch["cancelling_at"] and batch["cancelled_at"]
        assert batch["request_counts"]["completed"] == 2 == len(answers.calls)
        assert len(read_lines(store, batch["output_file_id"])) == 2
        store.close()

    asyncio.run(main())


def test_bad_input_fails_validation_with_line_numbers(tmp_path):
    async def main():
        store = BatchStore(tmp_path)
        data = input_file(2) + b"not json\n" + input_file(1, url="/v1/embeddings")
        batch_id = new_batch(store, data)
        batch = await run_until(store, BatchRunner(store, Answers()), batch_id, {"failed"})
        errors = batch["errors"]["data"]
        assert [(e["code"], e["line"]) for e in errors] == [("invalid_json_line", 3), ("duplicate_custom_id", 4),
                                                            ("invalid_url", 4)]
        assert batch["failed_at"]
        store.close()

    asyncio.run(main())


def test_an_expired_batch_writes_the_rest_as_expired(tmp_path):
    async def main():
        store = BatchStore(tmp_path)
        batch_id = new_batch(store, input_file(3), expires_in=-1)
        batch = await run_until(store, BatchRunner(store, Answers()), batch_id, {"expired"})
        errors = read_lines(store, batch["error_file_id"])
        assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 3 and errors[0]["response"] is None
        assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
        store.close()

    asyncio.run(main())


def test_one_server_per_folder(tmp_path):
    store = BatchStore(tmp_path)
    with pytest.raises(FolderInUseError):
        BatchStore(tmp_path)
    store.close()
    BatchStore(tmp_path).close()


def test_a_failed_file_write_leaves_no_partial_file(tmp_path, monkeypatch):
    """The bytes go to a temp file renamed into place: a write that fails (a full disk) leaves neither the file
    nor its temp behind, and bytes no row will list (an upload whose client left) can be discarded."""
    import os

    store = BatchStore(tmp_path)
    try:
        def no_space(*_args):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "replace", no_space)
        with pytest.raises(OSError):
            store.write_bytes(b'{"a": 1}\n', "file-x")
        monkeypatch.undo()
        assert not store.file_path("file-x").exists() and not list(store.file_path("file-x").parent.glob("*.tmp"))
        store.write_bytes(b'{"a": 1}\n', "file-y")
        store.discard_bytes("file-y")
        assert not store.file_path("file-y").exists()
    finally:
        store.close()
