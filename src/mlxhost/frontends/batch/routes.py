"""OpenAI's Files (`/v1/files`) and Batch (`/v1/batches`) APIs over the batch folder (batch/store.py), run by
the batch runner (batch/runner.py) through the server's own routes (dispatch.py). Imports no MLX.

With API keys, each file and batch belongs to the key (by name) that created it: another key's are 404s and left
out of lists, as if they did not exist."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import UploadFile

from mlxhost.batch.lines import ENDPOINTS
from mlxhost.batch.runner import BatchRunner
from mlxhost.batch.store import BatchStore, FolderInUseError, new_id
from mlxhost.frontends.batch.dispatch import RouteDispatch
from mlxhost.frontends.common.errors import APIError, clip

log = logging.getLogger(__name__)

_PURPOSES = ("batch", "batch_output", "assistants", "fine-tune", "vision", "user_data", "evals")
_WINDOWS = {"24h": 24 * 3600}
_MAX_LIST = 10_000


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="allow")  # output_expires_after and other fields OpenAI may add: ignored

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def _limit(limit: int, most: int) -> int:
    if not 1 <= limit <= most:
        raise APIError(400, f"limit must be in 1..{most}", "limit")
    return limit


def _page(page) -> dict:
    items = page.items
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": page.has_more}


def _owner(raw: Request) -> str | None:
    """The caller's key name; None on a server without keys (the gate puts the matched policy on the state)."""
    policy = getattr(raw.state, "api_key", None)
    return policy.name if policy is not None else None


def install_batch_api(app: FastAPI, folder: str | Path, max_num_running: int = 4) -> None:
    """The routes over `folder`; the runner starts and stops with the app's lifespan. A folder another server
    holds leaves the routes answering 503 (both would run the same batches)."""
    why = "another server uses the batch folder"
    try:
        store = BatchStore(folder)
    except FolderInUseError as exc:
        log.warning("Batch API off: %s (start this server with its own --batch-dir)", exc)
        store = None
    except (OSError, sqlite3.Error) as exc:  # a full or read-only disk costs the Batch API, not the server
        log.warning("Batch API off: its folder %s cannot be used: %s", folder, exc)
        store, why = None, "its folder cannot be used"
    runner = BatchRunner(store, RouteDispatch(app), max_num_running) if store is not None else None
    app.state.batch_runner = runner
    _add_lifespan(app, runner, store)

    def need_store() -> BatchStore:
        if store is None:
            raise APIError(503, f"the Batch API is off: {why} ({folder})",
                           code="batch_folder_in_use" if why.startswith("another") else "batch_folder_unusable")
        return store

    def file_or_404(file_id: str, owner: str | None) -> dict:
        obj = need_store().file(file_id, owner)
        if obj is None:
            raise APIError(404, f"No such File object: {clip(file_id)}", "id", "file_not_found")
        return obj

    def batch_or_404(batch_id: str, owner: str | None) -> dict:
        obj = need_store().batch(batch_id, owner)
        if obj is None:
            raise APIError(404, f"No batch found with id '{clip(batch_id)}'.", "batch_id", "batch_not_found")
        return obj

    @app.post("/v1/files")
    async def upload_file(raw: Request):
        s = need_store()
        if not raw.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError(400, "send the file as multipart/form-data with `file` and `purpose` fields", "file")
        try:
            form = await raw.form(max_files=1, max_fields=8)
        except Exception as exc:  # a malformed multipart body
            raise APIError(400, f"the multipart body cannot be read: {exc}", "file") from None
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose not in _PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(_PURPOSES)}", "purpose")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "`file` is required", "file")
        data = await upload.read()
        # The write and its fsync on a worker thread (a big file would stall every stream); the row, like every
        # database call, stays on the loop's thread.
        file_id = new_id("file-")
        write = asyncio.ensure_future(asyncio.to_thread(s.write_bytes, data, file_id))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:  # the client left: the thread still writes, then its file goes
            write.add_done_callback(lambda _: s.discard_bytes(file_id))
            raise
        return s.record_file(file_id, len(data), upload.filename or "upload.jsonl", purpose, owner=_owner(raw))

    @app.get("/v1/files")
    async def list_files(raw: Request, purpose: str | None = None, after: str | None = None,
                         limit: int = _MAX_LIST, order: str = "desc"):
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be asc or desc", "order")
        return _page(need_store().list_files(purpose, after, _limit(limit, _MAX_LIST), order == "desc",
                                             _owner(raw)))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str, raw: Request):
        return file_or_404(file_id, _owner(raw))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, raw: Request):
        file_or_404(file_id, _owner(raw))
        try:  # read on a worker thread, as the upload writes
            data = await asyncio.to_thread(need_store().read_file, file_id)
        except FileNotFoundError:  # deleted while it was read
            raise APIError(404, f"No such File object: {clip(file_id)}", "id", "file_not_found") from None
        return Response(data, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, raw: Request):
        file_or_404(file_id, _owner(raw))
        need_store().delete_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(body: CreateBatch, raw: Request):
        s, owner = need_store(), _owner(raw)
        if body.endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
        window = _WINDOWS.get(body.completion_window)
        if window is None:
            raise APIError(400, "completion_window must be 24h", "completion_window")
        source = file_or_404(body.input_file_id, owner)
        if source["purpose"] != "batch":
            raise APIError(400, "the input file's purpose must be `batch`", "input_file_id")
        now = int(time.time())
        obj = {"id": new_id("batch_"), "object": "batch", "endpoint": body.endpoint, "errors": None,
               "input_file_id": body.input_file_id, "completion_window": body.completion_window,
               "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
               "in_progress_at": None, "expires_at": now + window, "finalizing_at": None, "completed_at": None,
               "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": body.metadata}
        s.add_batch(obj, owner)
        runner.wake()
        return s.batch(obj["id"])

    @app.get("/v1/batches")
    async def list_batches(raw: Request, after: str | None = None, limit: int = 20):
        return _page(need_store().list_batches(after, _limit(limit, 100), _owner(raw)))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str, raw: Request):
        return batch_or_404(batch_id, _owner(raw))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, raw: Request):
        obj = batch_or_404(batch_id, _owner(raw))
        if obj["status"] not in ("validating", "in_progress", "finalizing", "cancelling"):
            raise APIError(409, f"Cannot cancel a batch with status '{obj['status']}'.", "batch_id",
                           "batch_not_cancellable")
        return await runner.cancel(obj)


def _add_lifespan(app: FastAPI, runner: BatchRunner | None, store: BatchStore | None) -> None:
    """Runs the runner inside the app's lifespan: it starts once the models are up, and is the first of the
    services the app closes (create_app's `closers`), before the engines stop."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            if runner is not None:
                runner.start()
            yield state

    async def close() -> None:
        if runner is not None:
            await runner.stop()
            await runner.dispatch.close()
        if store is not None:
            store.close()

    app.router.lifespan_context = lifespan
    app.state.closers.insert(0, close)
