"""Prefix data only a prefill can give, copied while the prompt's own forwards run.

Each role that captures (kv/roles/) says what: a rotating (sliding-window) cache keeps only its last
window, so by the time the scheduler plans a block's store its sliding KV may be gone, and the prefill
copies each block still inside the window. A snapshot role's state (recurrent) exists only where a forward
stopped, so the prefill stops at the prompt's deepest block boundary (`snap_at`) and copies it there. Both
live on the request's `RowState` until its blocks are stored.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxhost.engine.request import Request
from mlxhost.engine.runner.state import RowState
from mlxhost.kv.roles import ROLES
from mlxhost.kv.store.kv_store import snapshot_arrays


def start_captures(row: RowState, request: Request, store: Any, block_size: int) -> None:
    if store is None or not any(r.captures and store.keeps(r) for r in store.layout.roles):
        return
    row.captured = {}
    if store.wants_snapshots:
        # The deepest boundary a later lookup of this prompt can resume at (one token is always
        # left to compute); deeper ones are snapshotted while decoding.
        at = (request.num_prefill_tokens - 1) // block_size * block_size
        if at > request.num_cached_tokens:
            row.snap_at = at


def capture(row: RowState, cache: list[Any], start: int, stop: int, num_cached: int, store: Any,
            block_size: int) -> list[mx.array]:
    """After a prefill forward over [start, stop): copies what only the prefill has. The per-block roles'
    parts they may lose (sliding KV of blocks still inside the window), and the snapshot roles' state if
    `stop` is the boundary chosen for a snapshot. Returns the new arrays."""
    captured = row.captured
    if captured is None:
        return []
    layout, new = store.layout, []
    for role in layout.roles:
        if not (role.captures and role.per_block):
            continue
        for b, part in role.capture_blocks(cache, layout, start, stop, num_cached, block_size).items():
            if (role.name, b) not in captured:
                captured[role.name, b] = part
                new.extend(role.arrays(part))
    if row.snap_at == stop:
        snap = {role.name: role.read_snapshot(cache, layout) for role in layout.snapshot_roles}
        row.prefill_snap = (stop, snap)
        new.extend(snapshot_arrays(snap))
    return new


def captured_arrays(row: RowState) -> list[mx.array]:
    snap = row.prefill_snap
    parts = [a for (name, _), part in (row.captured or {}).items() for a in ROLES[name].arrays(part)]
    return [*parts, *(snapshot_arrays(snap[1]) if snap else [])]
