"""Runs a step plan's cache ops (`kv/cache_ops.py`) on the physical half: the one place the store does what
the prefix cache decided. Called once at the start of the runner's step, so every rank runs the same ops."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from mlxhost.kv.cache_ops import (
    CacheOp,
    CacheResults,
    CheckResume,
    ClearDisk,
    DropBlock,
    LoadBlock,
    PinSnapshot,
    UnpinSnapshot,
)

log = logging.getLogger(__name__)

NO_RESULTS = CacheResults()


def run_cache_ops(store: Any, ops: Sequence[CacheOp]) -> CacheResults:
    """Runs `ops` in order on `store` (a `KVBlockStore`, or None without a prefix cache). A load that fails
    is a result, never an error: its block is a miss for the requests that hit it."""
    if store is None or not ops:
        return NO_RESULTS
    # Pins and unpins first, in order: a snapshot pinned for a hit is then safe from the ones this plan's checks
    # read from disk (which may evict unpinned snapshots to make room).
    ended: dict[str, int] = {}  # request id -> the plan's last unpin of it: its hold ended there
    for i, op in enumerate(ops):
        match op:
            case PinSnapshot(request_id, block_hash):
                store.snapshots.pin(request_id, block_hash)
            case UnpinSnapshot(request_id):
                store.release(request_id)
                ended[request_id] = i
    failed: list[int] = []
    depths: list[tuple[str, int]] = []
    for i, op in enumerate(ops):
        match op:
            case DropBlock(block_id):
                store.drop(block_id)
            case LoadBlock(block_id, block_hash, token_ids):
                try:
                    ok = store.load_from_ssd(block_hash, token_ids, block_id)
                except Exception:  # an unreadable file is a miss, as the tier's own checks make it
                    log.exception("reading block %d from the SSD tier failed", block_id)
                    ok = False
                if not ok:
                    failed.append(block_id)
            case CheckResume(request_id, block_ids, block_hashes, token_ids) if ended.get(request_id, -1) > i:
                depths.append((request_id, 0))  # its hold ended later in this plan: nothing to pin for it
            case CheckResume(request_id, block_ids, block_hashes, token_ids):
                # A hit ends before its first block whose load failed, then where the store can resume.
                n = next((j for j, b in enumerate(block_ids) if b in failed), len(block_ids))
                while n and not store.can_resume(request_id, block_ids[:n], block_hashes[n - 1], token_ids[n - 1]):
                    n -= 1
                depths.append((request_id, n))
            case PinSnapshot() | UnpinSnapshot():
                pass  # done above
            case ClearDisk():
                store.clear_ssd()
            case _:
                raise TypeError(f"unknown cache op {op!r}")
    return CacheResults(tuple(failed), tuple(depths), tuple(store.take_lost_windows()))
