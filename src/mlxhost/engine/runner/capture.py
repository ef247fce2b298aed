"""Prefix data only a prefill can give, copied while the prompt's own forwards run.

A rotating (sliding-window) cache keeps only its last window, so by the time the scheduler plans a
block's store its sliding KV may be gone: the prefill copies each block still inside the window. A
recurrent state exists only where a forward stopped, so the prefill stops at the prompt's deepest
block boundary (`snap_at`) and copies the state there. Both live on the request's `RowState` until
its blocks are stored.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxhost.engine.request import Request
from mlxhost.engine.runner.state import RowState
from mlxhost.kv.kinds.recurrent import read_state
from mlxhost.kv.kinds.sliding import read_prefill_window


def start_captures(row: RowState, request: Request, store: Any, block_size: int) -> None:
    if store is None or not (store.layout.swa_layers or store.wants_snapshots):
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
    """After a prefill forward over [start, stop): copies what only the prefill has. The sliding
    layers' KV of blocks still inside their window, and the recurrent state if `stop` is the boundary
    chosen for a snapshot. Returns the new arrays."""
    captured = row.captured
    if captured is None:
        return []
    layout, bs, new = store.layout, block_size, []
    if layout.swa_layers and stop - start > 1:
        window = read_prefill_window(cache, layout)
        if window is not None:
            lowest = max(num_cached, window.offset - window.kv.shape[2])
            for b in range(-(-lowest // bs) * bs, stop - bs + 1, bs):
                block = window.block(b, bs) if b not in captured else None
                if block is not None:
                    captured[b] = block
                    new.append(block)
    if row.snap_at == stop:
        snap = read_state(cache, layout)
        row.prefill_snap = (stop, snap)
        new.extend(a for arrays in snap for a in arrays)
    return new


def captured_arrays(row: RowState) -> list[mx.array]:
    snap = row.prefill_snap
    return [*(row.captured or {}).values(), *(a for arrays in (snap[1] if snap else []) for a in arrays)]
