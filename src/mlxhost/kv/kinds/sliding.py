"""The sliding-window kind, mlx-lm's `RotatingKVCache` (`BatchRotatingKVCache` in the decode batch), and
the block I/O of "swa" layers.

A block holds these layers' keys and values of its positions (the plain kind's layout, a second array) when
they were still in the window at store time; a hit needs them only for the blocks covering the window where
it resumes. A rotating cache that keeps its first tokens (`keep` > 0) cannot be rebuilt from blocks. Nor can
a rejected draft be rewound: the ring has overwritten what the draft displaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from mlxhost.kv.kinds.plain import cat
from mlxhost.kv.kinds.registry import SWA, CacheKind, LayerSpec

if TYPE_CHECKING:
    from mlxhost.kv.kinds.layout import KVLayout


def _spec(c: Any) -> LayerSpec | None:
    if c.keep != 0 or c.keys is None or c.keys.shape[1] != c.values.shape[1]:
        return None
    return LayerSpec(SWA, (c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype), window=c.max_size)


SLIDING = CacheKind("sliding", (RotatingKVCache,), (BatchRotatingKVCache,), can_batch=True, can_store=True,
                    spec=_spec)


@dataclass
class Window:
    """The sliding layers' KV of the last positions a rotating cache still holds, in temporal order:
    `kv` [layers, kv_heads, n, width] covers positions [offset - n, offset)."""

    offset: int
    kv: mx.array

    def block(self, start: int, size: int) -> mx.array | None:
        """A copy of positions [start, start + size), or None if some left the window."""
        n = self.kv.shape[2]
        if start < self.offset - n or start + size > self.offset:
            return None
        i = n - (self.offset - start)
        return mx.contiguous(self.kv[:, :, i : i + size])


def read_row_window(batch_cache: list[Any], layout: KVLayout, row: int) -> Window | None:
    """One decode-batch row's sliding window, through mlx-lm's `extract` (ring order and left padding
    undone there)."""
    if not layout.swa_layers:
        return None
    rows = [batch_cache[i].extract(row) for i in layout.swa_layers]
    return Window(rows[0].offset, mx.stack([cat(c.keys[0], c.values[0]) for c in rows]))


def read_prefill_window(cache: list[Any], layout: KVLayout) -> Window | None:
    """A batch-1 rotating cache right after a multi-token forward: mlx-lm's concatenating update keeps
    it in temporal order and holds every position of that forward (plus the window before it)."""
    if not layout.swa_layers:
        return None
    layers = [cache[i] for i in layout.swa_layers]
    n = layers[0].keys.shape[2]
    if any(c._idx != n for c in layers):  # not the temporal order of a concatenating update
        return None
    return Window(layers[0].offset, mx.stack([cat(c.keys[0], c.values[0]) for c in layers]))


def fill_window(cache: list[Any], layout: KVLayout, swa: list[mx.array], num_tokens: int) -> None:
    """The sliding layers of a fresh per-request cache, from the blocks covering their window (`swa`, in
    order, ending at `num_tokens`)."""
    if not layout.swa_layers:
        return
    d = layout.key_width
    win = mx.concatenate(swa, axis=2) if len(swa) > 1 else swa[0]
    n = num_tokens - layout.window_start(num_tokens)
    win = win[:, :, win.shape[2] - n :]
    for j, i in enumerate(layout.swa_layers):
        keys, values = win[j, :, :, :d][None], win[j, :, :, d:][None]
        c = cache[i]
        # The state mlx-lm's rotating cache has after a concatenating update of these positions:
        # temporal order, write index at the end, nothing kept at the front.
        c.state = (mx.contiguous(keys), mx.contiguous(values), num_tokens, 0, c.max_size, n)
