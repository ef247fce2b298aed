"""Copies planned prefix-cache blocks out of a request's KV into the block store (MLX, engine thread).

The KV is either a decode-batch row (a request that has its first token) or the request's own batch-1
prefill cache (a prompt still prefilling, or one aborted in its prefill): the scheduler plans the full
blocks each prefill chunk completed, so a prefill that never ends still leaves its blocks cached.

Each per-block role (kv/roles/) gives its part of every block: what the prefill captured for it, else
what the KV still holds (full attention at any position, sliding layers while inside the window). Snapshot
roles (recurrent state) exist only where the KV ends (`is_row_end`), or at the boundary a prefill stopped
at for a snapshot, so a block elsewhere is stored without one (a later hit resumes at the deepest block
that has one).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxhost.kv.store.kv_store import KVBlock, KVBlockStore, snapshot_arrays


def copy_blocks(store: KVBlockStore, ops: list, cache: list[Any], row: int | None, pad: int | None,
                captured: dict[tuple[str, int], Any], prefill_snap: tuple[int, dict] | None) -> list[mx.array]:
    """Stores `ops`' blocks from `cache`: row `row` of a decode batch (`pad`: its left padding), or a
    batch-1 prefill cache (`row` None). `captured`: parts by (role, block start) that the prefill copied;
    `prefill_snap`: (position, snapshot) it copied. Returns the new arrays, still lazy."""
    bs, layout = store.block_size, store.layout
    parts: list[dict[str, Any]] = [{} for _ in ops]
    for role in layout.roles:
        if not role.per_block:
            continue
        starts = [op.start for op in ops if (role.name, op.start) not in captured]
        read = dict(zip(starts, role.read_blocks(cache, layout, row, pad, starts, bs))) if starts else {}
        for p, op in zip(parts, ops):
            p[role.name] = captured.get((role.name, op.start), read.get(op.start))
    new = []
    for op, p in zip(ops, parts):
        block = KVBlock(p)
        store.put(op.block_id, op.block_hash, block)
        store.queue_spill(op.block_hash, op.token_ids, block)
        new.extend(block.arrays)
        if not store.wants_snapshots:
            continue
        snap = None
        if op.is_row_end:  # the state is right after this block's last token
            snap = {role.name: role.read_snapshot(cache, layout, row) for role in layout.snapshot_roles}
        elif prefill_snap is not None and prefill_snap[0] == op.start + bs:
            snap = prefill_snap[1]
        if snap is not None and store.put_snapshot(op.block_hash, snap):
            store.queue_spill_snapshot(op.block_hash, op.token_ids, snap)
            new.extend(snapshot_arrays(snap))
    return new
