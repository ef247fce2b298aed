"""The plain attention kind, mlx-lm's `KVCache` (a request's) and `BatchKVCache` (the decode batch's), and the
block I/O of every "kv" layer: quantized ones (quantized.py) keep the same block layout as a tuple of parts.

A block holds the keys and values of its positions, concatenated on the last axis, for every such layer: one
array [layers, kv_heads, block_size, key_width + value_width] (one kernel per block, whatever the two widths);
`KVLayout.key_width` splits them back. Under --kv-bits it is a tuple of three such arrays (packed data,
scales, biases); `KVArrays` is either.

MLA has no cache class of its own: DeepSeek's layers are `KVCache`s whose keys (the latent) and values (the
rope part) differ in width. The spec records both widths; only --kv-bits tells them apart (kv_quant.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxhost.kv.kinds.registry import KV, CacheKind, LayerSpec

if TYPE_CHECKING:
    from mlxhost.kv.kinds.layout import KVLayout

KVArrays = mx.array | tuple[mx.array, ...]  # a float block array, or the quantized tuple


def _spec(c: Any) -> LayerSpec | None:
    if c.keys is None or c.keys.shape[1] != c.values.shape[1]:
        return None
    return LayerSpec(KV, (c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype), quant=(0, 0))


PLAIN = CacheKind("plain", (KVCache,), (BatchKVCache,), can_batch=True, can_pad=True, can_rewind=True,
                  can_store=True, can_quantize=True, can_reserve=True, spec=_spec)


def cat(keys: mx.array, values: mx.array) -> mx.array:
    return mx.concatenate([keys, values], axis=-1)


def parts(x: KVArrays) -> tuple[mx.array, ...]:
    return x if isinstance(x, tuple) else (x,)


def kv_arrays(x: KVArrays | None) -> list[mx.array]:
    """The arrays of a block's kv (one float array or the quantized three), for eval and byte counts."""
    return [] if x is None else list(parts(x))


def kv_slice(span: KVArrays, start: int, end: int) -> KVArrays:
    """Own copies of positions [start, end) of a span read by `read_row_kv` (a slice would keep the
    whole span alive while any block is)."""
    out = tuple(mx.contiguous(a[:, :, start:end]) for a in parts(span))
    return out if isinstance(span, tuple) else out[0]


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
        return tuple(mx.stack([cat(c.keys[p][row, :, lo:hi], c.values[p][row, :, lo:hi]) for c in layers])
                     for p in range(3))
    return mx.stack([cat(c.keys[row, :, lo:hi], c.values[row, :, lo:hi]) for c in layers])


def fill_kv(cache: list[Any], layout: KVLayout, kv: list[KVArrays], num_tokens: int) -> None:
    """The full-attention layers of a fresh per-request cache, from every block up to `num_tokens`."""
    if not layout.full_layers:
        return
    split = [parts(b) for b in kv]
    full = [mx.concatenate(list(p), axis=2) if len(kv) > 1 else p[0] for p in zip(*split)]
    widths = layout.key_widths()
    for j, i in enumerate(layout.full_layers):
        keys = tuple(a[j, :, :, :w][None] for a, w in zip(full, widths))
        values = tuple(a[j, :, :, w:][None] for a, w in zip(full, widths))
        if layout.kv_bits:  # mlx-lm's QuantizedKVCache state
            cache[i].state = (keys, values, num_tokens, layout.kv_group_size, layout.kv_bits)
        else:
            cache[i].state = (keys[0], values[0], num_tokens)
