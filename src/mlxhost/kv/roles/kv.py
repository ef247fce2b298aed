"""The "kv" role: attention layers (plain, MLA, quantized) whose keys and values every block holds.

A block holds the keys and values of its positions, concatenated on the last axis, for every such layer: one
array [layers, kv_heads, block_size, key_width + value_width] (one kernel per block, whatever the two widths);
`KVLayout.key_width` splits them back. Under --kv-bits it is a tuple of three such arrays (packed data,
scales, biases). On the SSD tier they are the block file's "kv" tensor (or its three `QUANT_TENSORS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxhost.kv.kinds.plain import cat
from mlxhost.kv.kinds.registry import KV
from mlxhost.kv.roles.base import CacheRole, Tensors, check_rows, from_bytes

if TYPE_CHECKING:
    from mlxhost.kv.kinds.layout import KVLayout

KVArrays = mx.array | tuple[mx.array, ...]  # a float block array, or the quantized tuple

# A quantized block's kv tuple on disk (the header's kv_quant field says how it was quantized).
QUANT_TENSORS = ("kv.data", "kv.scales", "kv.biases")


def parts(x: KVArrays) -> tuple[mx.array, ...]:
    return x if isinstance(x, tuple) else (x,)


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
    layers = [batch_cache[i] for i in layout.layers_of(KV)]
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


class KVRole(CacheRole):
    name = KV

    def read_blocks(self, cache, layout, row, pad, starts, block_size):
        # One span for all the blocks, then each block its own copy.
        first = starts[0]
        span = read_row_kv(cache, layout, row or 0, first, starts[-1] + block_size, 0 if row is None else pad)
        if span is None:
            return [None] * len(starts)
        return [kv_slice(span, s - first, s - first + block_size) for s in starts]

    def fill(self, cache: list[Any], layout: KVLayout, kv: list[KVArrays], num_tokens: int) -> None:
        """The full-attention layers of a fresh per-request cache, from every block up to `num_tokens`."""
        split = [parts(b) for b in kv]
        full = [mx.concatenate(list(p), axis=2) if len(kv) > 1 else p[0] for p in zip(*split)]
        widths = layout.key_widths()
        for j, i in enumerate(self.layers(layout)):
            keys = tuple(a[j, :, :, :w][None] for a, w in zip(full, widths))
            values = tuple(a[j, :, :, w:][None] for a, w in zip(full, widths))
            if layout.kv_bits:  # mlx-lm's QuantizedKVCache state
                cache[i].state = (keys, values, num_tokens, layout.kv_group_size, layout.kv_bits)
            else:
                cache[i].state = (keys[0], values[0], num_tokens)

    def arrays(self, part: KVArrays | None) -> list[mx.array]:
        return [] if part is None else list(parts(part))

    def to_tensors(self, part: KVArrays) -> dict[str, mx.array]:
        return dict(zip(QUANT_TENSORS, part)) if isinstance(part, tuple) else {"kv": part}

    def from_tensors(self, tensors: Tensors, layout: KVLayout, dtype: mx.Dtype) -> KVArrays:
        num_layers = len(self.layers(layout))
        if not layout.kv_bits:
            kv = from_bytes(*tensors["kv"], dtype)
            check_rows(kv, num_layers)
            return kv
        kv = tuple(from_bytes(*tensors[name], dt) for name, dt in zip(QUANT_TENSORS, (mx.uint32, dtype, dtype)))
        for part, width in zip(kv, layout.key_widths()):
            check_rows(part, num_layers)
            if part.shape[-1] <= width or part.shape[:3] != kv[0].shape[:3]:
                raise ValueError(f"quantized part of shape {part.shape} does not fit this layout")
        return kv


KV_ROLE = KVRole()
