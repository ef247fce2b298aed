"""The SSD cold tier of the prefix cache: one safetensors file per KV block (`ssd_format.py`).

Files are named by the block's chained hash (`hashing.disk_key`), so they survive restarts. A file
failing any check is a miss and is deleted, never an error. No MLX here.

Threads: `put` only enqueues; one writer thread writes (temp file, fsync, rename) and keeps the
size cap; `get` reads on the caller's thread. The index (hash -> size, LRU order) is shared and
guarded by one lock; file I/O stays outside it. The directory belongs to the tier.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mlxhost.kv.hashing import disk_key
from mlxhost.kv.store.ssd_format import (
    BLOCK_SUFFIX,
    METADATA,
    TMP_SUFFIX,
    BadFile,
    BlockData,
    BlockMeta,
    Incompatible,
    TokenMismatch,
    encode,
    hash_from_name,
    read_block,
    read_header,
)


@dataclass(eq=False)  # identity tells the entry a reader saw from a later rewrite
class _Entry:
    size: int


class SSDTier:
    """Content-addressed KV blocks on disk, bounded by `max_bytes`, LRU-evicted."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, meta: BlockMeta, *,
                 writer_queue_size: int = 256, logger: logging.Logger | None = None) -> None:
        if max_bytes <= 0 or writer_queue_size <= 0:
            raise ValueError(f"need positive sizes, got {max_bytes=} {writer_queue_size=}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.meta = meta
        self._log = logger or logging.getLogger(__name__)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified whenever _pending shrinks
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # front = least recently used
        # Queued or being written: served from memory so a block is never in neither tier.
        self._pending: dict[bytes, BlockData] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=writer_queue_size)
        self._bytes = 0
        self._closed = False
        names = ("writes", "dropped_writes", "write_errors", "reads", "hits", "misses", "collisions",
                 "corrupt_removed", "incompatible_removed", "evictions")
        self._counts = dict.fromkeys(names, 0)
        self._scan()
        self._writer = threading.Thread(target=self._run_writer, name="ssd-tier-writer", daemon=True)
        self._writer.start()

    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def put(self, block_hash: bytes, block: BlockData) -> bool:
        """Queue a block for writing; never waits. False if dropped or already stored."""
        if len(block.token_ids) != self.meta.block_size:
            raise ValueError(f"a block has {self.meta.block_size} tokens, got {len(block.token_ids)}")
        views = [memoryview(buf) for buf, _ in block.tensors.values()]
        if METADATA in block.tensors or not all(v.c_contiguous for v in views):
            raise ValueError("tensor buffers must be C-contiguous and not named __metadata__")
        nbytes = sum(v.nbytes for v in views)
        with self._lock:
            if self._closed or block_hash in self._pending:
                return False
            if block_hash in self._index:
                self._index.move_to_end(block_hash)  # it just left the GPU pool: it is hot
                return False
            # Too big to ever fit, or the disk is behind: losing a cache write beats a stalled step.
            if nbytes > self.max_bytes or self._queue.full():  # only we fill it, under this lock
                self._counts["dropped_writes"] += 1
                return False
            self._queue.put_nowait((block_hash, block))
            self._pending[block_hash] = block
            return True

    def get(self, block_hash: bytes, token_ids: Sequence[int]) -> BlockData | None:
        """The stored block if it is intact and holds exactly `token_ids`, else None."""
        tokens = tuple(token_ids)
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is not None:
                if tuple(pending.token_ids) == tokens:
                    self._counts["hits"] += 1
                    return pending
                self._counts["collisions"] += 1
            entry = self._index.get(block_hash) if pending is None else None
            if entry is None:
                self._counts["misses"] += 1
                return None
            self._counts["reads"] += 1
        path = self._path(block_hash)
        try:
            block = read_block(path, self.meta, block_hash, tokens)
        except (BadFile, OSError) as exc:
            self._on_bad_read(block_hash, entry, path, exc)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # the mtime carries the LRU order across restarts
        with self._lock:
            if self._index.get(block_hash) is entry:
                self._index.move_to_end(block_hash)
            self._counts["hits"] += 1
        return block

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk (or failed); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def clear(self) -> int:
        """Delete every block file, queued ones included; returns how many."""
        self.flush()  # else a queued write would land after the sweep
        with self._lock:
            self._index.clear()
            self._bytes = 0
        count = 0
        for item in os.scandir(self.directory):
            if hash_from_name(item.name) is not None and self._unlink(item.path):
                count += 1
        return count

    def close(self) -> None:
        """Write what is queued, then stop the writer. Later puts are refused; gets still work."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush()
        self._queue.put(None)
        self._writer.join()

    def stats(self) -> dict:
        with self._lock:
            return {"num_blocks": len(self._index), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "pending_writes": len(self._pending), **self._counts}

    def _on_bad_read(self, block_hash: bytes, entry: _Entry, path: Path, exc: Exception) -> None:
        with self._lock:
            # Only drop what we read: the writer may have evicted or rewritten it meanwhile.
            ours = self._index.get(block_hash) is entry
            if ours:
                del self._index[block_hash]
                self._bytes -= entry.size
            self._counts["misses"] += 1
            if isinstance(exc, BadFile):
                self._counts["collisions" if isinstance(exc, TokenMismatch) else "corrupt_removed"] += 1
        # A vanished file is a race with eviction, not damage.
        level = logging.DEBUG if isinstance(exc, FileNotFoundError) else logging.WARNING
        self._log.log(level, "ssd tier: dropping block %s: %s", disk_key(block_hash), exc)
        if ours:
            self._unlink(path)

    def _scan(self) -> None:
        """Rebuild the index from the directory, dropping crash leftovers and foreign files."""
        found = []
        for item in os.scandir(self.directory):
            if item.name.endswith(TMP_SUFFIX):  # a write cut short by a crash
                self._log.info("ssd tier: removing leftover temp file %s", item.name)
                self._unlink(item.path)
                continue
            block_hash = hash_from_name(item.name)
            if block_hash is None:
                continue
            try:
                st = item.stat()
                with open(item.path, "rb") as f:  # headers only: checksums are verified on read
                    read_header(f, self.meta, st.st_size)
            except (BadFile, OSError) as exc:
                kind = "incompatible_removed" if isinstance(exc, Incompatible) else "corrupt_removed"
                self._counts[kind] += 1
                self._log.info("ssd tier: removing %s (%s)", item.name, exc)
                self._unlink(item.path)
                continue
            found.append((st.st_mtime_ns, block_hash, st.st_size))
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = _Entry(size)
            self._bytes += size
        for block_hash in self._pick_victims(keep=None):  # the cap may have been lowered
            self._unlink(self._path(block_hash))
        self._log.info("ssd tier: %d blocks, %d bytes in %s", len(self._index), self._bytes, self.directory)

    def _run_writer(self) -> None:
        """The writer thread: write each queued block, index it, evict down to the cap."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            block_hash, block = item
            size = error = None
            try:
                size = self._write_block(block_hash, block)
            # Anything (disk full, a bad buffer) costs this block only: the thread must live on.
            except Exception as exc:  # noqa: BLE001
                error = exc
            victims = []
            with self._lock:
                if error is not None:
                    self._counts["write_errors"] += 1
                    num_errors = self._counts["write_errors"]
                else:  # a new entry: put refuses hashes already indexed
                    self._index[block_hash] = _Entry(size)
                    self._bytes += size
                    self._counts["writes"] += 1
                    victims = self._pick_victims(keep=block_hash)
            # A full disk fails every write: log the first failure and every 100th, not each.
            if error is not None and (num_errors == 1 or num_errors % 100 == 0):
                self._log.warning("ssd tier: writing %s failed (%d failures so far): %r",
                                  disk_key(block_hash), num_errors, error)
            for victim in victims:
                self._unlink(self._path(victim))
            with self._lock:
                self._pending.pop(block_hash, None)
                self._idle.notify_all()

    def _write_block(self, block_hash: bytes, block: BlockData) -> int:
        """Write atomically: a reader or a crash sees the whole file or none of it."""
        prefix, buffers = encode(self.meta, block_hash, block)
        final = self._path(block_hash)
        tmp = final.with_name(f"{final.name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(prefix)
                for buf in buffers:
                    f.write(buf)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, final)
        except BaseException:
            self._unlink(tmp)
            raise
        # Makes the rename itself durable across power loss; not every platform allows it.
        with contextlib.suppress(OSError):
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return size

    def _pick_victims(self, keep: bytes | None) -> list[bytes]:
        """Drop LRU entries until under the cap, sparing `keep`; caller holds the lock."""
        victims = []
        while self._bytes > self.max_bytes and self._index:
            block_hash, entry = next(iter(self._index.items()))
            if block_hash == keep:  # only the newest block is left
                break
            del self._index[block_hash]
            self._bytes -= entry.size
            self._counts["evictions"] += 1
            victims.append(block_hash)
        return victims

    def _path(self, block_hash: bytes) -> Path:
        return self.directory / (disk_key(block_hash) + BLOCK_SUFFIX)

    def _unlink(self, path) -> bool:
        try:
            os.unlink(path)
            return True
        except OSError:
            return False
