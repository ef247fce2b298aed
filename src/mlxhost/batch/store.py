"""The Batch API's state on disk: a small SQLite database (files, batches, one row per answered line) and the
files' bytes next to it, so a restarted server resumes a batch where it stopped. One server owns a folder at a
time (an exclusive lock file). Plain data in and out: the HTTP side and the runner shape the objects.

Each file and batch records its `owner`, the creator's API key name (None on a server without keys). A read given
an `owner` sees only that owner's rows (a NULL owner matches none); a read without one sees every row."""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import platformdirs

try:  # an exclusive lock on the folder; the platforms served here all have fcntl
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

# Statuses that still need the runner; the others are final.
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, purpose TEXT NOT NULL, owner TEXT,
                                  obj TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, status TEXT NOT NULL, owner TEXT,
                                    obj TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (batch_id TEXT NOT NULL, idx INTEGER NOT NULL, ok INTEGER NOT NULL,
                                    line TEXT NOT NULL, PRIMARY KEY (batch_id, idx));
"""


class FolderInUseError(Exception):
    """Another server holds the batch folder."""


@dataclass(frozen=True)
class Page:
    items: list[dict]
    has_more: bool


def default_batch_dir() -> Path:
    """Batch inputs and results are the user's data (not a cache to drop): the platform's user data folder."""
    return Path(platformdirs.user_data_dir("mlxhost")) / "batches"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class BatchStore:
    """Owns the folder: `batches.sqlite3`, `files/<id>` and the lock."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        (self.folder / "files").mkdir(parents=True, exist_ok=True)
        self._lock = open(self.folder / "lock", "a+")
        if fcntl is not None:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._lock.close()
                raise FolderInUseError(f"another server uses the batch folder {self.folder}") from None
        # The event loop's thread only; WAL: each answered line is one small commit that survives a killed process.
        try:
            self._db = sqlite3.connect(self.folder / "batches.sqlite3", isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error:
            self._lock.close()  # the folder is free again for a later start
            raise

    def close(self) -> None:
        self._db.close()
        self._lock.close()

    def _next_seq(self, table: str) -> int:
        (seq,) = self._db.execute(f"SELECT COALESCE(MAX(seq), 0) + 1 FROM {table}").fetchone()
        return seq

    # -- files -----------------------------------------------------------------------------------------
    def add_file(self, data: bytes, filename: str, purpose: str, file_id: str | None = None,
                 owner: str | None = None) -> dict:
        """Writes the bytes, then the row, both on the calling thread (where blocking is fine: a test, a tool).
        The upload route and the runner write the bytes on a worker thread and the row on the loop."""
        file_id = self.write_bytes(data, file_id)
        return self.record_file(file_id, len(data), filename, purpose, owner)

    def write_bytes(self, data: bytes, file_id: str | None = None) -> str:
        """The file's bytes under its id (temp file + rename: a crash leaves no half file under the id); returns
        the id. Touches no database, so any thread may run it: an upload writes and fsyncs off the event loop."""
        file_id = file_id or new_id("file-")
        path = self.file_path(file_id)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")  # its own: two writers of one id never share it
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # a failed write (a full disk) leaves nothing behind
        return file_id

    def discard_bytes(self, file_id: str) -> None:
        """Removes bytes `write_bytes` wrote that no row will ever list (an upload whose client left)."""
        self.file_path(file_id).unlink(missing_ok=True)

    def record_file(self, file_id: str, num_bytes: int, filename: str, purpose: str,
                    owner: str | None = None) -> dict:
        """The row of a file `write_bytes` wrote: from then on it is listed and readable."""
        obj = {"id": file_id, "object": "file", "bytes": num_bytes, "created_at": int(time.time()),
               "expires_at": None, "filename": filename, "purpose": purpose, "status": "processed",
               "status_details": None}
        self._db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)",
                         (file_id, self._next_seq("files"), purpose, owner, json.dumps(obj)))
        return obj

    def file_path(self, file_id: str) -> Path:
        # Ids are ours (new_id) but arrive in URLs: only the name part, so none points outside the folder.
        return self.folder / "files" / Path(file_id).name

    def file(self, file_id: str, owner: str | None = None) -> dict | None:
        row = self._row("files", file_id, owner)
        return json.loads(row[0]) if row else None

    def read_file(self, file_id: str) -> bytes:
        """Touches no database (any thread may run it)."""
        return self.file_path(file_id).read_bytes()

    def delete_file(self, file_id: str) -> bool:
        deleted = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0
        if deleted:
            self.file_path(file_id).unlink(missing_ok=True)
        return deleted

    def list_files(self, purpose: str | None, after: str | None, limit: int, newest_first: bool,
                   owner: str | None = None) -> Page:
        where, args = [], []
        if purpose:
            where.append("purpose = ?")
            args.append(purpose)
        return self._page("files", where, args, after, limit, newest_first, owner)

    # -- batches ---------------------------------------------------------------------------------------
    def add_batch(self, obj: dict, owner: str | None = None) -> None:
        self._db.execute("INSERT INTO batches VALUES (?, ?, ?, ?, ?)",
                         (obj["id"], self._next_seq("batches"), obj["status"], owner, json.dumps(obj)))

    def put_batch(self, obj: dict) -> None:
        self._db.execute("UPDATE batches SET status = ?, obj = ? WHERE id = ?",
                         (obj["status"], json.dumps(obj), obj["id"]))

    def batch(self, batch_id: str, owner: str | None = None) -> dict | None:
        row = self._row("batches", batch_id, owner)
        return self._with_counts(json.loads(row[0])) if row else None

    def batch_owner(self, batch_id: str) -> str | None:
        row = self._db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row[0] if row else None

    def list_batches(self, after: str | None, limit: int, owner: str | None = None) -> Page:
        page = self._page("batches", [], [], after, limit, True, owner)
        return Page([self._with_counts(b) for b in page.items], page.has_more)

    def active_batch_ids(self) -> list[str]:
        """Unfinished batches, oldest first: the order the runner takes them in."""
        marks = ",".join("?" * len(ACTIVE_STATUSES))
        rows = self._db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq", ACTIVE_STATUSES)
        return [r[0] for r in rows]

    def _with_counts(self, obj: dict) -> dict:
        completed, failed = self.counts(obj["id"])
        obj["request_counts"] = {"total": obj["request_counts"]["total"], "completed": completed, "failed": failed}
        return obj

    # -- answered lines --------------------------------------------------------------------------------
    def add_result(self, batch_id: str, idx: int, ok: bool, line: dict) -> None:
        self._db.execute("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?)",
                         (batch_id, idx, int(ok), json.dumps(line, ensure_ascii=False)))

    def answered(self, batch_id: str) -> set[int]:
        return {r[0] for r in self._db.execute("SELECT idx FROM results WHERE batch_id = ?", (batch_id,))}

    def counts(self, batch_id: str) -> tuple[int, int]:
        """(completed, failed) lines so far."""
        row = self._db.execute("SELECT COALESCE(SUM(ok), 0), COUNT(*) - COALESCE(SUM(ok), 0) FROM results "
                               "WHERE batch_id = ?", (batch_id,)).fetchone()
        return int(row[0]), int(row[1])

    def results(self, batch_id: str, ok: bool) -> list[str]:
        """The answered lines' JSON, in input order."""
        rows = self._db.execute("SELECT line FROM results WHERE batch_id = ? AND ok = ? ORDER BY idx",
                                (batch_id, int(ok)))
        return [r[0] for r in rows]

    # -- paging ----------------------------------------------------------------------------------------
    def _row(self, table: str, row_id: str, owner: str | None, column: str = "obj") -> tuple | None:
        where, args = _owned(["id = ?"], [row_id], owner)
        return self._db.execute(f"SELECT {column} FROM {table} WHERE {' AND '.join(where)}", args).fetchone()

    def _page(self, table: str, where: list[str], args: list, after: str | None, limit: int,
              newest_first: bool, owner: str | None) -> Page:
        where, args = _owned(where, args, owner)
        if after is not None:
            row = self._row(table, after, owner, "seq")  # another owner's id is an unknown cursor
            if row is not None:
                where = [*where, "seq < ?" if newest_first else "seq > ?"]
                args = [*args, row[0]]
        sql = f"SELECT obj FROM {table}" + (" WHERE " + " AND ".join(where) if where else "")
        sql += f" ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?"
        rows = self._db.execute(sql, (*args, limit + 1)).fetchall()
        return Page([json.loads(r[0]) for r in rows[:limit]], len(rows) > limit)


def _owned(where: list[str], args: list, owner: str | None) -> tuple[list[str], list]:
    """`where` narrowed to `owner`'s rows when one is given."""
    return ([*where, "owner = ?"], [*args, owner]) if owner is not None else (where, args)
