"""Copies planned prefix-cache blocks out of a request's KV into the block store (MLX, engine thread).

The KV is either a decode-batch row (a request that has its first token) or the request's own batch-1
prefill cache (a prompt still prefilling, or one aborted in its prefill): the scheduler plans the full
blocks each prefill chunk completed, so a prefill that never ends still leaves its blocks cached.

Per cache kind: full-attention layers (plain and MLA) are read at any position; sliding layers come
from what the prefill captured while the blocks were inside the window (or the window still held);
recurrent layers only have their state where the KV ends (`is_row_end`), or at the boundary a prefill
stopped at for a snapshot, so a block elsewhere is stored without one (a later hit resumes at the
deepest block that has one).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxhost.kv.kinds.plain import kv_slice, read_row_kv
from mlxhost.kv.kinds.recurrent import read_state
from mlxhost.kv.kinds.sliding import read_prefill_window, read_row_window
from mlxhost.kv.store.kv_store import KVBlock, KVBlockStore


def copy_blocks(store: KVBlockStore, ops: list, cache: list[Any], row: int | None, pad: int | None,
                captured: dict[int, mx.array], prefill_snap: tuple[int, list] | None) -> list[mx.array]:
    """Stores `ops`' blocks from `cache`: row `row` of a decode batch (`pad`: its left padding), or a
    batch-1 prefill cache (`row` None). `captured`: sliding KV by block start that the prefill copied;
    `prefill_snap`: (position, recurrent state) it copied. Returns the new arrays, still lazy."""
    bs, layout = store.block_size, store.layout
    first, end = ops[0].start, ops[-1].start + bs
    span = read_row_kv(cache, layout, row or 0, first, end, 0 if row is None else pad)
    window = None
    if layout.swa_layers and any(op.start not in captured for op in ops):
        window = read_row_window(cache, layout, row) if row is not None else read_prefill_window(cache, layout)
    new = []
    for op in ops:
        # Each block its own copy: a slice would keep the whole span alive while any block is.
        kv = kv_slice(span, op.start - first, op.start - first + bs) if span is not None else None
        swa = captured.get(op.start)
        if swa is None and window is not None:
            swa = window.block(op.start, bs)
        block = KVBlock(kv, swa)
        store.put(op.block_id, op.block_hash, block)
        store.queue_spill(op.block_hash, op.token_ids, block)
        new.extend(block.arrays)
        if not store.wants_snapshots:
            continue
        snap = None
        if op.is_row_end:  # the state is right after this block's last token
            snap = read_state(cache, layout, row)
        elif prefill_snap is not None and prefill_snap[0] == op.start + bs:
            snap = prefill_snap[1]
        if snap is not None and store.put_snapshot(op.block_hash, snap):
            store.queue_spill_snapshot(op.block_hash, op.token_ids, snap)
            new.extend(a for arrays in snap for a in arrays)
    return new
