"""KV pre-allocation: widen the decode batch's KV buffers up front so decoding writes in place.

mlx-lm's `BatchKVCache.update_and_fetch` writes a new position into `keys[..., idx, :]` while the
buffer has room, and otherwise concatenates another 256 positions, a copy of the whole cache: memory
climbs in a staircase and each stair briefly holds the old and the new buffer. When the buffer is
already `tokens` wide, every decode step up to there is an in-place write and active memory stays flat;
past it mlx-lm's own growth takes over, unchanged.

The reservation is the batch's width: positions including the left padding that aligns its rows.
`filter` (a row leaves) keeps the room (it trims the padding off both the index and the width), and
`extend` (rows join) keeps the widest buffer, so it is renewed only after a join. Only the cache's
public state is touched (`state`, `size()`), the way mlx-lm's own merge/extend build caches.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache

from mlxhost.kv.kinds import KINDS


def reserve(batch_cache: list[Any], tokens: int) -> int:
    """Pads each `BatchKVCache` layer's keys and values with empty positions up to `tokens` wide.

    Other cache kinds (rotating windows, recurrent state) have a fixed size already and are left as
    they are. Returns the bytes added (0 when every buffer was wide enough)."""
    added = 0
    for c in batch_cache:
        if not KINDS.can_reserve(c):
            continue
        width = _width(c)
        if width >= tokens:
            continue
        before = c.nbytes
        keys, values, offset, left_padding, idx = c.state
        pad = [(0, 0), (0, 0), (0, tokens - width), (0, 0)]
        # Quantized KV (BatchQuantizedKVCache) pads each part of its (data, scales, biases) tuples.
        keys, values = tree_map(lambda a: mx.pad(a, pad), (keys, values))
        c.state = (keys, values, offset, left_padding, idx)
        added += c.nbytes - before
    return added


def _width(c: BatchKVCache) -> int:
    return (c.keys[0] if isinstance(c.keys, tuple) else c.keys).shape[2]


def room(batch_cache: list[Any]) -> int | None:
    """Positions the batch can still write in place (None without a plain batch cache)."""
    for c in batch_cache:
        if KINDS.can_reserve(c):
            return _width(c) - c.size()
    return None
