"""Moving prefix-cache data between mlx-lm caches and blocks: reading a decode-batch row or a
prefill cache out, filling a fresh per-request cache in. Pure functions over a `KVLayout`.

Attention layers travel as keys and values concatenated on the last axis (one kernel per block,
whatever the two widths); `key_width` splits them back. Quantized KV (`--kv-bits`) travels as a tuple
of three such arrays (packed data, scales, biases); `KVArrays` is either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxserve.kv.kinds.layout import KVLayout

Snapshot = list[list[mx.array]]  # per recurrent layer, its ArraysCache arrays (batch 1)
KVArrays = mx.array | tuple[mx.array, ...]  # a float block array, or the quantized tuple


def _cat(keys: mx.array, values: mx.array) -> mx.array:
    return mx.concatenate([keys, values], axis=-1)


def _parts(x: KVArrays) -> tuple[mx.array, ...]:
    return x if isinstance(x, tuple) else (x,)


def kv_arrays(x: KVArrays | None) -> list[mx.array]:
    """The arrays of a block's kv (one float array or the quantized three), for eval and byte counts."""
    return [] if x is None else list(_parts(x))


def kv_slice(span: KVArrays, start: int, end: int) -> KVArrays:
    """Own copies of positions [start, end) of a span read by `read_row_kv` (a slice would keep the
    whole span alive while any block is)."""
    parts = tuple(mx.contiguous(a[:, :, start:end]) for a in _parts(span))
    return parts if isinstance(span, tuple) else parts[0]


def read_row_kv(batch_cache: list[Any], layout: KVLayout, row: int, start: int, end: int,
                pad: int | None = None) -> KVArrays | None:
    """Positions [start, end) of the full-attention layers of one decode-batch row, as one array
    [layers, kv_heads, end - start, key_width + value_width] (per part of the tuple when quantized).
    Rows are left-padded; all of them share the row's padding: `pad` when the caller knows it (the
    decode batch keeps it on the host), else read from the cache, a sync with the device."""
    layers = [batch_cache[i] for i in layout.full_layers]
    if not layers:
        return None
    if pad is None:
        # A lone row decoding through a plain KVCache (DecodeBatch's lean path) has no padding.
        padding = getattr(layers[0], "left_padding", None)
        pad = padding[row].item() if padding is not None else 0
    lo, hi = pad + start, pad + end
    if layout.kv_bits:
        return tuple(mx.stack([_cat(c.keys[p][row, :, lo:hi], c.values[p][row, :, lo:hi]) for c in layers])
                     for p in range(3))
    return mx.stack([_cat(c.keys[row, :, lo:hi], c.values[row, :, lo:hi]) for c in layers])


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
    parts = [batch_cache[i].extract(row) for i in layout.swa_layers]
    return Window(parts[0].offset, mx.stack([_cat(c.keys[0], c.values[0]) for c in parts]))


def read_prefill_window(cache: list[Any], layout: KVLayout) -> Window | None:
    """A batch-1 rotating cache right after a multi-token forward: mlx-lm's concatenating update keeps
    it in temporal order and holds every position of that forward (plus the window before it)."""
    if not layout.swa_layers:
        return None
    parts = [cache[i] for i in layout.swa_layers]
    n = parts[0].keys.shape[2]
    if any(c._idx != n for c in parts):  # not the temporal order of a concatenating update
        return None
    return Window(parts[0].offset, mx.stack([_cat(c.keys[0], c.values[0]) for c in parts]))


def read_state(cache: list[Any], layout: KVLayout, row: int | None = None) -> Snapshot:
    """Copies of the recurrent layers' arrays (of one batch row, or of a batch-1 cache)."""
    def take(a: mx.array) -> mx.array:
        return mx.contiguous(a if row is None else a[row : row + 1])

    return [[take(a) for a in cache[i].cache] for i in layout.state_layers]


def fill_cache(cache: list[Any], layout: KVLayout, kv: list[KVArrays], swa: list[mx.array],
               num_tokens: int, snapshot: Snapshot | None) -> None:
    """Fills a fresh per-request cache (make_prompt_cache) to resume after `num_tokens` prompt tokens:
    full layers from every block, sliding layers from the blocks covering their window (`swa`, in
    order, ending at `num_tokens`), recurrent layers from the snapshot taken at `num_tokens`."""
    d = layout.key_width
    if layout.full_layers:
        parts = [_parts(b) for b in kv]
        full = [mx.concatenate(list(p), axis=2) if len(kv) > 1 else p[0] for p in zip(*parts)]
        widths = layout.key_widths()
        for j, i in enumerate(layout.full_layers):
            keys = tuple(a[j, :, :, :w][None] for a, w in zip(full, widths))
            values = tuple(a[j, :, :, w:][None] for a, w in zip(full, widths))
            if layout.kv_bits:  # mlx-lm's QuantizedKVCache state
                cache[i].state = (keys, values, num_tokens, layout.kv_group_size, layout.kv_bits)
            else:
                cache[i].state = (keys[0], values[0], num_tokens)
    if layout.swa_layers:
        win = mx.concatenate(swa, axis=2) if len(swa) > 1 else swa[0]
        n = num_tokens - layout.window_start(num_tokens)
        win = win[:, :, win.shape[2] - n :]
        for j, i in enumerate(layout.swa_layers):
            keys, values = win[j, :, :, :d][None], win[j, :, :, d:][None]
            c = cache[i]
            # The state mlx-lm's rotating cache has after a concatenating update of these positions:
            # temporal order, write index at the end, nothing kept at the front.
            c.state = (mx.contiguous(keys), mx.contiguous(values), num_tokens, 0, c.max_size, n)
    for j, i in enumerate(layout.state_layers):
        cache[i].cache = list(snapshot[j])
